"""Group statistics of GRPO / RC-GRPO and the metrics the trainer logs every generation. Pure functions of
lists (no torch): `B` = rollouts of a batch, `G` = rollouts per group, rollout `i` in group `i // G` (TRL's
layout).

`group_advantages` is TRL's GRPO advantage (`sum_then_normalize`, `scale_rewards`): A_i = (r_i - mean_g) /
(std_g + 1e-4), unbiased std over the G rollouts of the group, *whatever their reward tokens*: exactly
RC-GRPO's advantage, where a group whose rollouts split by token (high succeeds, low fails) has reward
variance, hence signal, and a uniformly conditioned group that always succeeds (or fails) has none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rcgrpo.goal import check_levels, level_of

ZERO_STD_TOL = 1e-6
"""A group whose reward std is below this counts as zero-variance (rewards are floats: never test `== 0`)."""
ADV_EPS = 1e-4
"""TRL's epsilon in A = (r - mean) / (std + eps)."""
NONZERO_ADV = 1e-8
"""|A| above this counts as a learning signal."""


def _groups(values: Sequence[float], g: int) -> list[list[float]]:
    """(B,) -> (B/G, G); raises if B is not a multiple of G."""
    if g < 1 or len(values) % g:
        raise ValueError(f"{len(values)} rollouts do not split into groups of {g}")
    return [list(values[i : i + g]) for i in range(0, len(values), g)]


def _std(xs: Sequence[float]) -> float:
    """Unbiased (n-1) std, as torch.std / TRL's nanstd; 0.0 for a single value."""
    n = len(xs)
    if n < 2:
        return 0.0
    mean = sum(xs) / n
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))


def group_stats(rewards: Sequence[float], g: int) -> list[tuple[float, float]]:
    """rewards (B,) -> [(mean, std)] of shape (B/G,): per-group mean and unbiased std."""
    return [(sum(grp) / len(grp), _std(grp)) for grp in _groups(rewards, g)]


