"""Stage `promote`: register the best candidate and move the registry alias `champion` only when a PAIRED
comparison with the champion, entry by entry, says it is better.

Reads, per candidate (`--candidate LABEL=MODEL_DIR`, e.g. `rctp-rc_grpo=models/rl/rctp-rc_grpo`), its
evaluation folder `--eval-dir/LABEL` (the evaluate stage's `results.jsonl`: one row per held-out entry
with `id`, `protocol`, `valid`; and its `metrics.json`, whose `settings` say how it was evaluated: budgets,
sampling, prompt). The params file gives only the `promote` section: the conditions of a comparison come
from the evaluations themselves. The candidate with the highest accuracy is gated; unless the comparison is
refused, it is logged as the `model` artifact of an MLflow `promote` run and registered as a new version of
`model_name` carrying its evaluation record: its per-entry results (run artifact `eval/results.jsonl`) and
version tags `eval.protocol`, `eval.settings`, `eval.entries_sha256`, `eval.n`, `heldout_accuracy`.

The gate (`paired_gate`): the champion's per-entry results (its version's record, or `--champion-eval`
when the champion was just re-evaluated, as the `retrain` flow does) are paired with the candidate's by
entry id. A different protocol, evaluation settings or entry set makes the comparison meaningless: it is
REFUSED (alias kept, no version registered, decision `refused`, the reason names what differs). Otherwise the alias
moves only when the lower bound of the paired bootstrap CI (evaluation.stats, `n_bootstrap`, `level`) of the
accuracy difference, candidate - champion in percentage points, is above `min_improvement`. No champion:
the candidate becomes champion. A champion registered before per-entry records existed is replaced, and
the reason says so. The decision, the reason, both accuracies and the CI go to the run (metrics + tags),
the version's tags and `--out` (JSON, DVC metric).

Run: `rcgrpo promote --params params.yaml --eval-dir results/eval --out metrics/promote.json` (the candidates:
every RL cell of params `grid`, or `--candidate rctp-rc_grpo=models/rl/rctp-rc_grpo` ...).
Departs from the paper: the paper has no registry; this is the project's deployment gate.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.evaluation.grid import GridConfig
from rcgrpo_tasks.evaluation.promotion import PromoteConfig, pick, promote, read_eval
from rcgrpo_tasks.ops import tracking, tracking_store
from rcgrpo_tasks.ops.config import ConfigError, load_config
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.outputs import write_json

app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="Params file (section `promote`)."),
    candidate: list[str] = typer.Option([], help="LABEL=MODEL_DIR of a candidate (repeat), evaluated in "
                                             "EVAL_DIR/LABEL; none: every RL cell of every seed of params `grid`."),
    rl_root: Path = typer.Option(Path("models/rl"), help="The RL cells' policies: RL_ROOT/SEED/CELL (without "
                                                       "--candidate)."),
    eval_dir: Path = typer.Option(Path("results/eval"), help="Evaluate outputs: EVAL_DIR/LABEL/results.jsonl; a grid "
                                                           "cell's EVAL_DIR/SEED/CELL/results.jsonl."),
    champion_eval: Path | None = typer.Option(None, help="The champion's fresh evaluate output (same entries, "
                                                         "protocol and settings); default: its stored record."),
    out: Path = typer.Option(Path("metrics/promote.json"), help="Output: decision JSON."),
    report: Path | None = typer.Option(None, hidden=True, help="Ignored (the gate reads per-entry results)."),
) -> None:
    """Register the best candidate and move the `champion` alias if it wins the paired gate."""
    try:
        cfg = load_config(PromoteConfig, params, "promote")
        pairs = {label: (Path(d), eval_dir / label) for label, _, d in (c.partition("=") for c in candidate) if d}
        if len(pairs) != len(candidate):
            raise InputError(f"--candidate must be LABEL=DIR, got {candidate}")
        if not pairs:  # every cell of every grid seed: `rctp-grpo@1` is models/rl/1/rctp-grpo, results/eval/1/...
            grid = load_config(GridConfig, params, "grid")
            pairs = {f"{cell}@{s}": (rl_root / str(s) / cell, eval_dir / str(s) / cell)
                     for s in grid.seeds for cell in grid.cells}
        cands = {label: (model, read_eval(ev, label)) for label, (model, ev) in pairs.items()}
        champ = read_eval(champion_eval, "champion") if champion_eval else None
        pick(cands)  # a missing model folder fails before any run
        with tracking.published_run("promote", cfg, outputs=(out,)) as (run, staged):
            record = promote(cfg, cands, run, champ)
            write_json(staged.file(out), record)
    except (ConfigError, InputError, tracking_store.TrackingError) as exc:
        typer.echo(f"error: promote: {exc}", err=True)
        raise typer.Exit(2) from exc
    if record["decision"] == "refused":
        typer.echo(f"warning: promote: {record['reason']}", err=True)
    version = f" v{record['candidate_version']}" if record["candidate_version"] is not None else " (not registered)"
    typer.echo(f"{record['candidate']}{version}: {record['decision'].upper()} ({record['reason']})")

if __name__ == "__main__":
    app()
