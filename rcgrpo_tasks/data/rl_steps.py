"""An RL run's per-step rows as their readers see them: the columns that show the RC-GRPO mechanism and their
per-run summaries. Written by the rl stage (`train.rl.diagnostics`: the plots TSV and the run summary), drawn
by the report (`evaluation.mechanism`); here, below both, because training and evaluation read them.

- `MECHANISM_COLUMNS`: the share of zero-variance groups, the advantage spread, the controllability gap, the
  reward and the high-token rollouts with a learning signal, in plotting order; `thirds`: a run's columns by
  thirds of training.
- `step_summary(rows)`: mean of each of those columns over the steps where it is defined, with a 95 %
  percentile-bootstrap CI over steps (`rcgrpo.stats.bootstrap_ci`). Steps of one run are not independent
  (the policy drifts, entries repeat), so the CI describes the spread of the logged steps, not a
  population; compare runs by their curves as well.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from rcgrpo.stats import bootstrap_ci

MECHANISM_COLUMNS = ("frac_zero_std", "adv_abs_mean", "adv_std", "controllability_gap", "reward", "nonzero_adv_high")
"""Per-step columns that show the mechanism, in plotting order (the last: high-token rollouts with a non-zero
advantage, the signal on the policy that is evaluated)."""


def finite(values: Sequence[float]) -> list[float]:
    """The values that are numbers (no None, no NaN), as floats."""
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def column_summary(values: Sequence[float], seed: int = 0) -> dict:
    """{mean, ci_low, ci_high, steps} of the finite `values` (one per step); None fields when there are none."""
    xs = finite(values)
    if not xs:
        return {"mean": None, "ci_low": None, "ci_high": None, "steps": 0}
    lo, hi = bootstrap_ci(xs, seed=seed)
    return {"mean": sum(xs) / len(xs), "ci_low": lo, "ci_high": hi, "steps": len(xs)}


def step_summary(rows: Sequence[Mapping], columns: Sequence[str] = MECHANISM_COLUMNS, seed: int = 0) -> dict:
    """{column: column_summary} over the step rows of one run (a missing column counts as undefined)."""
    return {c: column_summary([r.get(c, float("nan")) for r in rows], seed) for c in columns}


def thirds(rows: Sequence[Mapping], columns: Sequence[str]) -> list[dict]:
    """The run's steps cut into thirds (ceil(n/3) and ceil(2n/3) steps: 10 / 10 / 10 of 30), each third's
    first and last step and the mean of each column over the steps where it is defined (None where none is):
    how a quantity moves through training, e.g. the token gap `reward_high - reward_low` as RL erodes it."""
    rows = sorted(rows, key=lambda r: r["step"])
    n = len(rows)
    cuts = [0, (n + 2) // 3, (2 * n + 2) // 3, n]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        part = rows[a:b]
        if not part:
            continue
        means = {c: finite([r.get(c, float("nan")) for r in part]) for c in columns}
        out.append({"steps": [part[0]["step"], part[-1]["step"]],
                    **{c: sum(v) / len(v) if v else None for c, v in means.items()}})
    return out
