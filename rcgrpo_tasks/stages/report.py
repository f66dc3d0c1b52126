"""Stage `report`: the paper's comparison table from the evaluate stages, with bootstrap CIs and a plot.

Reads one evaluation per model (`--eval LABEL=DIR`, the `evaluate` stage's output folder: its
`metrics.json` and per-entry results JSONL) and, optionally, the RL runs' summaries
(`--rl LABEL=results/rl/<run>/metrics.json`); without `--eval`, every model and RL cell params `grid` names
(`evaluation.grid`: what dvc.yaml runs), from `--eval-root` and `--rl-root`. Rows, in the paper's order: base, SFT, RCTP, SFT+GRPO,
SFT+RC-GRPO, RCTP+GRPO, RCTP+RC-GRPO (any subset; unknown labels are appended).

Per row: greedy accuracy (the evaluate stage's `valid`: paper reward under the paper protocol, which is the
paper's Table 1 view; the official verdict under the official protocol) per category and overall, each
with its 95% Wilson interval, and pass@1 (evaluate's sampled answers) with its bootstrap interval; the official BFCL verdict, mean partial credit and paper reward; for RL rows
the fixed probe's curve (`train.rl.probe`) and the training diagnostics (zero-std groups, paired group by
group between RC-GRPO and GRPO from one init); beside them the paper's Table 1 overall accuracy
(Qwen2.5-7B-Instruct on GPU, 80 held-out entries) where the paper gives it, else `n/a`. With `--controllability
LABEL=metrics/controllability.json` (the controllability stage, run on RCTP) the row also gets the token gap
E[R|high] - E[R|low] sampled at the RL temperature and greedy, each with its 95% paired bootstrap CI, and the
expected zero-variance share of G-sized groups under all-high vs mixed tokens. The paper's
numbers are a reference for the shape of the result, not a target for a 135M CPU model.

Stages that measure the same thing must agree: with `--agree LABEL=TRAJECTORIES` (evaluate@rctp beside the
controllability stage's greedy arm) the two greedy answers are compared entry by entry
(`evaluation.agreement`) and a disagreement fails the stage, naming the entries, before anything is written.

Writes: `--table` (Markdown: three tables, `evaluation.report_tables`), `--json` (DVC metrics: every number
above), `--plot` (PNG: accuracy per row with its interval), `--probe` (PNG: the probe curves of the six
cells), `--mechanism` (PNG: per-step diagnostics), and logs them + metrics to MLflow.
Run: `rcgrpo report --eval base=results/eval/base --eval rctp-rc_grpo=results/eval/rctp-rc_grpo ...
--table results/report/table.md --json results/report/report.json --plot results/report/accuracy.png`.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from rcgrpo_tasks.env.paper import PAPER_TABLE1_OVERALL, ROWS, row_name
from rcgrpo_tasks.evaluation.agreement import cross_check
from rcgrpo_tasks.evaluation.grid import GridConfig
from rcgrpo_tasks.evaluation.mechanism import plot_mechanism
from rcgrpo_tasks.evaluation.report_tables import report_markdown
from rcgrpo_tasks.evaluation.results_table import build_report, rc_versus_grpo
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import load_config
from rcgrpo_tasks.ops.inputs import InputError, read_json
from rcgrpo_tasks.ops.outputs import write_json, write_text
from rcgrpo_tasks.ops.plots import accuracy_plot, probe_plot


def _pairs(items: list[str], what: str) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        label, sep, p = item.partition("=")
        if not sep or not label or not p:
            raise InputError(f"{what} expects LABEL=PATH, got {item!r}")
        out.append((label, Path(p)))
    return out


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    eval_: list[str] = typer.Option([], "--eval", help="LABEL=DIR of an evaluate output (repeat); none: every "
                                    "evaluation and RL cell of params `grid` (EVAL_ROOT/LABEL, RL_ROOT/CELL)."),
    rl: list[str] = typer.Option([], "--rl", help="LABEL=metrics.json of an RL run (repeat)."),
    params: Path = typer.Option(Path("params.yaml"), help="Params file (section `grid`, without --eval)."),
    eval_root: Path = typer.Option(Path("results/eval"), help="Evaluate outputs: EVAL_ROOT/LABEL (without --eval)."),
    rl_root: Path = typer.Option(Path("results/rl"), help="RL runs: RL_ROOT/CELL/metrics.json and steps.tsv "
                                 "(without --eval)."),
    controllability: list[str] = typer.Option([], "--controllability",
                                              help="LABEL=metrics/controllability.json of a model (repeat)."),
    agree: list[str] = typer.Option([], "--agree", help="LABEL=TRAJECTORIES: the evaluation LABEL's greedy answers "
                                    "must be another stage's greedy-arm answers under its token (repeat)."),
    table: Path = typer.Option(Path("results/report/table.md"), help="Output: Markdown table."),
    json_out: Path = typer.Option(Path("results/report/report.json"), "--json", help="Output: metrics JSON."),
    plot_out: Path = typer.Option(Path("results/report/accuracy.png"), "--plot", help="Output: PNG plot."),
    steps: list[str] = typer.Option([], "--steps", help="LABEL=plots/rl_<run>.tsv: per-step RL diagnostics (repeat)."),
    mechanism: Path | None = typer.Option(None, help="Output: PNG of the per-step mechanism, GRPO beside RC-GRPO."),
    probe: Path | None = typer.Option(None, help="Output: PNG of the RL cells' fixed-probe curves."),
    seed: int = typer.Option(0, help="Bootstrap seed."),
    track: bool = typer.Option(True, help="Log to MLflow."),
) -> None:
    """Assemble the results table (with CIs and the paper's numbers) and plot."""
    with cli_errors():
        if not eval_:  # what params `grid` runs: the report cannot list other models than the pipeline's
            grid = load_config(GridConfig, params, "grid")
            eval_ = [f"{label}={eval_root / label}" for label in grid.labels]
            rl = [f"{cell}={rl_root / cell / 'metrics.json'}" for cell in grid.cells]
            steps = [f"{cell}={rl_root / cell / 'steps.tsv'}" for cell in grid.cells]
        step_files = dict(_pairs(steps, "--steps"))
        missing = [str(p) for p in step_files.values() if not p.is_file()]
        if missing:
            raise InputError(f"--steps: not found: {missing} (run `dvc repro rl`)")
        rows = build_report(_pairs(eval_, "--eval"), _pairs(rl, "--rl"), seed,
                            _pairs(controllability, "--controllability"))
        dirs = dict(_pairs(eval_, "--eval"))
        checks = []
        for label, other in _pairs(agree, "--agree"):
            if label not in dirs:
                raise InputError(f"--agree {label}: no --eval {label}=DIR to compare")
            checks.append({"label": label, **cross_check(dirs[label], other)})
        if mechanism is not None and not step_files:
            raise InputError("--mechanism needs the runs' per-step TSVs (--steps LABEL=TSV)")
    task = " / ".join(sorted({r["task"] for r in rows}))
    contrast = rc_versus_grpo(rows, {label: read_json(p).get("groups") or [] for label, p in _pairs(rl, "--rl")})
    md = report_markdown(rows, contrast, checks)
    outputs = (table, json_out, plot_out, mechanism, probe)
    with tracking.published_run("report", {"eval": eval_, "rl": rl, "seed": seed}, outputs=outputs,
                                track=track) as (_, staged):
        files = [staged.file(table), staged.file(json_out), staged.file(plot_out)]
        write_text(files[0], md)
        write_json(files[1], {"rows": {r["label"]: r for r in rows}, "rc_grpo_vs_grpo": contrast,
                              "stage_agreement": checks, "paper_table1_overall": PAPER_TABLE1_OVERALL})
        accuracy_plot(rows, files[2], dict(ROWS), title=f"BFCL v4 {task}, held-out split")
        if mechanism is not None:
            files.append(staged.file(mechanism))
            plot_mechanism(step_files, files[-1], title=f"RC-GRPO mechanism per step (BFCL v4 {task})")
        if probe is not None:
            files.append(staged.file(probe))
            probe_plot(rows, files[-1], dict(ROWS), title=f"RL on BFCL v4 {task}: the fixed probe's reward")
        if track:
            _log(rows, files)
    typer.echo(md)


def _log(rows: list[dict], files: list[Path]) -> None:
    metrics = {}
    for r in rows:
        metrics[f"{r['label']}/overall_acc"] = r["overall"]["accuracy"]
        for cat, c in r["categories"].items():
            metrics[f"{r['label']}/{cat}_acc"] = c["accuracy"]
        change = (r.get("rl_probe") or {}).get("change") or {}
        if change.get("mean") is not None:
            metrics[f"{r['label']}/rl_probe_change"] = change["mean"]
    tracking.log_metrics({k: v for k, v in metrics.items() if not math.isnan(v)})
    tracking.log_table([{"model": row_name(r["label"]), "task": r["task"], "n": r["n"],
                         "overall_acc": r["overall"]["accuracy"], "ci_lo": r["overall"]["ci"][0],
                         "ci_hi": r["overall"]["ci"][1], "paper_table1": r["paper_table1_overall"]}
                        for r in rows], "report_table")
    tracking.log_files(files, "report")

if __name__ == "__main__":
    app()
