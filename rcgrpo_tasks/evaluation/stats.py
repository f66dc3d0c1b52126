"""The report's statistics over entries, groups and seeds, on the bootstrap primitives of `rcgrpo.stats`
(percentile bootstrap, its paired form, exact McNemar: the library's, shared with every layer).

- `wilson_ci` and Tango's paired score interval (`tango_paired_ci`, `paired_binary`) never collapse to a
  point on small samples where a percentile bootstrap does;
- `t_summary` / `paired_mean` (a t over units: interval, p and MDE of one model) for per-unit rates such as
  pass@1 and for per-seed differences; `sign_summary` (the exact sign test with its Clopper-Pearson interval);
  `two_level_bootstrap` pools a level over seeds and units; `z_power` gives each test's minimum detectable effect.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from rcgrpo.stats import N_BOOT, bootstrap_ci, mcnemar_exact, paired_bootstrap_ci, percentiles  # noqa: F401


def wilson_ci(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a proportion (95 % by default): never [0, 0] at 0/n, unlike a bootstrap
    of n zeros; (NaN, NaN) for n = 0."""
    if n <= 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _tango_z(b: int, c: int, n: int, delta: float) -> float:
    """Tango's score statistic of p1 - p2 = `delta` (p12 - p21 with b = only-first, c = only-second pairs of
    n), under the restricted maximum-likelihood p21 (the positive root of 2n p^2 - B p - c delta (1 - delta))."""
    big_b = b + c + (b - c) * delta - 2 * n * delta
    p21 = (big_b + math.sqrt(big_b ** 2 + 8 * n * c * delta * (1 - delta))) / (4 * n)
    var = n * (2 * p21 + delta - delta ** 2)
    return (b - c - n * delta) / math.sqrt(var) if var > 0 else math.copysign(math.inf, b - c - n * delta)


