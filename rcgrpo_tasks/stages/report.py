"""Stage `report`: what params `grid` ran, per seed and pooled over seeds, with the declared endpoints first.

Reads params `grid` (seeds, RL cells, models evaluated once) and `endpoints` (declared before the run), and the
grid's outputs under the roots dvc.yaml names: `--eval-root` (LABEL/ for the models evaluated once,
SEED/LABEL/ for each seed's RCTP model and RL cells: the evaluate stages' folders), `--rl-root`
(SEED/CELL/metrics.json and steps.tsv), `--controllability-root` (SEED.json: the controllability stage on each
seed's RCTP model) and `--agree-root` (SEED/trajectories.jsonl: its greedy arm).

The Markdown (`evaluation.seeded_tables`), in the order a reviewer reads it:
1. RCTP's premise gate per seed (q and the sampled gap): a missed gate is said first;
2. the endpoints (`evaluation.endpoints`): estimate, interval, test, p and minimum detectable effect, and how
   many comparisons are reported;
3. the seeded models pooled over seeds (two-level bootstrap intervals: seeds, then entries) beside their
   per-seed values and the paired difference to their init;
4. learning where RL trains, per seed and cell: the pool, first vs last visit of its prompts, the probe's pool
   half and its half outside the pool;
5. each seed's own tables (`evaluation.report_tables`: greedy accuracy with Wilson intervals, pass@1, paired
   differences, per category, RL diagnostics, the paper's Table 1 beside it).
Every evaluation and controllability check read must be on one side of the split (their `settings.side` /
`side`): it names the report's split in its notes, headings and plot titles; a mix fails the stage, naming
the sides and who measured each, before anything is written. Stages that measure the same thing must agree: per seed, evaluate_rctp's greedy answers and the controllability
stage's greedy arm are compared entry by entry (`evaluation.agreement`); a disagreement fails the stage, naming
the entries, before anything is written.
6. what the injected variance is made of (`evaluation.mechanism_tables`: per RC-family cell against GRPO,
   groups rescued at success / at failure and created, high-token rollouts with a learning signal, every
   cell's rollouts per token by failure kind) and RCTP's premise before RL beside each RL policy's after it
   (`controllability_rl_rctp` stages), with the token gap on RL's pool by thirds of training.
Writes: `--table` (Markdown), `--json` (DVC metrics: every number above), `--plot` (PNG: accuracy per row),
`--probe` (PNG: the probe curves), `--mechanism` (PNG: per-step diagnostics), `--endpoints` (a folder: the
per-unit values behind every endpoint, which `rcgrpo endpoints --recompute` turns back into the table), and
logs them to MLflow.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

from rcgrpo_tasks.env.paper import PAPER_TABLE1_OVERALL, row_name
from rcgrpo_tasks.evaluation import mechanism_tables
from rcgrpo_tasks.evaluation.agreement import cross_check
from rcgrpo_tasks.evaluation.endpoints import EndpointsConfig, write_files
from rcgrpo_tasks.evaluation.formats import ci, split_title
from rcgrpo_tasks.evaluation.grid import GridConfig
from rcgrpo_tasks.evaluation.mechanism import plot_mechanism
from rcgrpo_tasks.evaluation.plots import accuracy_plot, probe_plot
from rcgrpo_tasks.evaluation.report_tables import report_markdown
from rcgrpo_tasks.evaluation.results_table import build_report, one_side, rc_versus_grpo
from rcgrpo_tasks.evaluation.seeded import Roots, endpoint_results, load_seed, pooled_rows, premise
from rcgrpo_tasks.evaluation.seeded_tables import seeded_markdown
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import load_config
from rcgrpo_tasks.ops.inputs import InputError, read_json, read_tsv
from rcgrpo_tasks.ops.outputs import write_json, write_text

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


def _pairs(items: list[str], what: str) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        label, sep, p = item.partition("=")
        if not sep or not label or not p:
            raise InputError(f"{what} expects LABEL=PATH, got {item!r}")
        out.append((label, Path(p)))
    return out


def grid_report(params: Path, eval_root: Path, rl_root: Path, ctl_root: Path | None, agree_root: Path | None,
                seed: int) -> tuple[str, dict, list[dict], dict[str, Path]]:
    """(Markdown, JSON, plot rows, per-step TSVs) of what params `grid` ran, over its seeds; the JSON's
    `endpoint_files` holds what `endpoints.write_files` commits (each endpoint's per-unit values)."""
    grid = load_config(GridConfig, params, "grid")
    declared = load_config(EndpointsConfig, params, "endpoints")
    seeds = [load_seed(grid, Roots(eval_root, rl_root, ctl_root), s, seed) for s in grid.seeds]
    steps = {f"{cell}@{s}": rl_root / str(s) / cell / "steps.tsv" for s in grid.seeds for cell in grid.cells}
    missing = [str(p) for p in steps.values() if not p.is_file()]
    if missing:
        raise InputError(f"not found: {missing} (run `dvc repro`: the grid's rl stages)")
    side = one_side([r for s in seeds for r in s.rows])
    premise_side = premise_side_of(seeds, side)
    checks = {}
    if agree_root is not None and premise_side == side:  # the two stages decoded the same entries
        for s in grid.seeds:
            checks[s] = [{"label": "rctp", **cross_check(eval_root / str(s) / "rctp",
                                                         agree_root / str(s) / "trajectories.jsonl")}]
    results = endpoint_results(declared, seeds)
    gates, pooled = premise(seeds), pooled_rows(seeds, grid.seeded_labels, seed)
    step_rows = {key: read_tsv(path) for key, path in steps.items()}
    mech = {"parts": mechanism_tables.parts(seeds, grid.cells), "failures": mechanism_tables.failures(seeds, grid.cells),
            "premise": mechanism_tables.premise(seeds, step_rows)}
    md = seeded_markdown(gates, results, pooled, seeds, declared, checks, side,
                         mechanism_tables.mechanism_markdown(mech, premise_side), premise_side)
    md += paper_beside(seeds[0].rows, pooled, results)
    data = {"side": side, "premise_side": premise_side, "premise": gates, "endpoints": [{k: v for k, v in r.items() if k != "data"} for r in results],
            "endpoint_files": {"results": results, "alpha": declared.alpha, "power": declared.power,
                               "seeds": len(seeds), "declared": declared},
            "mechanism": mech, "pooled": pooled,
            "seeds": {str(s.seed): {"rows": {r["label"]: r for r in s.rows}, "rc_grpo_vs_grpo": s.contrast}
                      for s in seeds},
            "stage_agreement": {str(k): v for k, v in checks.items()}}
    rows = [{**r, "label": r["label"] if r.get("seed") is None else f"{r['label']}@{r['seed']}"}
            for i, s in enumerate(seeds) for r in s.rows if i == 0 or r.get("seed") is not None]
    return md, data, rows, steps


def premise_side_of(seeds: list, side: str) -> str:
    """The one side of the split every controllability check of the grid read (before and after RL): the
    outcome's `side` where none ran. The premise may be read on another side than the outcome (dev or RL's
    own prompts: what RL acts on, not what is reported); all the checks read one (`one_side`)."""
    sides = {f"controllability@{s.seed}": s.controllability.get("side") for s in seeds if s.controllability}
    sides |= {f"controllability_rl_{cell}@{s.seed}": m.get("side") for s in seeds
              for cell, m in s.controllability_rl.items()}
    return one_side([], sides) if sides else side


def paper_beside(rows: list[dict], pooled: list[dict], endpoints: list[dict]) -> str:
    """The paper's Table 1 (`env.paper.PAPER_TABLE1_OVERALL`: Qwen2.5-7B-Instruct, BFCL v4 multi-turn, its 80
    test entries, one run, no interval) beside this run's greedy accuracy (its reading) for the rows the
    paper reports, and its RCTP+RC-GRPO - RCTP+GRPO beside this run's endpoints of that contrast. A reference
    for the shape of the result: the task, model and budgets differ (the header says which task ran)."""
    greedy = {r["label"]: r["overall"]["accuracy"] * 100 for r in rows if r.get("seed") is None}
    greedy.update({r["label"]: r["correct"]["mean"] for r in pooled})
    task = " / ".join(sorted({r["task"] for r in rows}))
    lines = ["", "## The paper beside", "",
             f"arXiv 2602.03025 Table 1 (Qwen2.5-7B-Instruct, BFCL v4 multi-turn, its 80 test entries, one run, "
             f"no interval) beside this run's greedy accuracy (BFCL v4 {task}; seeded models pooled over seeds): "
             "a reference for the shape, not a target.", "",
             "| model | paper Table 1 % | this run, greedy % |", "|---|---|---|"]
    for label, paper in PAPER_TABLE1_OVERALL.items():
        ours = f"{greedy[label]:.1f}" if label in greedy else "not run"
        lines.append(f"| {row_name(label)} | {paper:.2f} | {ours} |")
    contrast = PAPER_TABLE1_OVERALL["rctp-rc_grpo"] - PAPER_TABLE1_OVERALL["rctp-grpo"]
    ours = [f"{e['spec']['measure']} {ci(e['diff'] * 100, [x * 100 for x in e['ci']], '+.1f')} ({beside(contrast, e['ci'])})"
            for e in endpoints if e["spec"]["measure"] in ("greedy", "pass1")
            and (e["spec"]["cell"], e["spec"]["versus"]) == ("rctp-rc_grpo", "rctp-grpo")]
    lines += ["", f"RCTP+RC-GRPO - RCTP+GRPO: the paper {contrast:+.2f} points; this run "
                  f"{'; '.join(ours) or 'did not compare them'} (endpoints above).", ""]
    return "\n".join(lines)


def beside(paper: float, interval: list) -> str:
    """Where the paper's difference (pts) falls against this run's unit-level 95 % interval (shares)."""
    lo, hi = (100 * x for x in interval)
    if lo != lo or hi != hi:
        return "no interval"
    return f"the interval {'includes' if lo <= paper <= hi else 'excludes'} the paper's {paper:+.2f}"


def explicit_report(eval_: list[str], rl: list[str], agree: list[str], seed: int
                    ) -> tuple[str, dict, list[dict], dict[str, Path]]:
    """(Markdown, JSON, plot rows, no TSVs) of the evaluations and RL runs named one by one (`--eval`, `--rl`):
    one set of models, no seeds or endpoints (the dev sweep's per-candidate tables)."""
    dirs = dict(_pairs(eval_, "--eval"))
    rows = build_report(list(dirs.items()), _pairs(rl, "--rl"), seed)
    checks = []
    for label, other in _pairs(agree, "--agree"):
        if label not in dirs:
            raise InputError(f"--agree {label}: no --eval {label}=DIR to compare")
        checks.append({"label": label, **cross_check(dirs[label], other)})
    contrast = rc_versus_grpo(rows, {label: read_json(p).get("groups") or [] for label, p in _pairs(rl, "--rl")})
    side = one_side(rows)
    return (report_markdown(rows, contrast, side, checks),
            {"side": side, "rows": {r["label"]: r for r in rows}, "rc_grpo_vs_grpo": contrast,
             "stage_agreement": checks}, rows, {})


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="Params file (sections `grid`, `endpoints`)."),
    eval_root: Path = typer.Option(Path("results/eval"), help="Evaluations: ROOT/LABEL, ROOT/SEED/LABEL."),
    rl_root: Path = typer.Option(Path("results/rl"), help="RL runs: ROOT/SEED/CELL/metrics.json and steps.tsv."),
    controllability_root: Path | None = typer.Option(None, help="Controllability metrics: ROOT/SEED.json."),
    agree_root: Path | None = typer.Option(None, help="Controllability's rollouts: ROOT/SEED/trajectories.jsonl; "
                                           "each seed's evaluate_rctp greedy answers must be their greedy arm's."),
    eval_: list[str] = typer.Option([], "--eval", help="LABEL=DIR of an evaluate output (repeat): a report of "
                                    "these models alone, without params `grid` (the dev sweep's)."),
    rl: list[str] = typer.Option([], "--rl", help="With --eval: LABEL=metrics.json of an RL run (repeat)."),
    agree: list[str] = typer.Option([], "--agree", help="With --eval: LABEL=TRAJECTORIES another stage's greedy arm "
                                    "must equal (repeat)."),
    table: Path = typer.Option(Path("results/report/table.md"), help="Output: Markdown tables."),
    json_out: Path = typer.Option(Path("results/report/report.json"), "--json", help="Output: metrics JSON."),
    plot_out: Path = typer.Option(Path("results/report/accuracy.png"), "--plot", help="Output: PNG plot."),
    mechanism: Path | None = typer.Option(None, help="Output: PNG of the per-step mechanism, GRPO beside RC-GRPO."),
    endpoints: Path | None = typer.Option(None, help="Output: a folder of the per-unit values behind every endpoint "
                                          "(one JSON each; `rcgrpo endpoints --recompute` reprints the table)."),
    probe: Path | None = typer.Option(None, help="Output: PNG of the RL cells' fixed-probe curves."),
    seed: int = typer.Option(0, help="Bootstrap seed."),
    track: bool = typer.Option(True, help="Log to MLflow."),
) -> None:
    """Assemble the report over seeds: premise, endpoints, pooled and per-seed tables, plots."""
    with cli_errors():
        if eval_:
            md, data, rows, steps = explicit_report(eval_, rl, agree, seed)
        else:
            md, data, rows, steps = grid_report(params, eval_root, rl_root, controllability_root, agree_root, seed)
        if mechanism is not None and not steps:
            raise InputError("--mechanism needs the RL runs' per-step TSVs (the grid's report, without --eval)")
        if endpoints is not None and "endpoint_files" not in data:
            raise InputError("--endpoints needs the declared endpoints (the grid's report, without --eval)")
    files_of = data.pop("endpoint_files", None)
    task = " / ".join(sorted({r["task"] for r in rows}))
    outputs = (table, json_out, plot_out, mechanism, probe, endpoints)
    with tracking.published_run("report", {"params": str(params), "eval": eval_, "rl": rl, "seed": seed},
                                outputs=outputs, track=track) as (_, staged):
        files = [staged.file(table), staged.file(json_out), staged.file(plot_out)]
        write_text(files[0], md)
        write_json(files[1], {**data, "paper_table1_overall": PAPER_TABLE1_OVERALL})
        names = {r["label"]: _display(r["label"]) for r in rows}
        accuracy_plot(rows, files[2], names, split_title(task, data["side"]))
        if mechanism is not None:
            files.append(staged.file(mechanism))
            plot_mechanism(steps, files[-1], title=f"RC-GRPO mechanism per step (BFCL v4 {task})")
        if endpoints is not None:
            folder = staged.dir(endpoints)
            write_files(folder, files_of["results"], files_of["alpha"], files_of["power"], files_of["seeds"],
                        files_of["declared"])
            files += sorted(folder.iterdir())
        if probe is not None:
            files.append(staged.file(probe))
            probe_plot(rows, files[-1], names, f"RL on BFCL v4 {task}: the fixed probe's reward (pool half)")
        if track:
            _log(rows, files)
    typer.echo(md)


