"""The grid's results over seeds: each seed's rows (`results_table.build_report` on the shared models and that
seed's RCTP and RL models), the rows pooled over seeds, RCTP's premise gate per seed and the declared endpoints
(`endpoints`), as the report stage writes them.

A seed is one training of everything downstream of SFT (`evaluation.grid`): its rows compare models of that
seed with each other (RL cells with their init, RC-GRPO with GRPO, RCTP with the shared SFT model); pooled
rows average a seeded model over seeds with a two-level bootstrap interval (seeds, then entries), so the
interval holds training variance as well as the entries'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from rcgrpo_tasks.evaluation import endpoints as ep
from rcgrpo_tasks.evaluation.grid import GridConfig
from rcgrpo_tasks.evaluation.results_table import EvalResult, build_report, load_eval, paired_groups, rc_versus_grpo
from rcgrpo_tasks.evaluation.stats import two_level_bootstrap
from rcgrpo_tasks.ops.inputs import InputError, read_json


@dataclass
class Seed:
    """One grid seed's results: report rows, per-entry results by label, RL summaries by cell, the RC-GRPO vs
    GRPO contrast, the controllability metrics of its RCTP model."""

    seed: int
    rows: list[dict]
    results: dict[str, EvalResult]
    rl: dict[str, dict]
    contrast: dict
    controllability: dict = field(default_factory=dict)
    controllability_rl: dict[str, dict] = field(default_factory=dict)
    """The premise after RL: each RCTP-init cell's controllability check on its policy, by cell."""


@dataclass(frozen=True)
class Roots:
    """Where the grid's outputs live (the report's arguments; dvc.yaml names them)."""

    eval_root: Path
    rl_root: Path
    controllability_root: Path | None = None


def load_seed(grid: GridConfig, roots: Roots, seed: int, boot_seed: int = 0) -> Seed:
    """A seed's rows from the shared evaluations (eval_root/<label>) and its own (eval_root/<seed>/<label>,
    rl_root/<seed>/<cell>/metrics.json, controllability_root/<seed>.json; after RL, where its stage ran,
    controllability_root/<seed>/<cell>.json)."""
    evals = [(label, roots.eval_root / label) for label in grid.labels]
    evals += [(label, roots.eval_root / str(seed) / label) for label in grid.seeded_labels]
    rl = [(cell, roots.rl_root / str(seed) / cell / "metrics.json") for cell in grid.cells]
    ctl = []
    if roots.controllability_root is not None:
        ctl = [("rctp", roots.controllability_root / f"{seed}.json")]
    for _, path in evals:
        if not path.exists():
            raise InputError(f"{path}: no evaluation (run `dvc repro`: the grid's evaluate stages of seed {seed})")
    rows = build_report(evals, rl, boot_seed, ctl)
    for row in rows:
        row["seed"] = seed if row["label"] in grid.seeded_labels else None
    rl_by = {cell: read_json(path) for cell, path in rl}
    contrast = rc_versus_grpo(rows, {cell: m.get("groups") or [] for cell, m in rl_by.items()})
    after = {}
    if roots.controllability_root is not None:
        for cell in grid.cells:
            path = roots.controllability_root / str(seed) / f"{cell}.json"
            if cell.startswith("rctp-") and path.is_file():
                after[cell] = read_json(path)
    return Seed(seed, rows, {label: load_eval(label, path) for label, path in evals}, rl_by, contrast,
                read_json(ctl[0][1]) if ctl else {}, after)


def premise(seeds: list[Seed]) -> list[dict]:
    """Per seed, RCTP's premise gate as its controllability stage judged it (q and the sampled gap)."""
    out = []
    for s in seeds:
        gate, sampled = s.controllability.get("premise_gate"), s.controllability.get("sampled") or {}
        if gate:
            out.append({"seed": s.seed, **gate, "gap": sampled.get("gap"), "gap_ci": sampled.get("gap_ci"),
                        "high": sampled.get("success_rate_high"), "low": sampled.get("success_rate_low"),
                        "q_ci": (sampled.get("premise") or {}).get("q_ci")})
    return out


def _entries(res: EvalResult, key: str) -> dict[str, float]:
    return {e["entry_id"]: e[key] for e in res.entries}


def pooled_rows(seeds: list[Seed], labels: list[str], boot_seed: int = 0) -> list[dict]:
    """Per seeded label: greedy accuracy and pass@1 averaged over seeds (%), each with a two-level bootstrap
    interval (seeds, then entries), the per-seed values, and the paired difference to its init (`vs`: RL cell ->
    its init, RCTP -> SFT) by the endpoints' procedure (`_pooled_diff`)."""
    out = []
    for label in labels:
        row: dict = {"label": label, "seeds": len(seeds)}
        for key in ("correct", "pass1"):
            per = [[100 * v for v in _entries(s.results[label], key).values()] for s in seeds]
            if any(math.isnan(v) for p in per for v in p):
                row[key] = None
                continue
            r = two_level_bootstrap(per, seed=boot_seed)
            row[key] = {"mean": r["diff"], "ci": r["ci"], "per_seed": r["per_seed"], "n": r["n"]}
        init = "sft" if label == "rctp" else label.split("-", 1)[0] if "-" in label else None
        if init is not None:
            row["vs"] = {"init": init, **{key: _pooled_diff(seeds, label, init, key)
                                          for key in ("correct", "pass1")}}
        out.append(row)
    return out


def _entry_units(s: Seed, label: str, other: str, key: str) -> list[tuple[str, float, float]]:
    """(entry, label's, other's) per-entry `key` (correct | pass1) of one seed on the entries both evaluated, in
    entry-id order: the pairs every comparison of two evaluated models is made of."""
    mine, theirs = _entries(s.results[label], key), _entries(s.results[other], key)
    return [(i, float(mine[i]), float(theirs[i])) for i in sorted(set(mine) & set(theirs))]