def tango_paired_ci(b: int, c: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % score interval of p1 - p2 for n paired binary outcomes, b of them positive under the first arm
    only and c under the second only (Tango 1998): the deltas whose score statistic lies within +-z, found by
    bisection. Never a point: with b = c = 0 it is +-z^2 / (n + z^2), where a percentile bootstrap gives [0, 0]."""
    if n <= 0 or b + c > n:
        return (float("nan"), float("nan"))
    est = (b - c) / n

    def solve(lo: float, hi: float, target: float) -> float:
        for _ in range(100):  # Z falls as delta rises
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _tango_z(b, c, n, mid) > target else (lo, mid)
        return (lo + hi) / 2

    eps = 1e-12
    return (solve(-1 + eps, est, z) if est > -1 + eps else -1.0, solve(est, 1 - eps, -z) if est < 1 - eps else 1.0)


def z_power(alpha: float = 0.05, power: float = 0.8) -> float:
    """z_(1 - alpha/2) + z_power: the factor of a two-sided test's minimum detectable effect (2.80 at 0.05, 0.8)."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)


def paired_binary(x: Sequence[float], y: Sequence[float], alpha: float = 0.05, power: float = 0.8) -> dict:
    """Paired 0/1 outcomes (same units under two arms): the difference of the two rates, its Tango score
    interval, the discordant counts, the exact McNemar p and the minimum detectable difference at `power`
    for these n units at the observed discordance (normal approximation: z_power x sqrt(psi / n), psi =
    the discordant share, at least 1/n)."""
    if len(x) != len(y):
        raise ValueError(f"paired samples differ in length: {len(x)} vs {len(y)}")
    pairs = [(bool(round(u)), bool(round(v))) for u, v in zip(x, y)]
    b = sum(1 for p, q in pairs if p and not q)
    c = sum(1 for p, q in pairs if q and not p)
    n = len(pairs)
    lo, hi = tango_paired_ci(b, c, n)
    psi = max(b + c, 1) / n if n else float("nan")
    return {"n": n, "diff": (b - c) / n if n else float("nan"), "ci": [lo, hi], "only_first": b, "only_second": c,
            "p": mcnemar_exact(b, c), "test": "exact McNemar, Tango interval",
            "mde": z_power(alpha, power) * math.sqrt(psi / n) if n else float("nan")}


def paired_mean(diffs: Sequence[float], alpha: float = 0.05, power: float = 0.8) -> dict:
    """Mean of paired differences (per-unit rates such as pass@1) by one model, the paired t over units: its
    interval, p and minimum detectable mean difference at `power` (`t_summary`)."""
    r = t_summary(diffs, alpha, power)
    return {k: r[k] for k in ("n", "diff", "ci", "p", "mde")} | {"test": "paired t over entries"}


def two_level_bootstrap(groups: Sequence[Sequence[float]], n_boot: int = N_BOOT, seed: int = 0,
                        alpha: float = 0.05, power: float = 0.8) -> dict:
    """A pooled mean over seeds and units: `groups` holds one list per seed (its per-unit paired differences,
    units in the same order in every seed). Each resample draws seeds with replacement, then units with
    replacement (the same unit indices in every drawn seed: units are paired across seeds too), and takes
    the mean: the interval includes training variance (between seeds) and sampling variance (between
    units). Its standard error gives the minimum detectable effect at `power` (z_power x se)."""
    groups = [[float(v) for v in g] for g in groups if g]
    if not groups:
        return {"seeds": 0, "n": 0, "diff": float("nan"), "ci": [float("nan")] * 2, "se": float("nan"),
                "mde": float("nan"), "per_seed": []}
    n = min(len(g) for g in groups)
    rng = random.Random(seed)
    means = []
    for _ in range(n_boot):
        seeds = [groups[rng.randrange(len(groups))] for _ in groups]
        units = [rng.randrange(n) for _ in range(n)]
        means.append(sum(g[u] for g in seeds for u in units) / (len(seeds) * n))
    mu = sum(means) / len(means)
    se = math.sqrt(sum((v - mu) ** 2 for v in means) / (len(means) - 1))
    lo, hi = percentiles(means, 1 - alpha)
    return {"seeds": len(groups), "n": n, "diff": sum(sum(g[:n]) for g in groups) / (len(groups) * n), "ci": [lo, hi],
            "se": se, "mde": z_power(alpha, power) * se, "per_seed": [sum(g[:n]) / n for g in groups],
            "test": "two-level bootstrap (seeds, then units)"}


def t_summary(diffs: Sequence[float], alpha: float = 0.05, power: float = 0.8) -> dict:
    """One-sample t over units (`diffs`: one paired difference per unit): the mean, its t interval, the two-sided
    t-test p and the minimum detectable mean difference at `power` for this n, all from the one model (se =
    sd / sqrt(n), df = n - 1: MDE = (t_(1 - alpha/2) + t_power) x se). NaN interval and p where there is no
    spread to estimate (n < 2, or every difference equal: an interval of width 0 is not one)."""
    from scipy.stats import t as student_t

    d = [float(v) for v in diffs]
    n = len(d)
    m = sum(d) / n if n else float("nan")
    out = {"n": n, "diff": m, "ci": [float("nan")] * 2, "p": float("nan"), "mde": float("nan"), "se": float("nan"),
           "df": n - 1}
    if n < 2:
        return out
    sd = math.sqrt(sum((v - m) ** 2 for v in d) / (n - 1))
    if sd <= 1e-12 * max(1.0, abs(m)):  # equal differences, up to float rounding
        return out
    se = sd / math.sqrt(n)
    q = student_t.ppf(1 - alpha / 2, n - 1)
    return {**out, "ci": [float(m - q * se), float(m + q * se)], "p": float(2 * student_t.sf(abs(m) / se, n - 1)),
            "mde": float((q + student_t.ppf(power, n - 1)) * se), "se": se}


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion k / n: the one that inverts the exact binomial
    test; (NaN, NaN) for n = 0."""
    from scipy.stats import beta

    if n <= 0:
        return (float("nan"), float("nan"))
    lo = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return (lo, hi)


def sign_summary(up: int, down: int, alpha: float = 0.05, power: float = 0.8) -> dict:
    """The exact sign test of `up` vs `down` units as one procedure: the share up among the changed units, its
    exact interval (Clopper-Pearson, the test's inversion), the exact two-sided p, and the smallest share above
    one half this many changed units detect at `power` (normal approximation of the same binomial)."""
    m = up + down
    lo, hi = clopper_pearson(up, m, alpha)
    return {"n": m, "diff": up / m if m else float("nan"), "ci": [lo, hi], "p": mcnemar_exact(up, down),
            "mde": z_power(alpha, power) * 0.5 / math.sqrt(m) if m else float("nan")}
