"""An exact resume of TRL's GRPOTrainer: the generation batch in flight travels with each checkpoint.

TRL generates once per `steps_per_generation x num_iterations` micro-steps, buffers the shuffled generation
batch (`_buffered_inputs`) and serves it slice by slice (`_step`, its micro-step counter); neither is part of
a Trainer checkpoint. A run resumed from a checkpoint inside a generation batch therefore starts with
`_step = 0` and no buffer: it generates again, at another step (other sampling seeds, other reward-token
draws), from the weights of the checkpoint rather than those the batch was generated with, and trains the
later steps of the batch on the first slice of that new one. The uninterrupted run and the resumed one part
there, for good.

`GenerationStateMixin` saves, beside the Trainer's RNG states (`_save_rng_state`, one file per process as
the Trainer's own), TRL's counter and, where the next micro-step reads it, the buffer; it restores them where
the Trainer restores the RNG states (`_load_rng_state`: after the data loader skipped the trained batches,
before the first resumed micro-step), so the resumed run trains the same slices of the same generation. A
checkpoint without the file (written by another trainer) resumes as TRL does. Nothing else changes: a
checkpoint holds one more small file (nothing but `_step` when the next micro-step generates anyway).
"""

from __future__ import annotations

import os

GENERATION_STATE = "rcgrpo_generation_state"
"""File name stem in each checkpoint: `rcgrpo_generation_state.pt`, or `..._<process>.pt` under several
processes (as the Trainer's `rng_state_<process>.pth`)."""


class GenerationStateMixin:
    """Before TRL's `GRPOTrainer` in the MRO: its generation buffer and micro-step counter saved and restored
    with the Trainer's RNG states (module docstring). A subclass adds what it keeps of the batch in flight
    through `_in_flight_extras` / `_restore_in_flight_extras` (plain values, loadable with `weights_only`)."""

    def _generation_state_path(self, folder: str) -> str:
        suffix = f"_{self.args.process_index}" if self.args.world_size > 1 else ""
        return os.path.join(folder, f"{GENERATION_STATE}{suffix}.pt")

    def _in_flight_extras(self) -> dict:
        """What a subclass keeps of the generation batch in flight, saved with it."""
        return {}

    def _restore_in_flight_extras(self, extras: dict) -> None:
        """Restore `_in_flight_extras` (called only where a batch in flight was saved)."""

    def _save_rng_state(self, output_dir: str) -> None:
        import torch

        super()._save_rng_state(output_dir)
        generate_every = self.args.steps_per_generation * self.num_iterations
        in_flight = self._step % generate_every != 0 and self._buffered_inputs is not None
        state = {"step": self._step, "buffer": self._buffered_inputs if in_flight else None,
                 "extras": self._in_flight_extras() if in_flight else None}
        torch.save(state, self._generation_state_path(output_dir))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        import torch

        super()._load_rng_state(checkpoint)
        path = self._generation_state_path(checkpoint) if checkpoint is not None else None
        if path is None or not os.path.isfile(path):
            return
        state = torch.load(path, map_location=self.accelerator.device, weights_only=True)
        self._step, self._buffered_inputs = state["step"], state["buffer"]
        if state["extras"] is not None:
            self._restore_in_flight_extras(state["extras"])
