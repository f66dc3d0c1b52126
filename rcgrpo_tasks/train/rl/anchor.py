"""RC-GRPO with a KL anchor per reward token (algo `rc_anchor`): the low token's rollouts carry a larger KL
coefficient `rl.beta_low` than the high token's `rl.beta`, so RL may still train the low-conditioned policy but
keeps it near the RCTP init, where it fails (the premise), while the high-conditioned policy learns as under
RC-GRPO. Nothing else changes: the same token draw, groups and advantage over the whole group (RC-GRPO's).

Why it keeps the premise, from RC-GRPO's objective. RC-GRPO maximises, per condition z,
    J_z = E_{y ~ pi(.|x,z)} A(y) - beta_z KL(pi(.|x,z) || pi_ref(.|x,z)),
whose maximiser is pi*(y|x,z) ∝ pi_ref(y|x,z) exp(A(y) / beta_z). With one beta for both tokens (the paper's
0.1) the low condition's optimum succeeds almost surely, P*(success | low) = p e^(D/b) / (p e^(D/b) + 1 - p)
with p = P_ref(success | low) and D the advantage gap between a success and a failure: 0.999 for p 0.05, D 1,
b 0.1; so the premise q = P(low fails | high succeeds) goes to 0 (measured: q 0.84 -> 0.09 in 15 steps). A
group-normalised 0/1 reward of G = 4 puts D between 1.73 (two successes) and 2.0 (one success: +1.5 against
-0.5). For q to stay at least 1/2 at the low condition's optimum, P*(success | low) <= 1/2, i.e.
    beta_low >= D / ln((1 - p) / p);
with D = 2 and the RCTP init's low-token success on the entries its high token solves (p 0.111, held-out seed 0)
that is beta_low >= 0.96: `rl.beta_low: 1.0` is this bound, not a value swept. The high condition keeps beta
(P*(success | high) ~ 1). What it cannot stop: the high token's gradient moves shared weights (GRPO, which never
samples the low token, moved q 0.84 -> 0.69); the anchor pulls the low condition back wherever its rollouts
land, which GRPO's policy never does.

Mechanics: the trainer marks each rollout's KL coefficient in the generation batch (`KL_COEF`, shuffled and split
with it by TRL), and the loss adds (beta_i - beta) x the rollout's per-token KL term, aggregated as TRL
aggregates its loss (`EXTRA_KL`: `grpo`, `bnpo`, `dr_grpo`), to TRL's loss with `beta`: exactly TRL's loss with
a per-rollout beta_i (tests compare it with TRL's own loss computed row by row at each beta). The KL term is
TRL's term (`trl_kl_term`: k3 against the same reference, bounded as the trainer bounds it (`kl_token_max`),
times the importance ratio under TRL's default `use_bias_correction_kl`). Bound to TRL 1.16's
internals: `_compute_loss` calls `_get_per_token_logps_and_entropies` once for the policy (the capture below).
"""

from __future__ import annotations

from rcgrpo_tasks.train.rl.kl import bounded_reference
from rcgrpo_tasks.train.rl.offpolicy import loss_mask

KL_COEF = "rc_kl_coef"
"""Key of the (B,) per-rollout KL coefficients in TRL's buffered generation batch."""
EXTRA_KL = ("grpo", "bnpo", "dr_grpo")
"""TRL loss types whose aggregation the extra KL term reproduces."""


def rollout_betas(tokens, low: str, beta: float, beta_low: float) -> list[float]:
    """Each rollout's KL coefficient: `beta_low` for the low token's rollouts, `beta` for the others."""
    return [beta_low if t == low else beta for t in tokens]


