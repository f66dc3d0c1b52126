"""RL that cannot blow up silently: divergence detected, the run stopped and rolled back to its last good
checkpoint (the per-token KL term is bounded by the trainer itself: `train.rl.kl`, `rl.kl_token_max`).

- `divergence`: a pure check of the step rows (`diagnostics.PLOT_COLUMNS`) against `config.GuardConfig`: a
  non-finite loss, a mean KL above `max_kl`, or the reward collapsing to 0 for `window` steps after a
  window with mean >= `min_reward`. `DivergenceGuardMixin` (a `TrainerCallback`) runs it after every
  logged step, stops training, and restores the trainable weights of the last checkpoint BEFORE the step
  whose policy went bad (a step's metrics are those of the policy the previous update left: the row of step
  N condemns the weights after N - 1 updates, so N - 2's are the last good; none: the init, LoRA deltas at
  0). `run.train_rl` records the event in the summary and as MLflow tags and says so on stderr.
"""

from __future__ import annotations

import math
from pathlib import Path

from rcgrpo_tasks.ops.inputs import read_tsv
from rcgrpo_tasks.train.common.callbacks import ResumableMixin
from rcgrpo_tasks.train.rl.config import GuardConfig
from rcgrpo_tasks.train.rl.diagnostics import STEP_MARKER


def divergence(rows: list[dict], cfg: GuardConfig) -> str | None:
    """Why the run diverged at its last row, or None. `rows`: the step rows so far (step, loss, kl, reward)."""
    if not rows:
        return None
    last = {**rows[-1], "step": int(rows[-1]["step"])}
    if last.get("step_skipped", 0.0) != 1.0:  # a skipped step (dynamic sampling) has no loss to judge
        for col in ("loss", "kl"):
            value = last.get(col, 0.0)
            if not math.isfinite(value):
                return f"step {last['step']}: {col} {value}"
        kl = last.get("kl", 0.0)
        if cfg.max_kl is not None and kl > cfg.max_kl:
            return f"step {last['step']}: mean KL to the init {kl:.3g} > {cfg.max_kl} (rl.divergence_kl)"
    rewards = [r.get("reward", float("nan")) for r in rows]
    rewards = [x for x in rewards if not math.isnan(x)]
    w = cfg.window
    if len(rewards) >= 2 * w and sum(rewards[-w:]) == 0:
        best = max(sum(rewards[i : i + w]) / w for i in range(len(rewards) - 2 * w + 1))
        if best >= cfg.min_reward:
            return (f"step {last['step']}: reward 0 for {w} steps after a {w}-step mean of {best:.2f} "
                    f"(rl.divergence_window, rl.divergence_min_reward)")
    return None


def restore_step(checkpoint_steps: list[int], bad_step: int) -> int:
    """The checkpoint to roll back to when step `bad_step`'s row condemns the weights after bad_step - 1
    updates: the newest saved step <= bad_step - 2, else 0 (the init)."""
    good = [s for s in checkpoint_steps if s <= bad_step - 2]
    return max(good) if good else 0


def drop_nonfinite_grads(optimizer) -> bool:
    """True, with every gradient of `optimizer`'s parameters dropped (`grad = None`: the coming optimizer step
    leaves those weights and their moments as they are), when any gradient holds a NaN or an inf; else False
    and nothing touched. Gradients that do not live on the parameters (DeepSpeed's partitions) are not seen."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
        return False
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None
    return True


class DivergenceGuardMixin(ResumableMixin):
    """A `TrainerCallback` (`callbacks.lazy_subclass`) that checks every step row `tsv` holds (`divergence`), and on
    a divergence stops training and restores the last good checkpoint's trainable weights. `event`: None, or
    {step, reason, restored_step}. Before every optimizer step it drops a non-finite gradient
    (`drop_nonfinite_grads`, as Megatron and DeepSpeed skip such a step): the update is skipped, the weights
    never see the NaN, and the step is listed in `nonfinite_steps`. After the clip, one NaN element makes the
    whole gradient NaN, and one such update poisons every LoRA weight (measured on a GPU run: the next step's
    rollouts were all truncated, reward 0, its KL NaN). `nonfinite_steps` travels with every checkpoint
    (`callbacks.ResumableMixin`): a resumed run still lists the steps skipped before its cut."""

    exported = ("nonfinite_steps",)

    def __init__(self, tsv, cfg: GuardConfig):
        self.tsv, self.cfg, self.event = tsv, cfg, None
        self.nonfinite_steps: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None and drop_nonfinite_grads(optimizer):
            self.nonfinite_steps.append(state.global_step + 1)
            print(f"rl: step {state.global_step + 1}: non-finite gradient, update skipped", flush=True)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if self.event is not None or not logs or STEP_MARKER not in logs or not self.tsv.is_file():
            return
        rows = [r for r in read_tsv(self.tsv) if r["step"] <= state.global_step]
        reason = divergence(rows, self.cfg)
        if reason is None:
            return
        saved = sorted(int(p.name.split("-")[1]) for p in Path(args.output_dir).glob("checkpoint-*")
                       if p.name.split("-")[1].isdigit())
        back = restore_step(saved, state.global_step)
        restored = restore_trainable(model, Path(args.output_dir) / f"checkpoint-{back}" if back else None)
        self.event = {"step": state.global_step, "reason": reason, "restored_step": back if restored else None}
        control.should_training_stop = True
        control.should_save = False  # the condemned step's weights are not a resume point


def restore_trainable(model, checkpoint) -> bool:
    """The trainable weights of a PEFT `model` from `checkpoint` (its adapter file), or their init values
    (LoRA B at 0, the trainable token rows at their originals: the init model exactly) when `checkpoint` is
    None. False (nothing restored) for a model without an adapter (full fine-tuning)."""
    import torch
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    if not isinstance(model, PeftModel):
        return False
    if checkpoint is not None:
        set_peft_model_state_dict(model, load_file(str(Path(checkpoint) / "adapter_model.safetensors")))
        return True
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
        for m in model.modules():
            if hasattr(m, "trainable_tokens_delta") and hasattr(m, "trainable_tokens_original"):
                for k, p in m.trainable_tokens_delta.items():
                    p.copy_(m.trainable_tokens_original[k])
    return True
