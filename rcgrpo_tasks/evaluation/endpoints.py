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
from typing import Literal

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
PREMISE = ("q_after",)
"""Measures of one RL cell read per seed: `q_after`, q = P(low fails | high succeeds) of its policy after RL in
its controllability check (the premise RC-GRPO needs, on the check's side of the split)."""
OUTCOMES = ("gain", "no_gain", "inconclusive")
"""What a primary paired endpoint's decisive interval says (`outcome`): `gain` (its lower end above 0),
`no_gain` (its upper end below the smallest effect of interest: an effect that matters is excluded; the
interval may lie below 0), `inconclusive` (neither)."""
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
    decisive: Literal["unit", "seed"]
    """The level whose interval decides a primary endpoint (`outcome`): `unit` (the paired test over the units,
    e.g. the seed-averaged entries) or `seed` (the t over seeds); the other level is printed beside it as a
    robustness reading."""
    sesoi: dict[str, float]
    """Smallest effect size of interest per measure, in the measure's own units (pass1: a share, 0.025 = 2.5
    points): what `no_gain` excludes. Every primary paired measure needs one when `decisions` are declared."""
    decisions: dict[str, str]
    """What each outcome of a primary endpoint decides (`OUTCOMES` -> text; `{cell}` / `{versus}` name the
    endpoint's models), declared with the endpoints before the run: the report prints the rule table and the
    decision each primary endpoint reached. Empty: no decision rule was declared (the report says so)."""
    premise_kept_q: float | None
    """`q_after` endpoints: the q after RL that counts as the premise kept, in every seed; null: none declared."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 0.5 or not 0.5 <= self.power < 1:
            raise ValueError(f"alpha in (0, 0.5) and power in [0.5, 1) required, got {self.alpha}, {self.power}")
        if not self.primary:
            raise ValueError("primary: at least one endpoint, declared before the run")
        for kind, items in (("primary", self.primary), ("secondary", self.secondary)):
            for i, e in enumerate(items):
                measure = e.get("measure") if isinstance(e, dict) else None
                want = {"measure", "cell", "versus"} if measure in PAIRED else {"measure", "cell"}
                if measure not in PAIRED + SINGLE + PREMISE or set(e) != want:
                    raise ValueError(f"{kind}[{i}]: {{measure, cell[, versus]}} with measure in "
                                     f"{list(PAIRED + SINGLE + PREMISE)} (versus only for {list(PAIRED)}), got {e!r}")
        bad = sorted(set(self.sesoi) - set(PAIRED)) + [m for m, v in self.sesoi.items() if not isinstance(
            v, (int, float)) or isinstance(v, bool) or not v > 0]
        if bad:
            raise ValueError(f"sesoi: a positive effect per paired measure {list(PAIRED)}, got {self.sesoi!r}")
        if self.decisions:
            if set(self.decisions) != set(OUTCOMES) or not all(isinstance(v, str) and v for v in self.decisions.values()):
                raise ValueError(f"decisions: one text for each outcome {list(OUTCOMES)}, got {sorted(self.decisions)}")
            lacking = [name(e) for e in self.primary if e["measure"] not in self.sesoi]
            if lacking:
                raise ValueError(f"decisions need sesoi for every primary endpoint's measure; missing for {lacking}")
            if any(e["measure"] not in PAIRED for e in self.primary):
                raise ValueError("decisions: every primary endpoint must be a paired measure (cell vs versus)")
        if self.premise_kept_q is not None and not 0 < self.premise_kept_q <= 1:
            raise ValueError(f"premise_kept_q must lie in (0, 1] or be null, got {self.premise_kept_q}")

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


def premise_stats(data: dict, alpha: float, power: float, kept: float | None = None) -> dict:
    """`q_after` from each seed's check (`data["q"]`, `data["q_ci"]`: the check's own bootstrap interval over
    entries): the mean over seeds with the seed-level t interval, the least seed, and whether every seed kept
    q >= `kept`."""
    qs = [q for q in data["q"] if q is not None and not math.isnan(q)]
    seed = _seed_level(qs, alpha, power) if qs else {"diff": float("nan"), "ci": [float("nan")] * 2,
                                                       "p": float("nan"), "mde": float("nan"), "df": 0}
    least = min(qs) if qs else float("nan")
    return {"diff": seed["diff"], "ci": seed["ci"], "p": float("nan"), "mde": float("nan"), "least": least,
            "kept": None if kept is None or not qs else least >= kept and len(qs) == len(data["q"]),
            "kept_q": kept, "per_seed": data["q"], "per_seed_ci": data["q_ci"], "seed_level": seed,
            "mde_range": None, "units": "seeds", "test": "mean over seeds, t interval; each seed's bootstrap over entries"}


def endpoint_stats(data: dict, alpha: float, power: float, kept_q: float | None = None) -> dict:
    """One endpoint's statistics from its per-unit values alone (what `rcgrpo endpoints --recompute` reruns)."""
    if data["measure"] in PREMISE:
        return premise_stats(data, alpha, power, kept_q)
    return sign_stats(data, alpha, power) if data["measure"] in SINGLE else paired_stats(data, alpha, power)