def _pooled_diff(seeds: list[Seed], label: str, other: str, key: str) -> dict | None:
    """label - other per entry (pts), paired within each seed, by the endpoints' own procedure
    (`endpoints.paired_stats`: greedy the exact McNemar test with Tango's interval over entries x seeds, pass@1
    a t over the seed-averaged entries), so a contrast declared as an endpoint reads the same in both tables."""
    rows = [_entry_units(s, label, other, key) for s in seeds]
    if not any(rows) or any(math.isnan(v) for r in rows for _, a, b in r for v in (a, b)):
        return None
    data = {"measure": "greedy" if key == "correct" else "pass1", "units": [[u for u, _, _ in r] for r in rows],
            "pairs": [[[a, b] for _, a, b in r] for r in rows]}
    r = ep.paired_stats(data, 0.05, 0.8)
    return {"diff": 100 * r["diff"], "ci": [100 * x for x in r["ci"]], "per_seed": [100 * v for v in r["per_seed"]]}


def _flag(measure: str, group: dict) -> float:
    """A group's value under a group measure (`endpoints.UNITS`)."""
    if measure == "nonzero_adv_high":
        return float((group.get("nonzero_adv") or {}).get("high", 0))
    want = {"zero_variance": ("fail", "success"), "flat_fail": ("fail",), "flat_success": ("success",)}[measure]
    return float(group["flat"] in want)


def _gaps(s: Seed, label: str) -> dict[str, float]:
    """Per entry, the sampled E[R|high] - E[R|low] of a seed's RCTP model (`rctp`: before RL) or of an RL cell's
    policy (after RL) in its controllability check."""
    ctl = s.controllability if label == "rctp" else s.controllability_rl.get(label)
    per = ((ctl or {}).get("sampled") or {}).get("per_entry")
    if per is None:
        raise InputError(f"seed {s.seed}: no per-entry controllability of {label} (run its controllability stage: "
                         f"{'controllability' if label == 'rctp' else 'controllability_rl_rctp'}@{s.seed})")
    return {e: h - w for e, (h, w) in per.items()}


def _paired_units(e: dict, s: Seed) -> list[tuple[str, float, float]]:
    """(unit id, cell's value, versus' value) of one seed under a paired endpoint, in unit order."""
    m, cell, other = e["measure"], e["cell"], e["versus"]
    if ep.UNITS[m] == "groups":
        pairs = paired_groups(s.rl[cell].get("groups") or [], s.rl[other].get("groups") or [])
        return [(f"{b['step']}:{b['group']}", _flag(m, a), _flag(m, b)) for b, a in pairs]
    if m != "token_gap":
        return _entry_units(s, cell, other, "pass1" if m == "pass1" else "correct")
    mine, theirs = _gaps(s, cell), _gaps(s, other)
    return [(i, mine[i], theirs[i]) for i in sorted(set(mine) & set(theirs))]


def endpoint_data(e: dict, seeds: list[Seed]) -> dict:
    """The per-unit values behind one declared endpoint, JSON-able (`endpoints.endpoint_stats` computes from
    them alone): per seed, each unit's (cell's, versus') value for a paired measure, [up, down, prompts] for a
    sign measure."""
    m = e["measure"]
    out: dict = {"measure": m, "seeds": [s.seed for s in seeds]}
    if m in ep.PREMISE:
        checks = [s.controllability_rl.get(e["cell"]) for s in seeds]
        lacking = [s.seed for s, c in zip(seeds, checks) if not c]
        if lacking:
            raise InputError(f"endpoint {ep.name(e)}: no controllability check of {e['cell']} after RL in seed(s) "
                             f"{lacking} (run controllability_rl_rctp@<seed>-<algo>)")
        prem = [c["sampled"]["premise"] for c in checks]
        return out | {"unit": "seeds", "q": [p["q"] for p in prem], "q_ci": [p.get("q_ci") for p in prem],
                      "side": [c.get("side") for c in checks]}
    if m in ep.PAIRED:
        rows = [_paired_units(e, s) for s in seeds]
        return out | {"unit": ep.UNITS[m], "units": [[u for u, _, _ in r] for r in rows],
                      "pairs": [[[a, b] for _, a, b in r] for r in rows]}
    counts = []
    for s in seeds:
        m_ = s.rl[e["cell"]]
        if m == "pool_learning":
            part = m_.get("pool_learning_equal")
        else:
            probe = m_.get("probe") or {}
            part = (probe if m == "probe" else probe.get("transfer") or {}).get("change")
        if part is None:
            raise InputError(f"endpoint {ep.name(e)}: seed {s.seed}'s run has no "
                             f"{'pool_learning_equal' if m == 'pool_learning' else m + ' half in its probe'}")
        counts.append([part["up"], part["down"], part["prompts"]])
    return out | {"unit": "prompts", "counts": counts}


def endpoint_results(cfg: ep.EndpointsConfig, seeds: list[Seed]) -> list[dict]:
    """Every declared endpoint, primary first: {rank, name, spec, data (its per-unit values), ...statistics}. A
    named cell the grid did not run is an InputError naming the endpoint."""
    out = []
    for rank, e in cfg.all():
        for who in (e["cell"], e.get("versus")):
            if who is not None and any(who not in s.results and who not in s.rl for s in seeds):
                raise InputError(f"endpoints: {ep.name(e)}: {who!r} is not a model of params grid")
        data = endpoint_data(e, seeds)
        out.append({"rank": rank, "name": ep.name(e), "spec": e, "data": data,
                    **ep.endpoint_stats(data, cfg.alpha, cfg.power, cfg.premise_kept_q)})
    return out
