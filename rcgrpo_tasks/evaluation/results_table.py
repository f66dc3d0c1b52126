"""The results table of the grid: accuracy per category with bootstrap CIs, the paper's Table 1 beside it, RL
diagnostics and how RL's reward moved (the report stage runs `build_report`). Every row names its task."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from rcgrpo_tasks.env.paper import NO_TOKEN, ROWS
from rcgrpo_tasks.env.tasks import ALL_CATEGORIES, LEGACY_TASK, paper_overall, task_of_id
from rcgrpo_tasks.ops.inputs import InputError, read_json, read_jsonl
from rcgrpo_tasks.ops.stats import bootstrap_ci, difference_ci, mean, paired_bootstrap_ci

RESULT_FILES = ("results.jsonl",)  # the evaluate stage's per-entry file


@dataclass
class EvalResult:
    label: str
    entries: list[dict]
    """Per entry: entry_id, category, correct (evaluate's `valid`, 0/1), official, partial_credit, paper_reward."""
    source: str
    task: str
    rl: dict = field(default_factory=dict)
    controllability: dict = field(default_factory=dict)
    """The controllability stage's metrics for this model (RCTP): sampled / greedy gap, zero-variance shares."""
    steps: list[dict] = field(default_factory=list)
    """The RL run's per-step rows (plots TSV) for RL rows."""
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
            "correct": float(bool(valid)),
            "official": float("nan") if official is None else float(bool(official)),
            "partial_credit": float(score.get("partial_credit", float("nan"))),
            "paper_reward": float(score.get("paper_reward", float("nan")))}


def load_eval(label: str, path: Path) -> EvalResult:
    """An evaluate output folder (or a per-entry JSONL file) -> EvalResult; clear error if malformed."""
    path = Path(path)
    reading = {}
    if path.is_dir() and (path / "metrics.json").is_file():
        reading = {k: v for k, v in read_json(path / "metrics.json").items() if k in ("margin", "token_rows")}
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
    return EvalResult(label, entries, str(path), task.pop(), reading=reading)


def summarize_row(res: EvalResult, seed: int = 0) -> dict:
    """Accuracy (%) per category and overall with 95% CIs, partial credit, paper reward, RL diagnostics."""
    cats = sorted({e["category"] for e in res.entries}, key=lambda c: (ALL_CATEGORIES + (c,)).index(c))
    out: dict = {"label": res.label, "task": res.task, "n": len(res.entries), "categories": {}}
    for cat in cats:
        vals = [e["correct"] for e in res.entries if e["category"] == cat]
        lo, hi = bootstrap_ci(vals, seed=seed)
        out["categories"][cat] = {"n": len(vals), "accuracy": 100 * mean(vals), "ci": [100 * lo, 100 * hi]}
    vals = [e["correct"] for e in res.entries]
    lo, hi = bootstrap_ci(vals, [e["category"] for e in res.entries], seed=seed)
    out["overall"] = {"accuracy": 100 * mean(vals), "ci": [100 * lo, 100 * hi]}
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
    if res.steps:
        out["rl_reward_change"] = reward_change(res.steps, seed)
    return out


def _rollout_outcomes(steps: list[dict]) -> list[list[float]] | None:
    """Each step's rollouts rebuilt from its mean reward over one generation batch: n = the batch's rollouts
    (`rollouts_generated` of the steps that generated once; a dynamic-sampling step that refilled slots
    generated more, its mean is still over one batch), successes = mean x n. Exact for a 0/1 reward (the
    default `paper_reward`); None where no step generated once or a mean is not k / n (a fractional reward
    such as partial credit)."""
    try:
        once = [float(r["rollouts_generated"]) for r in steps if float(r.get("gen_rounds") or 1) == 1]
    except (KeyError, TypeError, ValueError):
        return None
    if not once or len(set(once)) != 1 or once[0] < 1 or once[0] != int(once[0]):
        return None
    n, out = int(once[0]), []
    for r in steps:
        hits = float(r["reward"]) * n
        if abs(hits - round(hits)) > 1e-4:
            return None
        out.append([1.0] * int(round(hits)) + [0.0] * (n - int(round(hits))))
    return out


