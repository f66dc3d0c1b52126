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


@dataclass(frozen=True)
class Roots:
    """Where the grid's outputs live (the report's arguments; dvc.yaml names them)."""

    eval_root: Path
    rl_root: Path
    controllability_root: Path | None = None


def load_seed(grid: GridConfig, roots: Roots, seed: int, boot_seed: int = 0) -> Seed:
    """A seed's rows from the shared evaluations (eval_root/<label>) and its own (eval_root/<seed>/<label>,
    rl_root/<seed>/<cell>/metrics.json, controllability_root/<seed>.json)."""
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
    return Seed(seed, rows, {label: load_eval(label, path) for label, path in evals}, rl_by, contrast,
                read_json(ctl[0][1]) if ctl else {})


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
    interval (seeds, then entries), the per-seed values, and the paired difference to its init pooled the same
    way (`vs`: RL cell -> its init, RCTP -> SFT)."""
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
            row["vs"] = {"init": init, **{key: _pooled_diff(seeds, label, init, key, boot_seed)
                                          for key in ("correct", "pass1")}}
        out.append(row)
    return out


def paired_entries(seeds: list[Seed], label: str, other: str, key: str) -> list[list[tuple[float, float]]]:
    """Per seed, (label's, other's) per-entry `key` (correct | pass1) on the entries both evaluated, in entry-id
    order: the pairs every comparison of two models over seeds is made of."""
    out = []
    for s in seeds:
        mine, theirs = _entries(s.results[label], key), _entries(s.results[other], key)
        out.append([(mine[i], theirs[i]) for i in sorted(set(mine) & set(theirs))])
    return out


def _pooled_diff(seeds: list[Seed], label: str, other: str, key: str, boot_seed: int) -> dict | None:
    """label - other per entry (pts), paired within each seed, pooled by the two-level bootstrap."""
    per = [[100 * (a - b) for a, b in pairs] for pairs in paired_entries(seeds, label, other, key)]
    if not per or any(math.isnan(v) for p in per for v in p):
        return None
    r = two_level_bootstrap(per, seed=boot_seed)
    return {"diff": r["diff"], "ci": r["ci"], "per_seed": r["per_seed"]}


def endpoint(e: dict, seeds: list[Seed], alpha: float, power: float, boot_seed: int = 0) -> dict:
    """One declared endpoint's statistics over the seeds (`endpoints`)."""
    m, cell = e["measure"], e["cell"]
    if m == "zero_variance":
        pairs = [[(a["flat"] is not None, b["flat"] is not None)
                  for b, a in paired_groups(s.rl[cell].get("groups") or [], s.rl[e["versus"]].get("groups") or [])]
                 for s in seeds]
        return ep.zero_variance(pairs, alpha, power)
    if m in ("pass1", "greedy"):
        per = paired_entries(seeds, cell, e["versus"], "pass1" if m == "pass1" else "correct")
        if m == "greedy":
            return ep.binary_difference(per, alpha, power)
        return ep.rate_difference([[a - b for a, b in p] for p in per], alpha, power, boot_seed)
    if m == "pool_learning":
        return ep.sign_counts([s.rl[cell]["pool_learning"] for s in seeds])
    counts = []
    for s in seeds:
        probe = s.rl[cell].get("probe") or {}
        part = (probe if m == "probe" else probe.get("transfer") or {}).get("change")
        if part is None:
            raise InputError(f"endpoint {ep.name(e)}: seed {s.seed}'s run has no {m} half in its probe")
        counts.append(part)
    return ep.sign_counts(counts)


def endpoint_results(cfg: ep.EndpointsConfig, seeds: list[Seed], boot_seed: int = 0) -> list[dict]:
    """Every declared endpoint, primary first: {rank, name, spec, ...statistics}. A named cell the grid did
    not run is an InputError naming the endpoint."""
    out = []
    for rank, e in cfg.all():
        for who in (e["cell"], e.get("versus")):
            if who is not None and any(who not in s.results and who not in s.rl for s in seeds):
                raise InputError(f"endpoints: {ep.name(e)}: {who!r} is not a model of params grid")
        out.append({"rank": rank, "name": ep.name(e), "spec": e,
                    **endpoint(e, seeds, cfg.alpha, cfg.power, boot_seed)})
    return out
