"""The endpoints a run declares before it runs (params `endpoints`) and their statistics over seeds.

An endpoint is a measure of one cell against another (or of one cell), pooled over the grid's seeds:
- `zero_variance` (cell vs other: RC-GRPO vs GRPO from the same init): the share of training groups whose
  rewards have no spread, paired group by group (the same step and slot draw the same entry and seeds in both
  runs of a seed), pooled over seeds; exact McNemar p on the discordant groups, Tango's interval of the
  difference in shares, the minimum detectable difference at the observed discordance;
- `pass1` (cell vs other, an evaluated model: an RL cell or `rctp`): held-out pass@1, per entry paired
  within each seed; a two-level bootstrap (seeds, then entries) gives the interval and the MDE, the
  sign-flip test of the entries' seed-averaged differences the p;
- `greedy` (cell vs other): held-out greedy success, paired over seed x entry pairs (exact McNemar, Tango);
- `pool_learning` (cell): pool prompts whose reward rose from their first visit to their last vs fell, summed
  over seeds; the exact sign test (`train.rl.diagnostics.pool_learning`);
- `probe` / `transfer` (cell): the fixed probe's pool half / its half outside the pool, prompts up vs down
  from step 0 to the end, summed over seeds; the exact sign test.
Every endpoint reports its n, its test, p and (where a power calculation exists) the minimum detectable effect
at `power`; the report says how many it reports. No multiplicity correction is applied: the primary ones
are few and named before the run, the secondary ones are read as such.
"""

from __future__ import annotations

from dataclasses import dataclass

from rcgrpo.stats import mcnemar_exact
from rcgrpo_tasks.evaluation.stats import paired_binary, sign_flip_p, two_level_bootstrap

PAIRED = ("zero_variance", "pass1", "greedy")
"""Measures of a cell against another."""
SINGLE = ("pool_learning", "probe", "transfer")
"""Measures of one RL cell."""


@dataclass(frozen=True)
class EndpointsConfig:
    alpha: float
    """Two-sided level of every test and interval (1 - alpha coverage)."""
    power: float
    """Power at which each endpoint's minimum detectable effect is stated."""
    primary: tuple[dict, ...]
    """The endpoints the run is judged on: {measure, cell, versus} (versus only for `PAIRED` measures)."""
    secondary: tuple[dict, ...]
    """Endpoints reported as secondary (descriptive), same form."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 0.5 or not 0.5 <= self.power < 1:
            raise ValueError(f"alpha in (0, 0.5) and power in [0.5, 1) required, got {self.alpha}, {self.power}")
        if not self.primary:
            raise ValueError("primary: at least one endpoint, declared before the run")
        for kind, items in (("primary", self.primary), ("secondary", self.secondary)):
            for i, e in enumerate(items):
                measure = e.get("measure") if isinstance(e, dict) else None
                want = {"measure", "cell", "versus"} if measure in PAIRED else {"measure", "cell"}
                if measure not in PAIRED + SINGLE or set(e) != want:
                    raise ValueError(f"{kind}[{i}]: {{measure, cell[, versus]}} with measure in {list(PAIRED + SINGLE)} "
                                     f"(versus only for {list(PAIRED)}), got {e!r}")

    def all(self) -> list[tuple[str, dict]]:
        """(rank, endpoint) in declared order, primary first."""
        return [("primary", e) for e in self.primary] + [("secondary", e) for e in self.secondary]


def name(e: dict) -> str:
    return f"{e['measure']}: {e['cell']}" + (f" vs {e['versus']}" if "versus" in e else "")


def zero_variance(pairs_by_seed: list[list[tuple[bool, bool]]], alpha: float, power: float) -> dict:
    """RC-GRPO's zero-variance share minus GRPO's over paired groups (first = the cell's group flat, second =
    the other's), pooled over seeds (`evaluation.stats.paired_binary`)."""
    flat = [p for pairs in pairs_by_seed for p in pairs]
    r = paired_binary([a for a, _ in flat], [b for _, b in flat], alpha, power)
    return {**r, "cell_share": sum(a for a, _ in flat) / len(flat) if flat else float("nan"),
            "versus_share": sum(b for _, b in flat) / len(flat) if flat else float("nan"), "unit": "groups",
            "per_seed": [sum(a for a, _ in p) / len(p) - sum(b for _, b in p) / len(p) if p else float("nan")
                         for p in pairs_by_seed]}


def rate_difference(diffs_by_seed: list[list[float]], alpha: float, power: float, seed: int = 0) -> dict:
    """A per-entry rate (pass@1) of a cell minus another's, each seed's entries in one order: the two-level
    bootstrap's interval and MDE, the sign-flip p of the entries' differences averaged over seeds."""
    r = two_level_bootstrap(diffs_by_seed, seed=seed, alpha=alpha, power=power)
    n = r["n"]
    averaged = [sum(d[i] for d in diffs_by_seed) / len(diffs_by_seed) for i in range(n)] if n else []
    return {**r, "p": sign_flip_p(averaged, seed=seed), "unit": "entries x seeds",
            "test": "sign-flip permutation over entries; two-level bootstrap (seeds, then entries) interval"}


def binary_difference(pairs_by_seed: list[list[tuple[float, float]]], alpha: float, power: float) -> dict:
    """Greedy success of a cell minus another's over seed x entry pairs (`evaluation.stats.paired_binary`)."""
    flat = [p for pairs in pairs_by_seed for p in pairs]
    r = paired_binary([a for a, _ in flat], [b for _, b in flat], alpha, power)
    return {**r, "unit": "entries x seeds",
            "per_seed": [sum(a - b for a, b in p) / len(p) if p else float("nan") for p in pairs_by_seed]}


def sign_counts(counts_by_seed: list[dict]) -> dict:
    """Prompts up vs down summed over seeds (each {up, down, prompts}) and the exact sign test."""
    up = sum(c["up"] for c in counts_by_seed)
    down = sum(c["down"] for c in counts_by_seed)
    return {"up": up, "down": down, "n": sum(c["prompts"] for c in counts_by_seed), "p": mcnemar_exact(up, down),
            "diff": (up - down) / max(up + down, 1), "unit": "prompts x seeds", "test": "exact sign test",
            "per_seed": [(c["up"], c["down"]) for c in counts_by_seed]}
