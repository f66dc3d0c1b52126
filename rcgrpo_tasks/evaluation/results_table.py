"""The results of the grid as rows (the report stage runs `build_report`; `report_tables` renders them):
accuracy per category with Wilson intervals, the paper's Table 1 beside it, paired differences to the init and
between RC-GRPO and GRPO, RL diagnostics and the fixed probe's curve. Every row names its task."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from rcgrpo.stats import bootstrap_ci, mcnemar_exact, mean
from rcgrpo_tasks.env.paper import NO_TOKEN, ROWS
from rcgrpo_tasks.env.tasks import ALL_CATEGORIES, paper_overall, task_of_id
from rcgrpo_tasks.evaluation.formats import SIDES
from rcgrpo_tasks.evaluation.stats import paired_binary, paired_mean, wilson_ci
from rcgrpo_tasks.ops.inputs import InputError, read_json, read_jsonl
from rcgrpo_tasks.ops.names import RC_ALGOS, split_cell

RESULT_FILES = ("results.jsonl",)  # the evaluate stage's per-entry file


@dataclass
class EvalResult:
    label: str
    entries: list[dict]
    """Per entry: entry_id, category, correct (evaluate's greedy `valid`, 0/1), pass1 (evaluate's share of sampled
    answers that succeed; NaN where not sampled), official, partial_credit, paper_reward."""
    source: str
    task: str
    side: str
    """The side of the split the entries come from (the evaluation's `settings.side`: test | dev)."""
    rl: dict = field(default_factory=dict)
    controllability: dict = field(default_factory=dict)
    """The controllability stage's metrics for this model (RCTP): sampled / greedy gap, zero-variance shares."""
    reading: dict = field(default_factory=dict)
    """The evaluate stage's teacher-forced margin and token rows' distance (reward-conditioned rows)."""


def _category(entry_id: str, row: dict) -> str:
    cat = row.get("category")
    if cat:
        return str(cat).replace("multi_turn_", "")
    return task_of_id(entry_id).category_of(entry_id)


def _task(entry_id: str, row: dict) -> str:
    return row.get("task") or task_of_id(entry_id).name


def _normalise(row: dict, where: str) -> dict:
    """One per-entry result row -> {entry_id, category, correct, partial_credit, paper_reward}."""
    score = row.get("score") if isinstance(row.get("score"), dict) else row
    entry_id = row.get("entry_id") or row.get("id")
    valid = score.get("valid", score.get("correct"))
    if entry_id is None or valid is None:
        raise InputError(f"{where}: needs 'entry_id'/'id' and 'valid' (or score.valid); got keys {sorted(row)}")
    official = score.get("official_valid", valid)
    return {"entry_id": entry_id, "task": _task(entry_id, row), "category": _category(entry_id, row),
            "correct": float(bool(valid)), "pass1": float(row.get("pass1", float("nan"))),
            "official": float("nan") if official is None else float(bool(official)),
            "partial_credit": float(score.get("partial_credit", float("nan"))),
            "paper_reward": float(score.get("paper_reward", float("nan")))}


def eval_side(metrics: Path) -> str:
    """The side of the split an evaluation measured (its metrics' `settings.side`); an evaluation that does not
    say is an InputError: a report must name its split."""
    if not metrics.is_file():
        raise InputError(f"{metrics}: not found (the evaluate stage's metrics say which split it read)")
    side = (read_json(metrics).get("settings") or {}).get("side")
    if side not in SIDES:
        raise InputError(f"{metrics}: settings.side must be one of {sorted(SIDES)}, got {side!r} (re-run evaluate)")
    return side


def load_eval(label: str, path: Path) -> EvalResult:
    """An evaluate output folder (or its per-entry JSONL file, its metrics.json beside it) -> EvalResult; clear
    error if malformed."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    reading = {}
    if (folder / "metrics.json").is_file():
        reading = {k: v for k, v in read_json(folder / "metrics.json").items() if k in ("margin", "token_rows")}
    if path.is_dir():
        files = [path / f for f in RESULT_FILES if (path / f).is_file()]
        if not files:
            raise InputError(f"{path}: no per-entry results ({' / '.join(RESULT_FILES)}); run the evaluate stage")
        path = files[0]
    rows = read_jsonl(path)
    if not rows:
        raise InputError(f"{path}: no entries")
    entries = [_normalise(r, f"{path}:{i}") for i, r in enumerate(rows, 1)]
    task = {e["task"] for e in entries}
    if len(task) != 1:
        raise InputError(f"{path}: rows of {len(task)} tasks ({sorted(task)}); an evaluation covers one task")
    return EvalResult(label, entries, str(path), task.pop(), eval_side(folder / "metrics.json"), reading=reading)


def one_side(rows: list[dict], controllability: dict[str, str] | None = None) -> str:
    """The one side of the split every row (`summarize_row`: its `side`) and every controllability check
    (`{what: side}`) measured; a report over several sides is an InputError naming them, since a dev number
    beside a held-out one would read as the same split."""
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(r["side"], []).append(r["label"] if r.get("seed") is None else f"{r['label']}@{r['seed']}")
    for what, side in (controllability or {}).items():
        by.setdefault(side, []).append(what)
    if len(by) != 1:
        parts = "; ".join(f"{side} ({', '.join(dict.fromkeys(names))})" for side, names in sorted(by.items(), key=lambda kv: str(kv[0])))
        raise InputError(f"a report reads one side of the split; got {parts or 'no evaluation'}")
    return next(iter(by))


def _proportion(vals: list[float]) -> dict:
    """{n, successes, accuracy %, ci: 95 % Wilson interval %} of 0/1 outcomes."""
    k = int(sum(vals))
    lo, hi = wilson_ci(k, len(vals))
    return {"n": len(vals), "successes": k, "accuracy": 100 * mean(vals), "ci": [100 * lo, 100 * hi]}


def _pass1(entries: list[dict], seed: int, strata: list[str] | None = None) -> dict | None:
    """{accuracy %, ci: 95 % bootstrap over entries %} of the entries' pass@1; None where it was not sampled."""
    vals = [e["pass1"] for e in entries]
    if any(math.isnan(v) for v in vals):
        return None
    lo, hi = bootstrap_ci(vals, strata, seed=seed)
    return {"accuracy": 100 * mean(vals), "ci": [100 * lo, 100 * hi]}


def summarize_row(res: EvalResult, seed: int = 0) -> dict:
    """Greedy accuracy (%) per category and overall with 95 % Wilson intervals, pass@1 with bootstrap intervals
    over entries (overall stratified by category), partial credit, paper reward, RL diagnostics, the fixed
    probe's curve (`train.rl.probe`)."""
    cats = sorted({e["category"] for e in res.entries}, key=lambda c: (ALL_CATEGORIES + (c,)).index(c))
    out: dict = {"label": res.label, "task": res.task, "side": res.side, "n": len(res.entries), "categories": {}}
    for cat in cats:
        subset = [e for e in res.entries if e["category"] == cat]
        out["categories"][cat] = {**_proportion([e["correct"] for e in subset]), "pass1": _pass1(subset, seed)}
    out["overall"] = {**_proportion([e["correct"] for e in res.entries]),
                      "pass1": _pass1(res.entries, seed, [e["category"] for e in res.entries])}
    out["official_accuracy"] = 100 * mean([e.get("official", float("nan")) for e in res.entries])
    out["partial_credit"] = mean([e["partial_credit"] for e in res.entries])
    out["paper_reward"] = mean([e["paper_reward"] for e in res.entries])
    out["paper_table1_overall"] = paper_overall(res.task, res.label)
    for key in ("mean_frac_zero_std", "mean_frac_flat_fail", "mean_frac_flat_success", "mean_controllability_gap",
                "mean_adv_abs_mean", "steps",
                "mean_frac_zero_std_generated", "rollouts_per_useful_group", "total_step_skipped"):
        if res.rl.get(key) is not None:
            out[f"rl_{key}"] = res.rl[key]
    out.update(controllability_fields({**res.reading, **res.controllability}))
    if res.rl.get("probe"):
        out["rl_probe"] = res.rl["probe"]
    if res.rl.get("diverged"):
        out["rl_diverged"] = res.rl["diverged"]
    if res.rl.get("nonfinite_grad_steps"):
        out["rl_nonfinite_grad_steps"] = res.rl["nonfinite_grad_steps"]
    if res.rl.get("resumed_from"):
        out["rl_resumed_from"] = res.rl["resumed_from"]
    return out


def controllability_fields(ctl: dict) -> dict:
    """The report's controllability numbers from a controllability metrics JSON ({} when absent)."""
    out: dict = {}
    for arm in ("sampled", "greedy"):
        if isinstance(ctl.get(arm), dict):
            out[f"ctl_gap_{arm}"] = {"gap": ctl[arm]["gap"], "ci": ctl[arm]["gap_ci"]}
    z = ctl.get("zero_variance")
    if isinstance(z, dict):
        out["ctl_zero_var"] = {"G": z["G"], "all_high": z["all_high"], "mixed": z["mixed"]}
    m = ctl.get("margin")
    if isinstance(m, dict):
        out["ctl_margin"] = {"gap": m["margin"], "ci": m["ci"], "n": m["n_entries"],
                             "share_positive": m["share_positive"]}
        if isinstance(m.get("realistic"), dict):
            r = m["realistic"]
            out["ctl_margin_realistic"] = {"gap": r["margin"], "ci": r["ci"], "n": r["n_entries"]}
    if isinstance(ctl.get("token_rows"), dict):
        out["ctl_token_rows_ratio"] = ctl["token_rows"]["ratio"]
    return out


def build_report(evals: list[tuple[str, Path]], rl: list[tuple[str, Path]], seed: int = 0,
                 controllability: list[tuple[str, Path]] = ()) -> list[dict]:
    """Summaries of every evaluated row in the paper's order."""
    rl_by, ctl_by = {}, {}
    for label, p in rl:
        if not p.is_file():
            raise InputError(f"{p}: RL metrics not found")
        rl_by[label] = read_json(p)
    for label, p in controllability:
        if not p.is_file():
            raise InputError(f"{p}: controllability metrics not found (run `dvc repro controllability`)")
        ctl_by[label] = read_json(p)
    order = {label: i for i, (label, _) in enumerate(ROWS)}
    results = [load_eval(label, p) for label, p in evals]
    for r in results:
        r.rl = rl_by.get(r.label, {})
        r.controllability = ctl_by.get(r.label, {})
    results.sort(key=lambda r: order.get(r.label, len(order)))
    by_label = {r.label: r for r in results}
    rows = [summarize_row(r, seed) for r in results]
    for row, res in zip(rows, results):
        init = by_label.get(compared_with(res.label))
        if init is not None:
            row["vs_init"] = versus(res, init, seed)
        cell = split_cell(res.label)
        grpo = by_label.get(f"{cell[0]}-grpo") if cell and cell[1] in RC_ALGOS else None
        if grpo is not None:
            row["vs_grpo"] = versus(res, grpo, seed)
    return rows


def compared_with(label: str) -> str | None:
    """The row a row's `vs init` column compares with: an RL row's init (`rctp-rc_grpo` -> `rctp`), a no-token
    row's same model under its token (`rctp-rc_grpo-notoken` -> `rctp-rc_grpo`), RCTP (under its high token)
    the SFT baseline (does the token cost accuracy?); None for base and SFT."""
    if label.endswith(NO_TOKEN):
        return label[:-len(NO_TOKEN)]
    if label == "rctp":
        return "sft"
    return label.split("-", 1)[0] if "-" in label else None


def versus(res: EvalResult, init: EvalResult, seed: int = 0) -> dict:
    """Greedy accuracy (%) of a row minus the row it is compared with (`rctp-rc_grpo` vs `rctp`) on the entries
    both evaluated: the entries each got right alone (`up`, `down`), the exact McNemar p and Tango's 95 %
    interval (`evaluation.stats.paired_binary`: never a point where 0-2 entries differ); and the same difference in
    pass@1 (`pass1`; the paired t over entries, its interval and p, `evaluation.stats.paired_mean`; None where either
    row was not sampled)."""
    mine = {e["entry_id"]: e for e in res.entries}
    theirs = {e["entry_id"]: e for e in init.entries}
    common = [i for i in mine if i in theirs]
    greedy = paired_binary([mine[i]["correct"] for i in common], [theirs[i]["correct"] for i in common])
    a, b = [mine[i]["pass1"] for i in common], [theirs[i]["pass1"] for i in common]
    pass1 = None
    if common and not any(math.isnan(v) for v in a + b):
        r = paired_mean([x - y for x, y in zip(a, b)])
        pass1 = {"diff": 100 * r["diff"], "ci": [100 * x for x in r["ci"]], "p": r["p"]}
    return {"init": init.label, "n": len(common), "diff": 100 * greedy["diff"], "ci": [100 * x for x in greedy["ci"]],
            "p": greedy["p"], "pass1": pass1, "up": greedy["only_first"], "down": greedy["only_second"]}


def paired_groups(first: list[dict], second: list[dict]) -> list[tuple[dict, dict]]:
    """(second's group, first's group) of two runs from one init, paired by step and slot (the same entry and
    seeds in both: `rollout.EngineRollout.group_specs`); pairs whose entries differ are left out."""
    mine = {(g["step"], g["group"]): g for g in first}
    return [(g, mine[(g["step"], g["group"])]) for g in second
            if (g["step"], g["group"]) in mine and mine[(g["step"], g["group"])]["entry_id"] == g["entry_id"]]


def rc_versus_grpo(rows: list[dict], groups: dict[str, list[dict]]) -> dict:
    """Per RC-family cell (`ops.names.RC_ALGOS`: RC-GRPO and its ablations) whose init also ran GRPO, keyed by the
    cell: against that GRPO, (1) zero-variance groups paired group by group (the same step and slot draw the
    same entry and seeds in both runs; pairs whose entries differ are left out): both flat, only GRPO flat,
    only the cell flat, the two shares, flat at 0 / at 1 in each, and the exact McNemar p of the discordant
    pairs; (2) held-out accuracy (paired over entries; pts). `groups`: `diagnostics.group_flags` rows by label."""
    by = {r["label"]: r for r in rows}
    out: dict = {}
    for label in groups:
        cell = split_cell(label)
        grpo = f"{cell[0]}-grpo" if cell and cell[1] in RC_ALGOS else None
        if grpo is None or not groups.get(label) or not groups.get(grpo):
            continue
        pairs = paired_groups(groups[label], groups[grpo])
        only_grpo = sum(a["flat"] is not None and b["flat"] is None for a, b in pairs)
        only_cell = sum(a["flat"] is None and b["flat"] is not None for a, b in pairs)
        both = sum(a["flat"] is not None and b["flat"] is not None for a, b in pairs)
        n = len(pairs)
        entry = {"versus": grpo, "zero_std_paired": {
            "groups": n, "both": both, "only_grpo": only_grpo, "only_cell": only_cell,
            "grpo": (both + only_grpo) / n if n else float("nan"), "cell": (both + only_cell) / n if n else float("nan"),
            "grpo_flat": {f: sum(a["flat"] == f for a, _ in pairs) for f in ("fail", "success")},
            "cell_flat": {f: sum(b["flat"] == f for _, b in pairs) for f in ("fail", "success")},
            "mcnemar_p": mcnemar_exact(only_grpo, only_cell)}}
        if by.get(label, {}).get("vs_grpo"):
            entry["accuracy"] = by[label]["vs_grpo"]
        out[label] = entry
    return out
