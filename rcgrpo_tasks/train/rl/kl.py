"""A bounded per-token KL term (the trainer's `kl_token_max`).

TRL's KL term is k3(d) = exp(d) - d - 1 with d = log pi_ref - log pi per token, unbounded: one sampled token
the policy has moved ~10 nat off gives k3 ~ 2e4 and dominates the step. verl's `low_var_kl` clamps the value
to +-10 (and d to +-20), which also zeroes the token's gradient. Here d is clamped to [lo, hi], the two roots
of k3(d) = `kl_token_max`, by handing TRL a reference log-prob pi + clamp(d) (a constant): inside the bounds
TRL's k3 exactly, outside a per-token KL of `kl_token_max` whose gradient is bounded by exp(hi) - 1 and still
pulls the token back toward the reference. The logged KL is the bounded one.
"""

from __future__ import annotations

import math


def kl_bounds(max_kl: float) -> tuple[float, float]:
    """(lo, hi), lo < 0 < hi, with exp(d) - d - 1 = max_kl at both (bisection; k3 is monotone on each side)."""
    if not max_kl > 0:
        raise ValueError(f"max_kl must be > 0, got {max_kl}")

    def k3(d: float) -> float:
        return math.exp(d) - d - 1

    def root(a: float, b: float) -> float:  # k3(a) - max_kl and k3(b) - max_kl of opposite signs
        for _ in range(200):
            m = (a + b) / 2
            if (k3(m) - max_kl) * (k3(a) - max_kl) <= 0:
                b = m
            else:
                a = m
        return (a + b) / 2

    return root(-(max_kl + 2.0), 0.0), root(0.0, math.log(max_kl + 2.0) + 1.0)


def bounded_reference(ref_logps, policy_logps, lo: float, hi: float):
    """pi + clamp(log pi_ref - pi, lo, hi), all detached: TRL's k3 against it is k3(clamp(d))."""
    import torch

    pol = policy_logps.detach()
    return pol + torch.clamp(ref_logps - pol, min=lo, max=hi)
