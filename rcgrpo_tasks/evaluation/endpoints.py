"""The endpoints a run declares before it runs (params `endpoints`) and their statistics over seeds, computed from
the per-unit values behind each one (`data`: what the report commits, `write_files`), so one command recomputes
the report's table from the repository (`rcgrpo endpoints --recompute`).

An endpoint is a measure of one cell against another (or of one cell), pooled over the grid's seeds. Paired
measures compare two models on the same units (`UNITS`):
- groups (the same step and slot draw the same entry and seeds in both runs of a seed; groups are nested in
  their seed): `zero_variance` (the group's rewards have no spread), `flat_fail` / `flat_success` (no spread,
  all failed / all succeeded: GRPO's groups flat at failure that the cell makes informative are the rescue
  the paper means, those flat at success a manipulation check), `nonzero_adv_high` (high-token rollouts whose
  advantage is not 0: the signal on the policy that is evaluated);
- entries (held out; crossed with seeds: every seed evaluates the same entries): `pass1`, `greedy`, and
  `token_gap` (each entry's E[R|high] - E[R|low] in the controllability check: the premise after RL against
  before it when `versus` is `rctp`).
Measures of one cell (`SINGLE`): `pool_learning` (pool prompts up vs down from first to last visit, on equal
samples per visit), `probe` / `transfer` (the fixed probe's pool half / its half outside the pool).

Statistics, each from ONE procedure (estimate, interval, p and MDE of the same model), at two levels:
- unit level: 0/1 measures on the pooled pairs: exact McNemar p, Tango's interval, the MDE at the observed
  discordance; the others a paired t over units (entries: their seed-averaged differences, the design being
  crossed; groups: every seed's groups pooled); sign measures the exact sign test with its Clopper-Pearson
  interval. Units are taken as independent: between-seed variance is left out;
- seed level, beside it: a t over the per-seed differences (df = seeds - 1), which holds training variance
  and treats seeds as the replicates they are (a group's run and its paired group share one trajectory).
The MDE is given as the range over the two variance models (`mde_range`): where they disagree the design's
power is that uncertain. No multiplicity correction: the primary endpoints are few and named before the run.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from rcgrpo_tasks.evaluation.stats import paired_binary, sign_summary, t_summary
from rcgrpo_tasks.ops.inputs import InputError, read_json
from rcgrpo_tasks.ops.outputs import write_json

UNITS: dict[str, str] = {"zero_variance": "groups", "flat_fail": "groups", "flat_success": "groups",
                         "nonzero_adv_high": "groups", "pass1": "entries", "greedy": "entries", "token_gap": "entries"}
"""Paired measures (a cell against another) and the units they pair."""
PAIRED = tuple(UNITS)
BINARY = ("zero_variance", "flat_fail", "flat_success", "greedy")
"""Paired measures that are 0/1 per unit (exact McNemar at the unit level)."""
SINGLE = ("pool_learning", "probe", "transfer")
"""Measures of one RL cell (sign counts of prompts)."""
INDEX = "index.json"
"""The endpoint files' index (`write_files`): alpha, power, seeds and each endpoint's file."""


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


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def unit_differences(data: dict) -> list[float]:
    """The unit level's differences: crossed units (entries: the same ids in every seed) averaged over the seeds
    that all hold them, in id order; nested ones (groups) every seed's, pooled."""
    if UNITS[data["measure"]] == "entries":
        by = [dict(zip(ids, pairs)) for ids, pairs in zip(data["units"], data["pairs"])]
        common = sorted(set.intersection(*(set(b) for b in by))) if by else []
        return [_mean([b[u][0] - b[u][1] for b in by]) for u in common]
    return [a - b for pairs in data["pairs"] for a, b in pairs]


def _seed_level(per_seed: list[float], alpha: float, power: float) -> dict:
    r = t_summary(per_seed, alpha, power)
    return {k: r[k] for k in ("diff", "ci", "p", "mde", "df")} | {"test": f"t over {len(per_seed)} seed(s)"}


