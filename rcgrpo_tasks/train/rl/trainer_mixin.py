"""What the RC-GRPO trainer adds to TRL's `GRPOTrainer` step, and its TRL settings (the rl stage's trainer is
built in `trainer.py`; docs/rl.md).

- `RCGRPOTrainerMixin` (on TRL's `GRPOTrainer`: `trainer.build_trainer`): TRL does not expose the
  advantages it used, nor a public way for a rollout function to add per-step metrics; the subclass wraps
  `_generate_and_score_completions` to read the advantages (mean |A|, cross-checked against
  `advantages.group_advantages` in the tests), measures and corrects the sampler/trainer mismatch
  (`offpolicy`; where nothing is corrected, from the loss's own forward), adds `record_metric`, skips a step with nothing to train on before its backward (so no
  optimizer, DeepSpeed's included, moves a weight), and on CPU projects only completion positions through the
  LM head, a micro-batch's shared tokens through the trunk once (`shared_prefix`). Training, loss, KL and clipping are TRL's.
- Updates per generation batch: `num_iterations` (PPO epochs) and `minibatches` (TRL's
  `steps_per_generation` = minibatches x gradient accumulation).
- Rewards: one TRL reward function per `env.rewards.REWARDS`; one-hot `reward_weights` pick `cfg.reward`.
  The engine's end-of-turn ids are TRL's EOS ids too (`completions/clipped_ratio` counts budget cuts).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rcgrpo_tasks.engine.models import last_positions
from rcgrpo_tasks.engine.shared_prefix import target_hidden, trunk_and_head
from rcgrpo_tasks.env.rewards import REWARDS
from rcgrpo_tasks.ops.inputs import read_jsonl
from rcgrpo_tasks.train.common import callbacks, distributed, placement
from rcgrpo_tasks.train.rl import advantages as adv
from rcgrpo_tasks.train.rl.config import RLConfig
from rcgrpo_tasks.train.rl.kl_guard import bounded_reference
from rcgrpo_tasks.train.rl.offpolicy import OffPolicyMixin, loss_mask
from rcgrpo_tasks.train.rl.rollout_policy import rollout_dtype, sampler_differs

ROLLOUTS_FILE = "rollouts.jsonl"
"""Every rollout of the run, one JSON line each (`rollout.rollout_record` + its advantage), in the
checkpoint folder: which entries, tokens, rewards and advantages each step trained on, whatever the process
count."""


class EpochSeededSamplerMixin:
    """TRL's `RepeatSampler` with each epoch's prompt order seeded by (seed, epoch).

    TRL's draws every epoch's order from one generator seeded once, and a resumed run skips the finished
    epochs without iterating them, so from its first new epoch on it would train on other prompts than the
    uninterrupted run. The Trainer calls `set_epoch` at the start of every epoch (through accelerate's
    sharded loaders too)."""

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle:
            self.generator.manual_seed((self.seed or 0) * 1_000_003 + epoch)


class PreparedInputs:
    """A micro-batch `RCGRPOTrainerMixin.training_step` already took from TRL's buffer (`_prepare_inputs`
    hands it through unchanged)."""

    def __init__(self, inputs: dict):
        self.inputs = inputs


class RCGRPOTrainerMixin(OffPolicyMixin):
    """GRPOTrainer + per-step metrics from the rollout function + the advantages it used (read-only), the
    sampler/trainer mismatch and its correction (`OffPolicyMixin`), steps with nothing to train on skipped,
    and a prompt order that a resumed run reproduces (`EpochSeededSamplerMixin`)."""

    last_advantages: list[float] = []
    rc_shared_prefix: int | None = None
    """`RLConfig.shared_prefix_min_tokens` (`build_trainer` sets it)."""
    rc_kl_bounds: tuple[float, float] | None = None
    """`kl_guard.kl_bounds(RLConfig.kl_token_max)` (`build_trainer` sets it); None = TRL's unbounded KL."""

    def _get_train_sampler(self, dataset=None):
        base = super()._get_train_sampler(dataset)
        return callbacks.lazy_subclass(EpochSeededSamplerMixin, "trl.trainer.utils.RepeatSampler")(
            base.data_source, base.mini_repeat_count, base.batch_size, base.repeat_count, base.shuffle, base.seed)

    def record_metric(self, name: str, value: float) -> None:
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][name].append(float(value))

    def _prepare_inputs(self, generation_batch):
        if isinstance(generation_batch, PreparedInputs):
            return generation_batch.inputs
        return super()._prepare_inputs(generation_batch)

    def _step_trains(self) -> bool:
        """Whether any micro-batch of the optimizer step starting now has a token with loss (TRL's buffer:
        slice `_step % steps_per_generation` per micro-batch)."""
        per_gen, accum = self.args.steps_per_generation, self.current_gradient_accumulation_steps
        slices = [self._buffered_inputs[(self._step + j) % per_gen] for j in range(accum)]
        return any(bool(loss_mask(b).any()) for b in slices)

    def training_step(self, model, inputs, num_items_in_batch):
        # A step whose every rollout is masked (dynamic sampling found no group with reward spread) must make
        # no update at all: a zero gradient would still move the weights through Adam's moments. The step is
        # decided at its first micro-batch, once its generation batch exists, and then runs no forward and no
        # backward: no gradient exists, so the optimizer skips every weight, and under DeepSpeed (which steps
        # inside `backward`) the engine never steps. One decision for every process (a collective).
        import torch

        model.train()  # as the Trainer's own step does first: TRL buffers generations in train mode only
        t0 = time.perf_counter()
        prepared = PreparedInputs(self._prepare_inputs(inputs))  # TRL generates here when a batch is due
        self._current_train_step_time += time.perf_counter() - t0  # TRL's step_time includes generation
        accum = self.current_gradient_accumulation_steps
        if self._step % accum == 0:
            self._rc_skip = not distributed.any_process(self._step_trains())
            self.record_metric("rc/step_skipped", float(self._rc_skip))
        if not self._rc_skip:
            loss = super().training_step(model, prepared, num_items_in_batch)
        else:
            self._step += 1  # TRL's bookkeeping of a step: its micro-step counter schedules the next generation
            if self._step % accum == 0:
                self._metrics["train"]["step_time"].append(self._current_train_step_time)
                self._current_train_step_time = 0.0
            loss = torch.zeros((), device=self.args.device)
        if self._step % accum == 0:
            self._rc_flush()  # the mismatch the step's loss forwards measured (`offpolicy`)
        return loss

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        # TRL returns this process's share of the advantages; the diagnostics cover the whole batch.
        a = self.accelerator.gather(output["advantages"].detach().float()).cpu().tolist()
        self.last_advantages = a
        self.record_metric("rc/adv_abs_mean", adv.advantage_spread(a))
        self.record_metric("rc/adv_std", adv.advantage_std(a))
        self._rc_offpolicy(output)
        records = getattr(self.rollout_func, "records", None)
        if self.accelerator.is_main_process and records and len(records) == len(a):
            self._log_rollouts([{**r, "advantage": x} for r, x in zip(records, a)])
        return output

    def _log_rollouts(self, rows: list[dict]) -> None:
        """Append the step's rollouts to ROLLOUTS_FILE in the checkpoint folder; the first write of a run
        (or of a resumed run) drops the rows of the steps it redoes."""
        path = Path(self.args.output_dir) / ROLLOUTS_FILE
        step = rows[0]["step"]
        if not getattr(self, "_rc_rollouts_opened", False):
            kept = [r for r in read_jsonl(path) if r["step"] < step] if path.is_file() else []
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
            self._rc_rollouts_opened = True
        with path.open("a") as fh:
            fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)

    def _compute_loss(self, model, inputs):
        # The KL bound: TRL reads the reference log-probs after the policy's; the logps call below fills this
        # clone with the bounded reference (`kl_guard.bounded_reference`) before TRL reads it.
        if self.rc_kl_bounds is not None and self.beta != 0.0 and "ref_per_token_logps" in inputs:
            ref = inputs["ref_per_token_logps"].clone()
            inputs = {**inputs, "ref_per_token_logps": ref}
            self._rc_kl_pending = ref
        self._rc_loss_inputs = inputs  # the next log-probs call is the loss's own forward of the policy
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._rc_kl_pending = self._rc_loss_inputs = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = self._rc_logps(*args, **kwargs)
        loss_inputs, self._rc_loss_inputs = getattr(self, "_rc_loss_inputs", None), None
        if loss_inputs is not None:  # the loss's own call: the mismatch from this forward (`offpolicy`)
            self._rc_measure(out[0], loss_inputs)
        pending = getattr(self, "_rc_kl_pending", None)
        if pending is not None:  # the loss's own call: bound the reference against these log-probs
            self._rc_kl_pending = None
            pending.copy_(bounded_reference(pending, out[0], *self.rc_kl_bounds))
        return out

    def _rc_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                  compute_aux_loss=False, **multimodal):
        # CPU fast path. Without Triton, TRL 1.16's fused LM head scores EVERY position (static tile
        # shapes for Neuron), i.e. ~1k prompt positions per ~50 completion tokens through a 49k vocabulary,
        # which dominated the CPU step. Here only the attended completion positions are projected, with the
        # same temperature scaling, and a group's shared tokens go through the trunk once
        # (`shared_prefix`). GPU and multimodal inputs: TRL's path.
        if input_ids.device.type != "cpu" or compute_aux_loss or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        wrapped = self.accelerator.unwrap_model(model) is not model  # DDP / DeepSpeed: their forward syncs grads
        with self.accelerator.autocast():
            return completion_logps(model, input_ids, attention_mask, logits_to_keep, self.temperature,
                                    batch_size or input_ids.size(0), compute_entropy,
                                    None if wrapped else self.rc_shared_prefix, self.processing_class.pad_token_id or 0)


