"""The rl stage's trainer: the library's `rcgrpo.RCGRPOTrainer` with what only this pipeline needs (`Options`), for
rollouts that come from its engine (`rollout.EngineRollout`, a `rollout_func`) rather than TRL's generation.

Each part is bound to TRL 1.16's internals (the pipeline pins trl==1.16.0); the private methods it overrides,
all through `super()`:
- the epoch-seeded prompt order (`_get_train_sampler`: `EpochSeededSampler`): TRL draws every epoch's order from
  one generator, so a run resumed in a later epoch would train on other prompts than the uncut one;
- steps without loss skipped (`training_step` with `_prepare_inputs`): a step whose every completion token is
  masked (dynamic sampling that found nothing to learn, `rc_lowmask`'s all-low batch) makes no update at all,
  since a zero gradient still moves the weights through Adam's moments; it reads and advances TRL's micro-step
  counter `_step` and its buffered batch `_buffered_inputs`, and books the step time as TRL does;
- CPU log-probs on completion positions only and shared prefixes (`_get_per_token_logps_and_entropies`:
  `logps.completion_logps`), the bounded KL term (`_compute_loss` with that method: `kl`), the sampler/trainer
  mismatch and the truncated importance sampling of the engine's rollouts (`offpolicy.OffPolicyMixin`);
- TRL's generation batch in flight saved and restored with each checkpoint (`_save_rng_state` /
  `_load_rng_state`, transformers' Trainer methods: `train.common.generation_state`), so a cut run resumes on
  the same rollouts;
- the mismatch measured on each generation batch (`_generate_and_score_completions`, after the library's);
- `rc_anchor`'s KL coefficient per rollout (`anchor.LowAnchorMixin`: `_generate_and_score_completions` and
  `_compute_loss`), and `rc_frozen`'s reward-token rows left out of the RL LoRA (`reward_token_peft_config`).
The `_compute_loss` / `_get_per_token_logps_and_entropies` pair passes state through attributes: it holds while
TRL's `_compute_loss` calls that method once, before it reads `ref_per_token_logps` (TRL 1.16 does).
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

from rcgrpo_tasks.train.common.callbacks import lazy_subclass
from rcgrpo_tasks.train.common.generation_state import GenerationStateMixin
from rcgrpo_tasks.train.rl.anchor import LowAnchorMixin
from rcgrpo_tasks.train.rl.kl import bounded_reference, kl_bounds
from rcgrpo_tasks.train.rl.logps import completion_logps
from rcgrpo_tasks.train.rl.offpolicy import OffPolicyMixin, loss_mask


@dataclass(frozen=True)
class Options:
    """What the pipeline's trainer adds to the library's (module docstring); the rl stage sets them from params
    `rl` (`grpo.options`)."""

    shared_prefix_min_tokens: int | None = None
    """A micro-batch's shared tokens through the trunk once where that saves at least this many tokens a row;
    None: the padded forward (CPU log-probs only)."""
    kl_token_max: float | None = None
    """Bound of each token's KL term (`kl.bounded_reference`); None: TRL's unbounded term."""
    importance_sampling_cap: float | None = None
    """Truncated importance sampling of the engine's rollouts at this cap (`offpolicy`); None: measured only."""
    beta_low: float | None = None
    """`rc_anchor`: the low token's rollouts' KL coefficient; None: RC-GRPO's one beta."""
    train_token_rows: bool = True
    """False (`rc_frozen`): the RL LoRA trains no reward-token row."""


@functools.cache
def epoch_seeded_sampler() -> type:
    """TRL's `RepeatSampler` with each epoch's prompt order seeded by (seed, epoch) (imported on first use): a
    resumed run skips the finished epochs without iterating them, so TRL's one generator would give its first new
    epoch another order. The Trainer calls `set_epoch` at the start of every epoch (through accelerate's sharded
    loaders too)."""
    from trl.trainer.utils import RepeatSampler

    class EpochSeededSampler(RepeatSampler):
        def set_epoch(self, epoch: int) -> None:
            if self.shuffle:
                self.generator.manual_seed((self.seed or 0) * 1_000_003 + epoch)

    return EpochSeededSampler


class _Prepared:
    """A micro-batch `training_step` already took from TRL's buffer (`_prepare_inputs` hands it through)."""

    def __init__(self, inputs: dict):
        self.inputs = inputs