def reward_change(steps: list[dict], seed: int = 0) -> dict:
    """How RL's training reward moved: mean reward of the last third of the logged steps minus the first
    third's, with a 95% bootstrap CI and the per-step rewards. The CI resamples the ROLLOUTS of each third
    (`_rollout_outcomes`: a 5-step run has 1 step per third, whose step means alone give no interval); where
    the rollouts cannot be rebuilt, the steps of each third. Steps without a reward (NaN) are skipped; fewer
    than 2 steps: no change (None)."""
    kept = [r for r in sorted(steps, key=lambda r: r["step"])
            if r.get("reward") is not None and not math.isnan(float(r["reward"]))]
    rewards = [float(r["reward"]) for r in kept]
    k = len(rewards) // 3 or 1
    if len(rewards) < 2:
        return {"steps": len(rewards), "rewards": rewards, "first": None, "last": None, "change": None, "ci": None}
    first, last = rewards[:k], rewards[-k:]
    outcomes = _rollout_outcomes(kept)
    if outcomes is not None:
        a, b = [x for o in outcomes[-k:] for x in o], [x for o in outcomes[:k] for x in o]
        unit = "rollouts"
    else:
        a, b, unit = last, first, "steps"
    _, lo, hi = difference_ci(a, b, seed=seed)
    return {"steps": len(rewards), "rewards": rewards, "first": mean(first), "last": mean(last),
            "change": mean(last) - mean(first), "ci": [lo, hi], "steps_per_third": k, "ci_over": unit}


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
    if isinstance(ctl.get("token_rows"), dict):
        out["ctl_token_rows_ratio"] = ctl["token_rows"]["ratio"]
    return out


# ---------------------------------------------------------------- rendering


def _fmt(cell: dict | None) -> str:
    if not cell or math.isnan(cell["accuracy"]):
        return "n/a"
    lo, hi = cell["ci"]
    return f"{cell['accuracy']:.1f} [{lo:.1f}, {hi:.1f}]"


