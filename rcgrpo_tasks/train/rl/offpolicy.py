"""The sampler/trainer mismatch of rollouts that carry their sampler's log-probs (a `rollout_func`'s, TRL's
vLLM), measured every generation and, for `rollout_func` rollouts, corrected by truncated importance sampling
(TRL's `token_truncate`, which TRL applies to its own vLLM rollouts only; the pipeline trainer's
`Options.importance_sampling_cap`).

The rollouts come from another copy of the policy than the one trained (vLLM, a merged low-precision
snapshot, another engine), so their tokens come from pi_sampler while the loss assumes pi_trainer:
- `mismatch_stats`: per generation batch, over the model tokens, mean and max |log pi_trainer -
  log pi_sampler| and a KL(pi_sampler || pi_trainer) estimate (k3: E[(r - 1) - log r], r = pi_trainer /
  pi_sampler), gathered over processes (`rc/logp_diff_mean`, `rc/logp_diff_max`, `rc/sampler_kl`), and the
  importance weights' mean, min and capped share.
- `truncated_is_weights`: TRL's token weights min(exp(log pi_trainer - log pi_sampler), cap), 1 outside the
  loss mask and where the sampler gave no log-prob (NaN).
- `OffPolicyMixin`: takes the trainer's log-probs of the batch once at generation time (TRL's own
  `old_per_token_logps` where TRL takes them, i.e. when updates and generations are misaligned; else, where
  the weights are needed, one no-grad forward), logs the mismatch and, with a cap, weights each token's policy
  loss. Where nothing is corrected and the update is aligned with its generation, the mismatch is read from
  the loss's own forward (`_rc_measure`, logged when the optimizer step ends: `_rc_flush`), the same
  measurement without a forward of its own. Departure from TRL's vLLM path, which also puts that forward's
  log-probs into the PPO ratio: an aligned update keeps TRL's `old = new.detach()`, a ratio of exactly 1.
  Departure from TRL's code, not its loss: the weight multiplies the advantage, (B,) -> (B, T); for every loss
  type it applies to (grpo, bnpo, dr_grpo, dapo, cispo, sapo) that is TRL's `per_token_loss *
  importance_sampling_ratio` (the clipped surrogate is positively homogeneous in A), and the KL term stays
  unweighted as in TRL.
"""

from __future__ import annotations

IS_WEIGHTS = "rc_importance_weights"
"""Key of the (B, T) token weights in TRL's buffered generation batch (shuffled and split with it)."""


def loss_mask(batch: dict):
    """(B, T) tokens that carry loss: TRL's completion mask times the environment mask."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def truncated_is_weights(trainer_logps, sampler_logps, mask, cap: float):
    """(B, T) token weights min(pi_trainer / pi_sampler, cap): TRL's `token_truncate` (no lower bound), 1
    where `mask` is 0 or the sampler's log-prob is NaN."""
    import torch

    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)
    return torch.clamp(torch.exp(diff), max=cap)


def mismatch_stats(trainer_logps, sampler_logps, mask, weights=None, cap: float | None = None):
    """Sums over the masked tokens with a sampler log-prob: a float tensor [n, sum |d|, max |d|, sum k3,
    sum w, min w, capped], d = log pi_trainer - log pi_sampler, k3 = exp(d) - 1 - d (weights: 1 where none)."""
    import torch

    keep = mask.bool() & ~torch.isnan(sampler_logps)
    d = (trainer_logps - sampler_logps)[keep].float()
    w = weights[keep].float() if weights is not None else torch.ones_like(d)
    n = d.numel()
    big = torch.tensor(float("inf"), device=d.device)
    return torch.stack([
        torch.tensor(float(n), device=d.device), d.abs().sum(), d.abs().max() if n else big.new_zeros(()),
        (torch.exp(d) - 1 - d).sum(), w.sum(), w.min() if n else big,
        (w >= cap).sum().float() if cap is not None else big.new_zeros(())])