def paired_stats(data: dict, alpha: float, power: float) -> dict:
    """A paired measure from its pairs (`data`: per seed, (cell's, versus') value per unit): the unit level,
    the seed level beside it and the MDE range (module docstring)."""
    m, pairs = data["measure"], data["pairs"]
    per_seed = [_mean([a - b for a, b in p]) for p in pairs]
    seed = _seed_level(per_seed, alpha, power)
    unit = UNITS[m]
    if m in BINARY:
        flat = [p for ps in pairs for p in ps]
        r = paired_binary([a for a, _ in flat], [b for _, b in flat], alpha, power)
        r |= {"cell_share": _mean([a for a, _ in flat]), "versus_share": _mean([b for _, b in flat]),
              "units": f"{unit} x seeds"}
    else:
        diffs = unit_differences(data)
        r = t_summary(diffs, alpha, power)
        crossed = unit == "entries"
        r |= {"test": f"paired t over {'seed-averaged entries' if crossed else 'groups x seeds'}",
              "units": unit if crossed else f"{unit} x seeds"}
    mdes = sorted(v for v in (r["mde"], seed["mde"]) if not math.isnan(v))
    return {**r, "per_seed": per_seed, "seed_level": seed, "mde_range": [mdes[0], mdes[-1]] if mdes else None}


def sign_stats(data: dict, alpha: float, power: float) -> dict:
    """A sign measure from its per-seed counts (`data["counts"]`: [up, down, prompts] per seed): the exact sign
    test on the pooled counts (`evaluation.stats.sign_summary`) and the seed level on each seed's net share
    (up - down) / prompts."""
    counts = data["counts"]
    up, down = sum(c[0] for c in counts), sum(c[1] for c in counts)
    r = sign_summary(up, down, alpha, power)
    net = [(u - d) / n if n else float("nan") for u, d, n in counts]
    seed = _seed_level([v for v in net if not math.isnan(v)], alpha, power)
    return {**r, "up": up, "down": down, "prompts": sum(c[2] for c in counts), "units": "prompts x seeds",
            "test": "exact sign test, Clopper-Pearson interval of the share up", "per_seed": [c[:2] for c in counts],
            "seed_level": seed, "mde_range": None}


def endpoint_stats(data: dict, alpha: float, power: float) -> dict:
    """One endpoint's statistics from its per-unit values alone (what `rcgrpo endpoints --recompute` reruns)."""
    return sign_stats(data, alpha, power) if data["measure"] in SINGLE else paired_stats(data, alpha, power)


# ---------------------------------------------------------------- the files behind the endpoints


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def write_files(folder: Path, results: list[dict], alpha: float, power: float, seeds: int) -> None:
    """The per-unit values of every endpoint (`results[i]["data"]`), one small JSON file each, and `INDEX`."""
    folder = Path(folder)
    index = {"alpha": alpha, "power": power, "seeds": seeds, "endpoints": []}
    for i, r in enumerate(results, 1):
        file = f"{i:02d}-{_slug(r['name'])}.json"
        write_json(folder / file, {"rank": r["rank"], "name": r["name"], "spec": r["spec"], "data": r["data"]})
        index["endpoints"].append({"file": file, "rank": r["rank"], "name": r["name"]})
    write_json(folder / INDEX, index)


def recompute(folder: Path) -> tuple[list[dict], float, float, int]:
    """(results, alpha, power, seeds) recomputed from the files `write_files` wrote: every endpoint's statistics
    from its per-unit values (`endpoint_stats`), in declared order."""
    folder = Path(folder)
    if not (folder / INDEX).is_file():
        raise InputError(f"{folder / INDEX}: not found (the report stage writes it: results/report/endpoints)")
    index = read_json(folder / INDEX)
    out = []
    for item in index["endpoints"]:
        got = read_json(folder / item["file"])
        out.append({"rank": got["rank"], "name": got["name"], "spec": got["spec"], "data": got["data"],
                    **endpoint_stats(got["data"], index["alpha"], index["power"])})
    return out, index["alpha"], index["power"], index["seeds"]
