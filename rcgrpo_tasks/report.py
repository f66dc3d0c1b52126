"""Stage `report`: the paper's comparison table from the evaluate stages, with bootstrap CIs and a plot.

Reads one evaluation per model (`--eval LABEL=DIR`, the `evaluate` stage's output folder: its
`metrics.json` and per-entry results JSONL) and, optionally, the RL runs' summaries
(`--rl LABEL=results/rl/<run>/metrics.json`). Rows, in the paper's order: base, SFT, RCTP, SFT+GRPO,
SFT+RC-GRPO, RCTP+GRPO, RCTP+RC-GRPO (any subset; unknown labels are appended).

Per row: accuracy (the evaluate stage's `valid`: paper reward under the paper protocol, which is the
paper's Table 1 view; the official verdict under the official protocol) per category and overall, each
with a 95% percentile-bootstrap CI over entries (2000 resamples, fixed seed; overall resamples within
each category, so the category mix stays fixed); the official BFCL verdict, mean partial credit and
paper reward; for RL rows the training diagnostics (mean fraction of zero-std groups, mean
controllability gap E[R|high] - E[R|low]); beside them the paper's Table 1 overall accuracy
(Qwen2.5-7B-Instruct on GPU, 80 held-out entries) where the paper gives it, else `n/a`. The paper's
numbers are a reference for the shape of the result, not a target for a 135M CPU model.

Writes: `--table` (Markdown), `--json` (DVC metrics: every number above), `--plot` (PNG: accuracy per
category per row with CI bars), and logs all three + metrics to MLflow.
Run: `rcgrpo report --eval base=results/eval/base --eval rctp-rc_grpo=results/eval/rctp-rc_grpo ...
--table results/report/table.md --json results/report/report.json --plot results/report/accuracy.png`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import typer

from rcgrpo_tasks.io import InputError, read_jsonl, write_json, write_text

ROWS: tuple[tuple[str, str], ...] = (
    ("base", "Base"), ("sft", "SFT"), ("rctp", "RCTP"), ("sft-grpo", "SFT+GRPO"),
    ("sft-rc_grpo", "SFT+RC-GRPO"), ("rctp-grpo", "RCTP+GRPO"), ("rctp-rc_grpo", "RCTP+RC-GRPO"),
)
# RC-GRPO paper (arXiv 2602.03025), Table 1, Qwen2.5-7B-Instruct, BFCL v4 multi-turn, 80 held-out entries,
# overall accuracy (%). Only the cells the paper reports; everything else is n/a.
PAPER_TABLE1_OVERALL: dict[str, float] = {"base": 11.25, "sft-grpo": 48.75, "rctp-grpo": 73.75,
                                          "rctp-rc_grpo": 85.00}
CATEGORY_ORDER = ("base", "miss_func", "miss_param", "long_context")
N_BOOT = 2000
RESULT_FILES = ("results.jsonl",)  # the evaluate stage's per-entry file


@dataclass
class EvalResult:
    label: str
    entries: list[dict]
    """Per entry: entry_id, category, correct (evaluate's `valid`, 0/1), official, partial_credit, paper_reward."""
    source: str
    rl: dict = field(default_factory=dict)


def _category(entry_id: str, row: dict) -> str:
    cat = row.get("category")
    if cat:
        return str(cat).replace("multi_turn_", "")
    from rcgrpo_tasks.bfcl import category_of

    return category_of(entry_id).replace("multi_turn_", "")


def _normalise(row: dict, where: str) -> dict:
    """One per-entry result row -> {entry_id, category, correct, partial_credit, paper_reward}."""
    score = row.get("score") if isinstance(row.get("score"), dict) else row
    entry_id = row.get("entry_id") or row.get("id")
    valid = score.get("valid", score.get("correct"))
    if entry_id is None or valid is None:
        raise InputError(f"{where}: needs 'entry_id'/'id' and 'valid' (or score.valid); got keys {sorted(row)}")
    official = score.get("official_valid", valid)
    return {"entry_id": entry_id, "category": _category(entry_id, row), "correct": float(bool(valid)),
            "official": float("nan") if official is None else float(bool(official)),
            "partial_credit": float(score.get("partial_credit", float("nan"))),
            "paper_reward": float(score.get("paper_reward", float("nan")))}


def load_eval(label: str, path: Path) -> EvalResult:
    """An evaluate output folder (or a per-entry JSONL file) -> EvalResult; clear error if malformed."""
    path = Path(path)
    if path.is_dir():
        files = [path / f for f in RESULT_FILES if (path / f).is_file()]
        if not files:
            raise InputError(f"{path}: no per-entry results ({' / '.join(RESULT_FILES)}); run the evaluate stage")
        path = files[0]
    rows = read_jsonl(path)
    if not rows:
        raise InputError(f"{path}: no entries")
    entries = [_normalise(r, f"{path}:{i}") for i, r in enumerate(rows, 1)]
    return EvalResult(label, entries, str(path))


# ---------------------------------------------------------------- statistics


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
    means.sort()
    lo = means[int(math.floor((1 - level) / 2 * n_boot))]
    hi = means[min(n_boot - 1, int(math.ceil((1 + level) / 2 * n_boot)) - 1)]
    return (lo, hi)


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize_row(res: EvalResult, seed: int = 0) -> dict:
    """Accuracy (%) per category and overall with 95% CIs, partial credit, paper reward, RL diagnostics."""
    cats = sorted({e["category"] for e in res.entries}, key=lambda c: (CATEGORY_ORDER + (c,)).index(c))
    out: dict = {"label": res.label, "n": len(res.entries), "categories": {}}
    for cat in cats:
        vals = [e["correct"] for e in res.entries if e["category"] == cat]
        lo, hi = bootstrap_ci(vals, seed=seed)
        out["categories"][cat] = {"n": len(vals), "accuracy": 100 * _mean(vals), "ci": [100 * lo, 100 * hi]}
    vals = [e["correct"] for e in res.entries]
    lo, hi = bootstrap_ci(vals, [e["category"] for e in res.entries], seed=seed)
    out["overall"] = {"accuracy": 100 * _mean(vals), "ci": [100 * lo, 100 * hi]}
    out["official_accuracy"] = 100 * _mean([e.get("official", float("nan")) for e in res.entries])
    out["partial_credit"] = _mean([e["partial_credit"] for e in res.entries])
    out["paper_reward"] = _mean([e["paper_reward"] for e in res.entries])
    out["paper_table1_overall"] = PAPER_TABLE1_OVERALL.get(res.label)
    for key in ("mean_frac_zero_std", "mean_controllability_gap", "mean_adv_abs_mean", "steps"):
        if res.rl.get(key) is not None:
            out[f"rl_{key}"] = res.rl[key]
    return out


# ---------------------------------------------------------------- rendering


def _fmt(cell: dict | None) -> str:
    if not cell or math.isnan(cell["accuracy"]):
        return "n/a"
    lo, hi = cell["ci"]
    return f"{cell['accuracy']:.1f} [{lo:.1f}, {hi:.1f}]"


def _num(v, spec: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown_table(rows: list[dict]) -> str:
    cats = [c for c in CATEGORY_ORDER if any(c in r["categories"] for r in rows)]
    cats += sorted({c for r in rows for c in r["categories"]} - set(cats))
    names = dict(ROWS)
    head = (["Model", "n"] + [f"{c} acc % [95% CI]" for c in cats]
            + ["Overall acc % [95% CI]", "Official verdict %", "Partial credit", "Paper reward",
               "Paper Table 1 overall % (7B, GPU)", "RL frac zero-std groups", "RL controllability gap"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [names.get(r["label"], r["label"]), str(r["n"])] + [_fmt(r["categories"].get(c)) for c in cats]
        cells += [_fmt(r["overall"]), _num(r["official_accuracy"], ".1f"), _num(r["partial_credit"], ".3f"),
                  _num(r["paper_reward"], ".3f"), _num(r["paper_table1_overall"]),
                  _num(r.get("rl_mean_frac_zero_std"), ".3f"), _num(r.get("rl_mean_controllability_gap"), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    note = ("\nAccuracy: the evaluate stage's success (`valid`: the paper's binary reward under the paper protocol, "
            "the official verdict under the official one) on the held-out split; \"Official verdict\": BFCL's "
            "per-turn checker on the same trajectories. "
            "CIs: 95% percentile bootstrap over entries. \"Paper Table 1\": the RC-GRPO paper's own numbers "
            "(Qwen2.5-7B-Instruct, GPU, 80 held-out entries), for reference only; n/a = not reported there. "
            "RL columns: means over training steps (zero-std: group reward std < 1e-6).\n")
    return "\n".join(lines) + "\n" + note


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [c for c in CATEGORY_ORDER if any(c in r["categories"] for r in rows)] + ["overall"]
    names = dict(ROWS)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cats) * max(1, len(rows)) / 3), 4.5))
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        cells = [r["categories"].get(c) if c != "overall" else r["overall"] for c in cats]
        ys = [c["accuracy"] if c else 0.0 for c in cells]
        err = [[max(0.0, y - c["ci"][0]) if c else 0 for y, c in zip(ys, cells)],
               [max(0.0, c["ci"][1] - y) if c else 0 for y, c in zip(ys, cells)]]
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, ys, width, yerr=err, capsize=2, label=names.get(r["label"], r["label"]))
        paper = r.get("paper_table1_overall")
        if paper is not None:
            ax.scatter([xs[-1]], [paper], marker="*", color="black", zorder=3, s=40)
    ax.scatter([], [], marker="*", color="black", label="paper Table 1 (7B, GPU)")
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("accuracy % (95% bootstrap CI)")
    ax.set_ylim(0, 100)
    ax.set_title("BFCL v4 multi-turn, held-out split")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def _pairs(items: list[str], what: str) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        label, sep, p = item.partition("=")
        if not sep or not label or not p:
            raise typer.BadParameter(f"{what} expects LABEL=PATH, got {item!r}")
        out.append((label, Path(p)))
    return out


def build_report(evals: list[tuple[str, Path]], rl: list[tuple[str, Path]], seed: int = 0) -> list[dict]:
    rl_by = {}
    for label, p in rl:
        if not p.is_file():
            raise InputError(f"{p}: RL metrics not found")
        rl_by[label] = json.loads(p.read_text())
    order = {label: i for i, (label, _) in enumerate(ROWS)}
    results = [load_eval(label, p) for label, p in evals]
    for r in results:
        r.rl = rl_by.get(r.label, {})
    results.sort(key=lambda r: order.get(r.label, len(order)))
    return [summarize_row(r, seed) for r in results]


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    eval_: list[str] = typer.Option(..., "--eval", help="LABEL=DIR of an evaluate output (repeat)."),
    rl: list[str] = typer.Option([], "--rl", help="LABEL=metrics.json of an RL run (repeat)."),
    table: Path = typer.Option(Path("results/report/table.md"), help="Output: Markdown table."),
    json_out: Path = typer.Option(Path("results/report/report.json"), "--json", help="Output: metrics JSON."),
    plot_out: Path = typer.Option(Path("results/report/accuracy.png"), "--plot", help="Output: PNG plot."),
    seed: int = typer.Option(0, help="Bootstrap seed."),
    track: bool = typer.Option(True, help="Log to MLflow."),
) -> None:
    """Assemble the results table (with CIs and the paper's numbers) and plot."""
    try:
        rows = build_report(_pairs(eval_, "--eval"), _pairs(rl, "--rl"), seed)
    except InputError as exc:
        typer.echo(f"report: {exc}", err=True)
        raise typer.Exit(2) from exc
    md = markdown_table(rows)
    write_text(table, md)
    write_json(json_out, {"rows": {r["label"]: r for r in rows}, "paper_table1_overall": PAPER_TABLE1_OVERALL})
    plot(rows, plot_out)
    typer.echo(md)
    if track:
        from rcgrpo_tasks import tracking

        with tracking.stage_run("report", {"eval": eval_, "rl": rl, "seed": seed}):
            metrics = {}
            for r in rows:
                metrics[f"{r['label']}/overall_acc"] = r["overall"]["accuracy"]
                for cat, c in r["categories"].items():
                    metrics[f"{r['label']}/{cat}_acc"] = c["accuracy"]
            tracking.log_metrics({k: v for k, v in metrics.items() if not math.isnan(v)})
            tracking.log_table([{"model": dict(ROWS).get(r["label"], r["label"]), "n": r["n"],
                                 "overall_acc": r["overall"]["accuracy"], "ci_lo": r["overall"]["ci"][0],
                                 "ci_hi": r["overall"]["ci"][1], "paper_table1": r["paper_table1_overall"]}
                                for r in rows], "report_table")
            for p in (table, json_out, plot_out):
                tracking.log_artifact(p)


if __name__ == "__main__":
    app()