def decisive_interval(r: dict, level: str) -> list[float]:
    """The interval that decides a paired endpoint: the unit level's, or the seed level's t interval."""
    return list(r["seed_level"]["ci"] if level == "seed" else r["ci"])


def outcome(r: dict, level: str, sesoi: float) -> str:
    """`OUTCOMES` of one paired endpoint from its decisive interval (`decisive_interval`) and its measure's
    smallest effect of interest: gain if the lower end is above 0, no_gain if the upper end is below `sesoi`,
    inconclusive otherwise (an interval that is not one, e.g. NaN, is inconclusive)."""
    lo, hi = decisive_interval(r, level)
    if lo > 0:
        return "gain"
    if hi < sesoi:
        return "no_gain"
    return "inconclusive"


# ---------------------------------------------------------------- the files behind the endpoints


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def rule(cfg: EndpointsConfig | None) -> dict:
    """The declared decision rule as the endpoint files carry it (`INDEX`): decisive level, SESOI, decisions, the
    premise's q; empty where none was declared."""
    if cfg is None:
        return {}
    return {"decisive": cfg.decisive, "sesoi": dict(cfg.sesoi), "decisions": dict(cfg.decisions),
            "premise_kept_q": cfg.premise_kept_q}


def write_files(folder: Path, results: list[dict], alpha: float, power: float, seeds: int,
                cfg: EndpointsConfig | None = None) -> None:
    """The per-unit values of every endpoint (`results[i]["data"]`), one small JSON file each, and `INDEX` (with
    the declared decision rule, `rule`)."""
    folder = Path(folder)
    index = {"alpha": alpha, "power": power, "seeds": seeds, **rule(cfg), "endpoints": []}
    for i, r in enumerate(results, 1):
        file = f"{i:02d}-{_slug(r['name'])}.json"
        write_json(folder / file, {"rank": r["rank"], "name": r["name"], "spec": r["spec"], "data": r["data"]})
        index["endpoints"].append({"file": file, "rank": r["rank"], "name": r["name"]})
    write_json(folder / INDEX, index)


def recompute(folder: Path) -> tuple[list[dict], float, float, int, dict]:
    """(results, alpha, power, seeds, rule) recomputed from the files `write_files` wrote: every endpoint's
    statistics from its per-unit values (`endpoint_stats`), in declared order, and the declared rule (`rule`)."""
    folder = Path(folder)
    if not (folder / INDEX).is_file():
        raise InputError(f"{folder / INDEX}: not found (the report stage writes it: results/report/endpoints)")
    index = read_json(folder / INDEX)
    out = []
    for item in index["endpoints"]:
        got = read_json(folder / item["file"])
        out.append({"rank": got["rank"], "name": got["name"], "spec": got["spec"], "data": got["data"],
                    **endpoint_stats(got["data"], index["alpha"], index["power"], index.get("premise_kept_q"))})
    declared = {k: index[k] for k in ("decisive", "sesoi", "decisions", "premise_kept_q") if k in index}
    return out, index["alpha"], index["power"], index["seeds"], declared