def _num(v, spec: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _gap(cell: dict | None) -> str:
    if not cell or cell["gap"] is None or math.isnan(cell["gap"]):
        return "n/a"
    lo, hi = cell["ci"]
    return f"{cell['gap']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _zero_var(cell: dict | None) -> str:
    return "n/a" if not cell else f"{_num(cell['all_high'], '.3f')} / {_num(cell['mixed'], '.3f')} (G={cell['G']})"


def _flat(r: dict) -> str:
    """The zero-std share of the groups trained on, split into flat-at-failure / flat-at-success."""
    share = _num(r.get("rl_mean_frac_zero_std"), ".3f")
    if r.get("rl_mean_frac_flat_fail") is None:
        return share
    return f"{share} ({_num(r['rl_mean_frac_flat_fail'], '.2f')} / {_num(r.get('rl_mean_frac_flat_success'), '.2f')})"


def _versus(cell: dict | None) -> str:
    if not cell or not cell["n"]:
        return "n/a"
    lo, hi = cell["ci"]
    return f"{cell['diff']:+.1f} [{lo:+.1f}, {hi:+.1f}]"


def _change(cell: dict | None) -> str:
    if not cell or cell.get("change") is None:
        return "n/a"
    lo, hi = cell["ci"]
    return f"{cell['first']:.3f} -> {cell['last']:.3f}: {cell['change']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def markdown_table(rows: list[dict]) -> str:
    cats = [c for c in ALL_CATEGORIES if any(c in r["categories"] for r in rows)]
    cats += sorted({c for r in rows for c in r["categories"]} - set(cats))
    names = dict(ROWS)
    head = (["Model", "Task", "n"] + [f"{c} acc % [95% CI]" for c in cats]
            + ["Overall acc % [95% CI]", "vs init, pts [95% CI]", "Official verdict %", "Partial credit", "Paper reward",
               "Paper Table 1 overall % (7B, GPU)", "RL reward first -> last third: change [95% CI]",
               "RL frac zero-std groups (flat at 0 / at 1)", "RL zero-std share generated",
               "RL rollouts / useful group", "RL steps skipped", "RL controllability gap",
               "Ctl gap sampled [95% CI]", "Ctl gap greedy [95% CI]", "Ctl zero-var share all-high / mixed",
               "Ctl teacher-forced margin, nat [95% CI]", "Ctl token rows / real-token distance"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [names.get(r["label"], r["label"]), r.get("task", LEGACY_TASK), str(r["n"])]
        cells += [_fmt(r["categories"].get(c)) for c in cats]
        cells += [_fmt(r["overall"]), _versus(r.get("vs_init")), _num(r["official_accuracy"], ".1f"), _num(r["partial_credit"], ".3f"),
                  _num(r["paper_reward"], ".3f"), _num(r["paper_table1_overall"]), _change(r.get("rl_reward_change")),
                  _flat(r), _num(r.get("rl_mean_frac_zero_std_generated"), ".3f"),
                  _num(r.get("rl_rollouts_per_useful_group"), ".1f"), _num(r.get("rl_total_step_skipped"), ".0f"),
                  _num(r.get("rl_mean_controllability_gap"), ".3f"),
                  _gap(r.get("ctl_gap_sampled")), _gap(r.get("ctl_gap_greedy")), _zero_var(r.get("ctl_zero_var")),
                  _gap(r.get("ctl_margin")), _num(r.get("ctl_token_rows_ratio"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    note = ("\nAccuracy: the evaluate stage's success on the held-out split (`valid`; multi_turn: the paper's "
            "binary reward under the paper protocol, the official verdict under the official one; single_turn: "
            "BFCL's AST checker); \"Official verdict\": BFCL's own checker on the same trajectories. "
            "CIs: 95% percentile bootstrap over entries. \"Paper Table 1\": the RC-GRPO paper's own numbers "
            "(Qwen2.5-7B-Instruct, GPU, BFCL v4 multi-turn, 80 held-out entries), for reference only; n/a = not "
            "reported there (every single_turn row). RL reward change: mean training reward of the last third of "
            "the steps minus the first third's, 95% bootstrap CI over the rollouts of each third (over steps where a fractional reward hides the rollouts). vs init: an RL row's overall accuracy "
            "minus its init's (SFT or RCTP) on the same entries, 95% paired bootstrap CI over entries; a no-token row: "
            "minus the same model under its high token. "
            "RL columns: means over training steps (zero-std: group reward std < 1e-6) of the groups trained on "
            "and of every group generated (dynamic sampling drops and regenerates); rollouts / useful group: "
            "rollouts generated per group trained on with reward spread (n/a: none had spread); steps skipped: "
            "steps with no such group (no update). "
            "Ctl columns (controllability stage, held-out entries): E[R|high] - E[R|low] sampled at the RL "
            "temperature and greedy, 95% paired bootstrap CI over entries; expected share of zero-variance "
            "G-groups under all-high vs i.i.d. mixed tokens from the per-entry sampled success rates; the "
            "teacher-forced margin [lp(expert|high) - lp(expert|low)] - [lp(near miss|high) - lp(near miss|low)] "
            "(0 for a model that ignores its token), 95% bootstrap CI over held-out entries; the two reward "
            "tokens' embedding rows' distance over the median distance of two real tokens.\n")
    return "\n".join(lines) + "\n" + note


def build_report(evals: list[tuple[str, Path]], rl: list[tuple[str, Path]], seed: int = 0,
                 controllability: list[tuple[str, Path]] = (), steps: dict[str, list[dict]] | None = None) -> list[dict]:
    """Summaries of every evaluated row in the paper's order; `steps`: RL per-step rows by label."""
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
        r.steps = (steps or {}).get(r.label, [])
    results.sort(key=lambda r: order.get(r.label, len(order)))
    by_label = {r.label: r for r in results}
    rows = [summarize_row(r, seed) for r in results]
    for row, res in zip(rows, results):
        init = by_label.get(compared_with(res.label))
        if init is not None:
            row["vs_init"] = versus(res, init, seed)
        grpo = by_label.get(res.label.replace("-rc_grpo", "-grpo")) if res.label.endswith("-rc_grpo") else None
        if grpo is not None:
            row["vs_grpo"] = versus(res, grpo, seed)
    return rows


def compared_with(label: str) -> str | None:
    """The row a row's `vs init` column compares with: an RL row's init (`rctp-rc_grpo` -> `rctp`), a no-token
    row's same model under its token (`rctp-rc_grpo-notoken` -> `rctp-rc_grpo`); None for an init."""
    if label.endswith(NO_TOKEN):
        return label[:-len(NO_TOKEN)]
    return label.split("-", 1)[0] if "-" in label else None


def versus(res: EvalResult, init: EvalResult, seed: int = 0) -> dict:
    """Accuracy (%) of an RL row minus its init's (`rctp-rc_grpo` vs `rctp`) on the entries both evaluated,
    with a 95% paired bootstrap CI over entries."""
    mine = {e["entry_id"]: e["correct"] for e in res.entries}
    theirs = {e["entry_id"]: e["correct"] for e in init.entries}
    common = [i for i in mine if i in theirs]
    diff, lo, hi = paired_bootstrap_ci([mine[i] for i in common], [theirs[i] for i in common], seed=seed)
    return {"init": init.label, "n": len(common), "diff": 100 * diff, "ci": [100 * lo, 100 * hi]}


def rc_versus_grpo(rows: list[dict], steps: dict[str, list[dict]], seed: int = 0) -> dict:
    """Per init that has both cells: RC-GRPO minus GRPO from the same init in (1) the zero-variance share of
    the groups generated, per step (95 % bootstrap CI of the difference of the two runs' step means: the
    steps of the two runs are independent samples), and (2) held-out accuracy (paired over entries; pts)."""
    by = {r["label"]: r for r in rows}
    out: dict = {}
    for init in ("sft", "rctp"):
        rc, grpo = f"{init}-rc_grpo", f"{init}-grpo"
        if rc not in steps or grpo not in steps:
            continue
        shares = [[float(r["frac_zero_std_generated"]) for r in steps[k]
                   if not math.isnan(float(r.get("frac_zero_std_generated", float("nan"))))] for k in (rc, grpo)]
        diff, lo, hi = difference_ci(shares[0], shares[1], seed=seed)
        cell = {"zero_std_generated": {"rc_grpo": mean(shares[0]), "grpo": mean(shares[1]), "diff": diff,
                                       "ci": [lo, hi], "steps": [len(shares[0]), len(shares[1])]}}
        if by.get(rc, {}).get("vs_grpo"):
            cell["accuracy"] = by[rc]["vs_grpo"]
        out[init] = cell
    return out


def rc_versus_grpo_markdown(contrast: dict) -> str:
    """One line per init of `rc_versus_grpo` under the table."""
    lines = []
    for init, cell in contrast.items():
        z = cell["zero_std_generated"]
        text = (f"- From {init.upper()}: zero-variance share of generated groups RC-GRPO {z['rc_grpo']:.3f} vs GRPO "
                f"{z['grpo']:.3f}, difference {z['diff']:+.3f} [{z['ci'][0]:+.3f}, {z['ci'][1]:+.3f}]")
        acc = cell.get("accuracy")
        if acc:
            text += f"; held-out accuracy RC-GRPO minus GRPO {acc['diff']:+.1f} pts [{acc['ci'][0]:+.1f}, {acc['ci'][1]:+.1f}] (n={acc['n']})"
        lines.append(text + ".")
    return ("\nRC-GRPO vs GRPO from the same init (95% bootstrap CIs; steps of the two runs as independent "
            "samples, held-out entries paired):\n" + "\n".join(lines) + "\n") if lines else ""