def reduce_stats(stats) -> dict[str, float]:
    """`mismatch_stats` rows of every process (P, 7) -> the logged metrics (NaN without any token)."""
    n = float(stats[:, 0].sum())
    if not n:
        nan = float("nan")
        return {k: nan for k in ("rc/logp_diff_mean", "rc/logp_diff_max", "rc/sampler_kl", "rc/is_weight_mean",
                                 "rc/is_weight_min", "rc/is_capped")}
    return {"rc/logp_diff_mean": float(stats[:, 1].sum()) / n, "rc/logp_diff_max": float(stats[:, 2].max()),
            "rc/sampler_kl": float(stats[:, 3].sum()) / n, "rc/is_weight_mean": float(stats[:, 4].sum()) / n,
            "rc/is_weight_min": float(stats[:, 5].min()), "rc/is_capped": float(stats[:, 6].sum()) / n}


class OffPolicyMixin:
    """The mismatch and its correction inside TRL's GRPOTrainer (module docstring). `rc_importance_cap`: the
    cap C of `rollout_func` rollouts' weights, None = no correction by this mixin (off, or TRL's vLLM path,
    where TRL applies its own with the same mode and cap)."""

    rc_importance_cap: float | None = None

    def _rc_trainer_logps(self, batch: dict):
        """The trainer's log-probs of the batch's completion tokens under the current weights (no grad), on the
        trainer's device whatever device the batch's tensors are on."""
        import torch
        from trl.models.utils import disable_gradient_checkpointing

        dev = self.accelerator.device  # TRL's generation step leaves its batch there; a batch built elsewhere moves
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1).to(dev)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).to(dev)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention, batch["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size)
        return logps

    def _rc_offpolicy(self, batch: dict) -> None:
        """Measure the mismatch of a generated batch, and add the importance weights where correcting."""
        sampler = batch.get("sampling_per_token_logps")
        if sampler is None:
            return
        trainer = batch.get("old_per_token_logps")
        weights, cap = batch.get("importance_sampling_ratio"), None  # TRL's own (vLLM path)
        if trainer is None and weights is None and self.rc_importance_cap is None:
            self._rc_rows = []  # aligned and uncorrected: measured from the loss's own forward (`_rc_measure`)
            return
        self._rc_rows = None
        if trainer is None:  # measurement and weights only: an aligned update keeps TRL's ratio of exactly 1
            trainer = self._rc_trainer_logps(batch)
        mask = loss_mask(batch)
        if self.rc_importance_cap is not None:
            cap = self.rc_importance_cap
            weights = batch[IS_WEIGHTS] = truncated_is_weights(trainer, sampler, mask, cap)
        elif weights is not None:
            cap = self.args.vllm_importance_sampling_clip_max
        stats = self.accelerator.gather(mismatch_stats(trainer, sampler, mask, weights, cap)[None])
        for name, value in reduce_stats(stats.reshape(-1, 7).cpu()).items():
            self.record_metric(name, value)

    def _rc_measure(self, trainer_logps, inputs: dict) -> None:
        """The loss's forward of a micro-batch: its mismatch rows, kept for `_rc_flush` (deferred batches only)."""
        sampler = inputs.get("sampling_per_token_logps")
        if getattr(self, "_rc_rows", None) is not None and sampler is not None:
            self._rc_rows.append(mismatch_stats(trainer_logps.detach(), sampler, loss_mask(inputs)))

    def _rc_flush(self) -> None:
        """At the end of an optimizer step: log the mismatch its micro-batches' forwards measured (NaN where a
        skipped step ran none)."""
        import torch

        rows, self._rc_rows = getattr(self, "_rc_rows", None), None
        if rows is None:
            return
        mine = torch.stack(rows) if rows else torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, float("inf"), 0.0]],
                                                           device=self.accelerator.device)
        stats = self.accelerator.gather(mine)
        for name, value in reduce_stats(stats.reshape(-1, 7).cpu()).items():
            self.record_metric(name, value)

    def _compute_loss(self, model, inputs):
        weights = inputs.get(IS_WEIGHTS)
        if weights is not None:  # TRL's per_token_loss * weight, as the advantage's factor (module docstring)
            inputs = {**inputs, "advantages": inputs["advantages"].reshape(-1, 1) * weights}
        return super()._compute_loss(model, inputs)