def _display(label: str) -> str:
    """A row's name in the plots: `rctp-grpo@1` -> `RCTP+GRPO (seed 1)`."""
    model, _, seed = label.partition("@")
    return row_name(model) + (f" (seed {seed})" if seed else "")


def _log(rows: list[dict], files: list[Path]) -> None:
    metrics = {}
    for r in rows:
        key = r["label"].replace("@", "/seed")  # MLflow names: no `@`
        metrics[f"{key}/overall_acc"] = r["overall"]["accuracy"]
        for cat, c in r["categories"].items():
            metrics[f"{key}/{cat}_acc"] = c["accuracy"]
        change = (r.get("rl_probe") or {}).get("change") or {}
        if change.get("mean") is not None:
            metrics[f"{key}/rl_probe_change"] = change["mean"]
    tracking.log_metrics({k: v for k, v in metrics.items() if not math.isnan(v)})
    tracking.log_table([{"model": row_name(r["label"]), "task": r["task"], "n": r["n"],
                         "overall_acc": r["overall"]["accuracy"], "ci_lo": r["overall"]["ci"][0],
                         "ci_hi": r["overall"]["ci"][1], "paper_table1": r["paper_table1_overall"]}
                        for r in rows], "report_table")
    tracking.log_files(files, "report")

if __name__ == "__main__":
    app()
