"""What the SFT / RCTP trainer adds to TRL's `SFTTrainer` (`RcgrpoSFTTrainerMixin`): trained tokens/s in the
logs, the reward-token rows' own learning rate, the CPU loss over assistant positions only, the dataset's own
order where it matters (`row_order: pairs`), small adapter saves, TRL's token count across a resume.
`trainer.build_trainer` builds it (`callbacks.lazy_subclass`: TRL is imported only then)."""

from __future__ import annotations

import json
import os
import time

from rcgrpo_tasks.train.common.adapters import (
    compact_head_loss,
    scale_row_updates,
    small_adapter_saves,
    token_lr_groups,
    trainable_token_params,
)
from rcgrpo_tasks.train.common.checkpoints import TOKEN_COUNT_STEM


class RcgrpoSFTTrainerMixin:
    """SFTTrainer that also logs trained tokens/s (tokens of the batches since the last log / wall time),
    computes the CPU loss over assistant positions only (`compact_lm_head`) and saves small adapters."""

    compact_lm_head = True
    shared_prefix: int | None = None
    """`SftConfig.shared_prefix_min_tokens` (`trainer.build_trainer` sets it)."""
    keep_order = False
    """The dataset's order is the training order (`row_order: pairs`); otherwise TRL's random sampler."""
    objective = None
    """`objective.rctp_objective`'s hook (first-token weight, unlikelihood), or None: the plain NLL."""
    token_lr: tuple[float, list[int]] = (1.0, [])
    """(multiplier, token ids): the added tokens' rows train at multiplier x lr (`SftConfig.token_lr_multiplier`)."""
    token_ids: tuple[int, ...] = ()
    """The ids of the tokens the run added (`tokens` order; `trainer.build_trainer` sets them)."""
    data_stats: dict | None = None
    """What tokenizing the rows kept and dropped (`rows.tokenize_rows`; the run summary's `data`)."""

    def create_optimizer(self, model=None):
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        multiplier, ids = self.token_lr
        if fresh and multiplier != 1.0 and ids:
            inner = self.accelerator.unwrap_model(model if model is not None else self.model)
            params = trainable_token_params(inner)
            if params:  # LoRA: PEFT's trainable-token rows are parameters of their own
                token_lr_groups(optimizer, params, multiplier)
            else:  # full fine-tuning: rows of the (input and, if untied, output) embedding matrices
                mats = {id(m.weight): m.weight for m in (inner.get_input_embeddings(), inner.get_output_embeddings())
                        if m is not None and m.weight.requires_grad}
                scale_row_updates(optimizer, list(mats.values()), ids, multiplier)
        return optimizer

    def _get_train_sampler(self, *args, **kwargs):
        if self.keep_order:  # one process: under DDP each rank would need its own slice of the pairs
            import torch

            return torch.utils.data.SequentialSampler(self.train_dataset)
        return super()._get_train_sampler(*args, **kwargs)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        now = time.perf_counter()
        if "loss" in logs and self.model.training:
            last_t, last_n = getattr(self, "_rcgrpo_tick", (self._rcgrpo_t0, 0))
            tokens = self._total_train_tokens
            logs["tokens_per_s"] = (tokens - last_n) / max(now - last_t, 1e-9)
            self._rcgrpo_tick = (now, tokens)
        super().log(logs, start_time)

    def train(self, *args, **kwargs):
        self._rcgrpo_t0 = time.perf_counter()
        return super().train(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.objective is not None and self.model.training and not self._compact_head():
            raise RuntimeError("sft.first_token_weight / sft.unlikelihood act on the compact head's loss: one CPU "
                               "process with compact_lm_head (off-CPU: not implemented)")
        if return_outputs or not self.model.training or not self._compact_head():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return compact_head_loss(self, model, inputs, num_items_in_batch, self.objective)

    def _compact_head(self) -> bool:
        # Off-CPU TRL's Triton kernel already scores only the labelled positions; under DDP/DeepSpeed the
        # forward must go through the wrapped module.
        return (self.compact_lm_head and self.accelerator.num_processes == 1 and not self.is_deepspeed_enabled
                and self.accelerator.device.type == "cpu")

    def _token_count_path(self, folder: str) -> str:
        suffix = f"_{self.args.process_index}" if self.args.world_size > 1 else ""
        return os.path.join(folder, f"{TOKEN_COUNT_STEM}{suffix}.json")

    def _save_rng_state(self, output_dir: str) -> None:
        # TRL's `num_tokens` log is a counter of the trainer object, not of the Trainer's state: saved with the
        # RNG states (per process, as they are) so that a resumed run logs the uninterrupted run's counts.
        super()._save_rng_state(output_dir)
        with open(self._token_count_path(output_dir), "w") as fh:
            json.dump({"total_train_tokens": self._total_train_tokens}, fh)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        super()._load_rng_state(checkpoint)
        path = self._token_count_path(checkpoint) if checkpoint is not None else None
        if path is not None and os.path.isfile(path):
            with open(path) as fh:
                self._total_train_tokens = json.load(fh)["total_train_tokens"]
            self._rcgrpo_tick = (self._rcgrpo_t0, self._total_train_tokens)  # tokens/s: this call's tokens only

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        with small_adapter_saves(self.accelerator.unwrap_model(self.model)):
            super()._save(output_dir, state_dict)