def completion_logps(model, input_ids, attention_mask, logits_to_keep: int, temperature: float, batch_size: int,
                     compute_entropy: bool, min_prefix: int | None = None, pad_id: int = 0):
    """input_ids (B, P+C) -> (log-probs (B, C), entropies (B, C) or None, None) of the last C tokens: the
    attended ones (TRL's completion mask); 0 at the others, which every TRL loss masks out. `min_prefix`:
    `shared_prefix.target_hidden`'s, through the model's trunk and head; None: the model's own forward on
    the padded batch (a DDP / DeepSpeed wrapper's forward is what syncs the gradients across processes)."""
    import torch

    trunk, head = trunk_and_head(model) if min_prefix is not None else (None, None)
    logps, ents = [], []
    for s in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[s : s + batch_size], attention_mask[s : s + batch_size]
        keep = torch.zeros_like(mask, dtype=torch.bool)
        keep[:, -logits_to_keep:] = mask[:, -logits_to_keep:].bool()
        if trunk is not None:
            logits = head(target_hidden(trunk, ids, mask, keep, min_prefix, pad_id))
        else:
            out = model(input_ids=ids, attention_mask=mask, use_cache=False,
                        logits_to_keep=last_positions(logits_to_keep + 1, ids.size(1), ids.device))
            logits = out.logits[:, :-1][keep[:, -logits_to_keep:]]  # position t predicts token t + 1
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
        lp = logp_all.gather(-1, ids[keep].unsqueeze(-1)).squeeze(-1)
        where = keep[:, -logits_to_keep:]
        logps.append(torch.zeros(where.shape, dtype=lp.dtype, device=lp.device).masked_scatter(where, lp))
        if compute_entropy:
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
                ents.append(torch.zeros(where.shape, dtype=ent.dtype, device=ent.device).masked_scatter(where, ent))
    return torch.cat(logps), (torch.cat(ents) if compute_entropy else None), None