def group_advantages(rewards: Sequence[float], g: int, scale: str = "group") -> list[float]:
    """rewards (B,) -> advantages (B,), TRL's GRPO formula over each whole group (tokens ignored).
    scale: `group` divides by the group std (+1e-4), `batch` by the batch std, `none` not at all."""
    stats = group_stats(rewards, g)
    batch_std = _std(list(rewards))
    out = []
    for i, r in enumerate(rewards):
        mean, std = stats[i // g]
        a = r - mean
        if scale == "group":
            a /= std + ADV_EPS
        elif scale == "batch":
            a /= batch_std + ADV_EPS
        elif scale != "none":
            raise ValueError(f"unknown scale_rewards {scale!r}")
        out.append(a)
    return out


def zero_std_fraction(rewards: Sequence[float], g: int, tol: float = ZERO_STD_TOL) -> float:
    """rewards (B,) -> share of the B/G groups whose reward std < tol (groups with no learning signal)."""
    stats = group_stats(rewards, g)
    return sum(std < tol for _, std in stats) / len(stats) if stats else float("nan")


def flat_kind(mean: float, std: float, threshold: float = 0.5, tol: float = ZERO_STD_TOL) -> str | None:
    """THE classification of one group: None (its rewards have spread: std >= tol), `fail` (zero variance at a
    common reward below `threshold`: all failed) or `success` (zero variance at or above it)."""
    if std >= tol:
        return None
    return "success" if mean >= threshold else "fail"


def flat_fractions(rewards: Sequence[float], g: int, threshold: float = 0.5,
                   tol: float = ZERO_STD_TOL) -> tuple[float, float]:
    """rewards (B,) -> (share of groups flat at failure, share flat at success): a zero-variance group whose
    common reward is below `threshold` failed everywhere (all-0 under a 0/1 reward), one at or above it
    succeeded everywhere. The two add up to `zero_std_fraction`. A low token adds spread to all-success groups
    only (it can only lower success); all-failure groups need exploration."""
    stats = group_stats(rewards, g)
    if not stats:
        return float("nan"), float("nan")
    kinds = [flat_kind(mu, std, threshold, tol) for mu, std in stats]
    low, high = kinds.count("fail"), kinds.count("success")
    return low / len(stats), high / len(stats)


def spread_groups(rewards: Sequence[float], g: int, tol: float = ZERO_STD_TOL) -> list[bool]:
    """rewards (B,) -> (B/G,): whether each group has reward spread (std >= tol), i.e. a learning signal."""
    return [std >= tol for _, std in group_stats(rewards, g)]


def advantage_spread(advantages: Sequence[float]) -> float:
    """advantages (B,) -> mean |A| (0 when every group is zero-variance)."""
    return sum(abs(a) for a in advantages) / len(advantages) if advantages else float("nan")


def advantage_std(advantages: Sequence[float]) -> float:
    """advantages (B,) -> their unbiased std over the batch (NaN for B = 0)."""
    return _std(list(advantages)) if advantages else float("nan")


def level_names(levels: Sequence[str]) -> dict[str | None, str]:
    """Metric names of the tokens: the lowest `low`, the highest `high`, a middle one `level<i>`, none `none`."""
    levels = check_levels(levels)
    names: dict[str | None, str] = {t: f"level{i}" for i, t in enumerate(levels)}
    names.update({levels[0]: "low", levels[-1]: "high", None: "none"})
    return names


def _by_token(values: Sequence[float], tokens: Sequence[str | None], levels: Sequence[str]) -> dict[str, list]:
    if len(values) != len(tokens):
        raise ValueError(f"{len(values)} values but {len(tokens)} tokens")
    names = level_names(levels)
    out: dict[str, list] = {}
    for v, t in zip(values, tokens, strict=True):
        out.setdefault(names.get(t, str(t)), []).append(v)
    return out


def reward_by_token(rewards: Sequence[float], tokens: Sequence[str | None], *,
                    levels: Sequence[str]) -> dict[str, float]:
    """rewards (B,), tokens (B,) -> {'high': mean, 'low': mean, 'none': mean, ...} over the rollouts present."""
    return {k: sum(v) / len(v) for k, v in _by_token(rewards, tokens, levels).items()}


def controllability_gap(rewards: Sequence[float], tokens: Sequence[str | None], *, levels: Sequence[str]) -> float:
    """E[R | high] - E[R | low] over a batch (B,); NaN unless both tokens occur."""
    by = reward_by_token(rewards, tokens, levels=levels)
    return by["high"] - by["low"] if "high" in by and "low" in by else float("nan")


def generation_metrics(rewards: Sequence[float], tokens: Sequence[str | None], advantages: Sequence[float], g: int,
                       *, levels: Sequence[str], thresholds: Sequence[float]) -> dict[str, float]:
    """What RC-GRPO's trainer logs of one generation batch (every process's rollouts, batch order), `rc/...`:

    - `frac_zero_std`: groups without reward variance; `frac_flat_fail` / `frac_flat_success`: those flat
      below / at or above the highest threshold (they add up to it);
    - `reward` and `reward_<level>` (`high`, `low`, `none`, `level<i>`): mean reward, overall and per token;
      `success_<level>`: the share reaching the highest level (reward >= the highest threshold);
    - `controllability_gap`: reward | high - reward | low (NaN unless both tokens occur);
    - `token_frac_high`: the share of rollouts conditioned on the highest level;
    - `nonzero_adv_<level>`: rollouts per token whose advantage is not zero (|A| > `NONZERO_ADV`): where the
      step's learning signal sits;
    - `adv_abs_mean`, `adv_std`: the advantages' spread.
    Rewards may be NaN (unscorable); a NaN propagates into the means it enters, as in TRL's own log."""
    n = len(rewards)
    if not (n == len(tokens) == len(advantages)):
        raise ValueError(f"lengths differ: {n} rewards, {len(tokens)} tokens, {len(advantages)} advantages")
    top = thresholds[-1] if thresholds else 0.5
    top_level = len(check_levels(levels)) - 1
    flat_fail, flat_success = flat_fractions(rewards, g, top)
    out = {"rc/reward": sum(rewards) / n if n else float("nan"), "rc/frac_zero_std": zero_std_fraction(rewards, g),
           "rc/frac_flat_fail": flat_fail, "rc/frac_flat_success": flat_success,
           "rc/controllability_gap": controllability_gap(rewards, tokens, levels=levels),
           "rc/token_frac_high": sum(t == levels[-1] for t in tokens) / n if n else float("nan"),
           "rc/adv_abs_mean": advantage_spread(advantages), "rc/adv_std": advantage_std(advantages)}
    for name, vals in _by_token(rewards, tokens, levels).items():
        out[f"rc/reward_{name}"] = sum(vals) / len(vals)
        ok = [v for v in vals if v == v]
        out[f"rc/success_{name}"] = (sum(level_of(v, thresholds) == top_level for v in ok) / len(ok)
                                     if ok else float("nan"))
    for name, vals in _by_token([abs(a) > NONZERO_ADV for a in advantages], tokens, levels).items():
        out[f"rc/nonzero_adv_{name}"] = float(sum(vals))
    return out