def trl_kl_term(ref_logps, logps, old_logps, mask, level: str, bias_correction: bool):
    """TRL's per-token KL term: k3 = exp(d) - d - 1, d = log pi_ref - log pi, times the importance ratio
    pi / pi_old (per token, or the sequence's masked mean log-ratio) under `use_bias_correction_kl` (TRL's
    default: the ratio is 1 on-policy but carries the gradient, which makes the KL gradient the unbiased
    reverse-KL one). `old_logps` None: on-policy, TRL's `logps.detach()`."""
    import torch

    d = ref_logps - logps
    kl = torch.exp(d) - d - 1
    if not bias_correction:
        return kl
    log_ratio = logps - (logps.detach() if old_logps is None else old_logps)
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return kl * torch.exp(log_ratio)


def extra_kl_loss(per_token_kl, mask, coef, beta: float, loss_type: str, max_completion_length: int,
                  normalizer: float):
    """sum_i (coef_i - beta) x rollout i's KL term, aggregated as TRL aggregates `loss_type` (per-sequence token
    mean then batch mean; the batch's token mean; the sum over (B x max_completion_length)), divided by
    `normalizer` (TRL's gradient accumulation steps in training)."""
    w = (coef.to(per_token_kl.dtype) - beta).unsqueeze(1)
    term = w * per_token_kl * mask
    if loss_type == "grpo":
        loss = (term.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = term.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = term.sum() / (term.size(0) * max_completion_length)
    else:
        raise ValueError(f"a per-token KL coefficient needs loss_type in {EXTRA_KL}, got {loss_type!r}")
    return loss / normalizer


class LowAnchorMixin:
    """Before `rcgrpo.RCGRPOTrainer` in the MRO (`pipeline_trainer.PipelineTrainer`): the low token's rollouts
    train with KL coefficient `rc_beta_low` (module docstring; None: RC-GRPO itself). Reads the trainer's KL bound
    `_rc_kl` ((lo, hi) or None)."""

    def _generate_and_score_completions(self, inputs):
        import torch

        output = super()._generate_and_score_completions(inputs)
        if self.rc_beta_low is not None and self.model.training:
            betas = rollout_betas(self.reward_tokens, self.args.reward_tokens[0], self.beta, self.rc_beta_low)
            output[KL_COEF] = torch.tensor(betas, dtype=torch.float32, device=output["advantages"].device)
        return output

    def _compute_loss(self, model, inputs):
        coef = inputs.get(KL_COEF)
        if coef is None or not self.model.training:
            return super()._compute_loss(model, inputs)
        self._rc_anchor_logps = []
        try:
            loss = super()._compute_loss(model, inputs)
            logps = self._rc_anchor_logps[0]
        finally:
            self._rc_anchor_logps = None
        ref, mask = inputs["ref_per_token_logps"], loss_mask(inputs)
        if self._rc_kl is not None:  # the bound the trainer hands TRL (`kl_token_max`), recomputed: deterministic
            ref = bounded_reference(ref, logps, *self._rc_kl)
        kl = trl_kl_term(ref, logps, inputs.get("old_per_token_logps"), mask, self.importance_sampling_level,
                         self.args.use_bias_correction_kl)
        extra = extra_kl_loss(kl, mask, coef, self.beta, self.loss_type, self.max_completion_length,
                              self.current_gradient_accumulation_steps)
        return loss + extra

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if getattr(self, "_rc_anchor_logps", None) is not None:  # inside the loss: the policy's own forward
            self._rc_anchor_logps.append(out[0])
        return out


def check_anchor(beta: float, beta_low: float | None, loss_type: str) -> None:
    """What `rc_anchor` needs, before anything loads: `rl.beta_low` set and above 0, `rl.beta` above 0 (TRL
    takes the reference log-probs only then), a loss type whose aggregation `extra_kl_loss` reproduces.
    ValueError naming the field."""
    if beta_low is None or not beta_low > 0:
        raise ValueError(f"algo rc_anchor needs rl.beta_low > 0 (the low token's KL coefficient), got {beta_low}")
    if beta <= 0:
        raise ValueError("algo rc_anchor needs rl.beta > 0: TRL computes no reference log-probs at beta 0")
    if loss_type not in EXTRA_KL:
        raise ValueError(f"algo rc_anchor needs rl.loss_type in {list(EXTRA_KL)}, got {loss_type!r}")
