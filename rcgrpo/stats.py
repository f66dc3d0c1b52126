"""The few statistics the library's checks need: a seeded percentile bootstrap over units (prompts), its
paired form, and the exact McNemar test of discordant pairs. Pure Python (no numpy, no scipy).

Percentile bootstrap with a fixed seed, so a rerun reproduces the same interval; `paired_bootstrap_ci`
resamples unit indices once for both arms, so per-unit differences keep their pairing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

N_BOOT = 2000
MAX_BOOT = 100_000
"""More resamples than any CI needs (the pure-Python loop takes seconds there): a typo fails fast."""


def check_n_boot(n_boot: int) -> None:
    """Config check shared by every stage with bootstrap CIs: 10 <= n_boot <= MAX_BOOT."""
    if not 10 <= n_boot <= MAX_BOOT:
        raise ValueError(f"n_bootstrap must be in [10, {MAX_BOOT}], got {n_boot}")


def mean(xs: Sequence[float]) -> float:
    """Mean of the non-NaN values (NaN when there are none)."""
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def percentiles(means: list[float], level: float) -> tuple[float, float]:
    """The central `level` interval of bootstrap statistics `means` (sorted in place)."""
    means.sort()
    n = len(means)
    lo = means[int(math.floor((1 - level) / 2 * n))]
    hi = means[min(n - 1, int(math.ceil((1 + level) / 2 * n)) - 1)]
    return (lo, hi)


def bootstrap_ci(values: Sequence[float], strata: Sequence[str] | None = None, n_boot: int = N_BOOT,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of `values` (N,); resampling within `strata` when given."""
    if not values:
        return (float("nan"), float("nan"))
    groups: dict[str, list[float]] = {}
    for i, v in enumerate(values):
        groups.setdefault(strata[i] if strata else "", []).append(float(v))
    rng = random.Random(seed)
    n = len(values)
    means = []
    for _ in range(n_boot):
        total = 0.0
        for vs in groups.values():
            total += sum(vs[rng.randrange(len(vs))] for _ in vs)
        means.append(total / n)
    return percentiles(means, level)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], n_boot: int = N_BOOT, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a - b), CI low, CI high) over paired units (same index = same entry)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    diffs = [float(x) - float(y) for x, y in zip(a, b)]
    if not diffs:
        return (float("nan"), float("nan"), float("nan"))
    lo, hi = bootstrap_ci(diffs, n_boot=n_boot, seed=seed, level=level)
    return (sum(diffs) / len(diffs), lo, hi)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value (a sign test on the discordant pairs): `only_a` units where only arm
    A has the event, `only_b` where only B has it; 1.0 without discordant pairs."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)