class PipelineStepsMixin:
    """The steps' parts of the pipeline's trainer (module docstring), before `OffPolicyMixin`,
    `GenerationStateMixin` and `RCGRPOTrainer` in the MRO; `options` set at construction."""

    _rc_skip = False

    def __init__(self, *args, options: Options = Options(), **kwargs):
        self.options = options  # read while TRL wraps the model (`reward_token_peft_config`)
        self.rc_importance_cap = options.importance_sampling_cap
        self.rc_beta_low = options.beta_low
        self._rc_kl = kl_bounds(options.kl_token_max) if options.kl_token_max is not None else None
        super().__init__(*args, **kwargs)

    def reward_token_peft_config(self, peft_config, model, processing_class, args):
        if not self.options.train_token_rows:
            return peft_config  # rc_frozen: the rows stay the init's
        return super().reward_token_peft_config(peft_config, model, processing_class, args)

    def record_metric(self, name: str, value: float) -> None:
        """Add a value, already reduced across processes, to the current step's metrics (averaged into the log
        with the library's `rc/*`): the rollout function's price and diagnostics, the mismatch, skipped steps."""
        self.rc_metrics["train" if self.model.training else "eval"][name].append(float(value))

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self._rc_offpolicy(output)  # the batch's sampler/trainer mismatch, and its importance weights (`offpolicy`)
        return output

    def _in_flight_extras(self) -> dict:
        last = self.last_generation
        return {"reward_tokens": list(self.reward_tokens), "last_generation": asdict(last) if last else None}

    def _restore_in_flight_extras(self, extras: dict) -> None:
        from rcgrpo.trainer import Generation

        self.reward_tokens = list(extras["reward_tokens"])
        last = extras["last_generation"]
        self.last_generation = Generation(**{k: tuple(v) if isinstance(v, list) else v for k, v in last.items()}) \
            if last else None

    def _get_train_sampler(self, dataset=None):
        base = super()._get_train_sampler(dataset)
        return epoch_seeded_sampler()(base.data_source, base.mini_repeat_count, base.batch_size, base.repeat_count,
                                  base.shuffle, base.seed)

    def _prepare_inputs(self, generation_batch):
        if isinstance(generation_batch, _Prepared):
            return generation_batch.inputs
        return super()._prepare_inputs(generation_batch)

    def _step_trains(self) -> bool:
        """Whether any micro-batch of the optimizer step starting now has a token with loss (TRL's buffer:
        slice `_step % steps_per_generation` per micro-batch)."""
        per_gen, accum = self.args.steps_per_generation, self.current_gradient_accumulation_steps
        slices = [self._buffered_inputs[(self._step + j) % per_gen] for j in range(accum)]
        return any(bool(loss_mask(b).any()) for b in slices)

    def training_step(self, model, inputs, num_items_in_batch):
        # A step whose every rollout is masked makes no update. Decided at the step's first micro-batch, once its
        # generation batch exists; then no forward and no backward run (DeepSpeed, which steps inside `backward`,
        # never steps). One decision for every process (a collective).
        import torch

        accum = self.current_gradient_accumulation_steps
        model.train()  # as the Trainer's own step does first: TRL buffers generations in train mode only
        t0 = time.perf_counter()
        prepared = _Prepared(self._prepare_inputs(inputs))  # TRL generates here when a batch is due
        self._current_train_step_time += time.perf_counter() - t0  # TRL's step_time includes generation
        if self._step % accum == 0:
            flag = torch.tensor(float(self._step_trains()), device=self.accelerator.device)
            self._rc_skip = not bool(self.accelerator.reduce(flag, reduction="sum").item())
            self.record_metric("rc/step_skipped", float(self._rc_skip))
        if not self._rc_skip:
            loss = super().training_step(model, prepared, num_items_in_batch)
        else:
            self._step += 1  # TRL's bookkeeping: its micro-step counter schedules the next generation
            if self._step % accum == 0:
                self._metrics["train"]["step_time"].append(self._current_train_step_time)
                self._current_train_step_time = 0.0
            loss = torch.zeros((), device=self.args.device)
        if self._step % accum == 0:
            self._rc_flush()  # the mismatch the step's loss forwards measured (`offpolicy`)
        return loss

    def _compute_loss(self, model, inputs):
        # The KL bound: TRL reads the reference log-probs after the policy's; the log-probs call below fills this
        # clone with the bounded reference (`kl.bounded_reference`) before TRL reads it.
        if self._rc_kl is not None and self.beta != 0.0 and "ref_per_token_logps" in inputs:
            ref = inputs["ref_per_token_logps"].clone()
            inputs = {**inputs, "ref_per_token_logps": ref}
            self._rc_kl_pending = ref
        self._rc_loss_inputs = inputs  # the next log-probs call is the loss's own forward of the policy
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._rc_kl_pending = self._rc_loss_inputs = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        fast = (input_ids.device.type == "cpu" and not compute_aux_loss
                and all(v is None for v in multimodal.values()))
        if fast:
            wrapped = self.accelerator.unwrap_model(model) is not model  # DDP / DeepSpeed: their forward syncs grads
            with self.accelerator.autocast():
                out = completion_logps(model, input_ids, attention_mask, logits_to_keep, self.temperature,
                                       batch_size or input_ids.size(0), compute_entropy,
                                       None if wrapped else self.options.shared_prefix_min_tokens,
                                       self.processing_class.pad_token_id or 0)
        else:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             batch_size, compute_entropy, compute_aux_loss,
                                                             **multimodal)
        loss_inputs, self._rc_loss_inputs = getattr(self, "_rc_loss_inputs", None), None
        if loss_inputs is not None:  # the loss's own call: the mismatch from this forward (`offpolicy`)
            self._rc_measure(out[0], loss_inputs)
        pending = getattr(self, "_rc_kl_pending", None)
        if pending is not None:  # the loss's own call: bound the reference against these log-probs
            self._rc_kl_pending = None
            pending.copy_(bounded_reference(pending, out[0], *self._rc_kl))
        return out


class PipelineTrainerMixin(LowAnchorMixin, PipelineStepsMixin, OffPolicyMixin, GenerationStateMixin):
    """Every part of the pipeline's trainer, the anchor outermost (it reads the loss's own log-probs call), in
    front of `RCGRPOTrainer` (`pipeline_trainer`)."""


def pipeline_trainer() -> type:
    """The rl stage's trainer class (module docstring), `RCGRPOTrainer`'s arguments and `options=`; TRL and the
    library trainer are imported on first use (`callbacks.lazy_subclass`): stage `--help` loads neither."""
    return lazy_subclass(PipelineTrainerMixin, "rcgrpo.trainer.RCGRPOTrainer")