def _reward_func(name: str):
    def reward(completions, **columns):
        return [None if r is None else float(r) for r in columns[f"r_{name}"]]

    reward.__name__ = reward.__qualname__ = name  # TRL logs `rewards/<name>/mean`
    return reward


def reward_funcs() -> list:
    """One TRL reward function per score (`EngineRollout.to_trl` computed it); `reward_weights` select the
    one that drives the advantage."""
    return [_reward_func(name) for name in REWARDS]


def correct_mismatch(cfg: RLConfig, device_type: str, autocast: bool) -> bool:
    """`rl.importance_sampling` resolved for a run on `device_type` with trainer bf16 `autocast`: `on`, `off`,
    or (`auto`) where the rollouts' numerics differ from the trainer's (`rollout_policy.sampler_differs`)."""
    if cfg.importance_sampling != "auto":
        return cfg.importance_sampling == "on"
    return sampler_differs(cfg.use_vllm, rollout_dtype(cfg.rollout_dtype), autocast)


def grpo_args(cfg: RLConfig, ckpt_dir: Path, grad_accum: int, device=None):
    """TRL `GRPOConfig` of a run: checkpoints under `ckpt_dir`, no reporting (MLflow goes through callbacks),
    on `device` (`placement.train_device`; None = CUDA when available). `minibatches` optimizer steps per
    generation batch; TRL's importance sampling (its vLLM path) as `correct_mismatch` says, token-truncated
    at `importance_sampling_cap` (the engine path reads the same fields: `build_trainer`)."""
    import torch
    from trl import GRPOConfig

    bf16 = placement.resolved_bf16(cfg.bf16)
    device_type = device.type if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
    weights = [1.0 if name == cfg.reward else 0.0 for name in REWARDS]
    kwargs = dict(
        output_dir=str(ckpt_dir), per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=grad_accum, num_generations=cfg.num_generations, max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler, warmup_steps=0, beta=cfg.beta,
        epsilon=cfg.epsilon, num_iterations=cfg.num_iterations, steps_per_generation=cfg.minibatches * grad_accum,
        scale_rewards=cfg.scale_rewards, loss_type=cfg.loss_type, reward_weights=weights,
        temperature=cfg.decode.temperature, top_p=cfg.decode.top_p,
        max_completion_length=cfg.decode.max_new_tokens * cfg.decode.max_outputs, disable_dropout=True,
        gradient_checkpointing=cfg.gradient_checkpointing, logging_steps=1, save_strategy="steps",
        save_steps=cfg.save_steps, save_total_limit=cfg.save_total_limit, report_to=[], seed=cfg.seed,
        data_seed=cfg.seed, remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True,
        bf16=bf16, use_cpu=placement.use_cpu(device), deepspeed=cfg.deepspeed, use_vllm=cfg.use_vllm,
        vllm_mode=cfg.vllm_mode, vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_importance_sampling_correction=correct_mismatch(cfg, device_type, bf16),
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=cfg.importance_sampling_cap,
    )
    kwargs.update(cfg.extra)
    return GRPOConfig(**kwargs)
