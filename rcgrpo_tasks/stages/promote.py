"""Stage `promote`: register the best candidate and move the registry alias `champion` only when a PAIRED
comparison with the champion, entry by entry, says it is better.

Reads, per candidate (`--candidate LABEL=MODEL_DIR`, e.g. `rctp-rc_grpo=models/rl/rctp-rc_grpo`), its
evaluation folder `--eval-dir/LABEL` (the evaluate stage's `results.jsonl`: one row per held-out entry
with `id`, `protocol`, `valid`) and the params file (the profile it was generated with, `rcgrpo params`).
The candidate with the highest accuracy is logged as the `model` artifact of an MLflow `promote` run and
registered as a new version of `model_name` carrying its evaluation record: its per-entry results (run
artifact `eval/results.jsonl`) and version tags `eval.protocol`, `eval.profile`, `eval.entries_sha256`,
`eval.n`, `heldout_accuracy`.

The gate (`paired_gate`): the champion's per-entry results (its version's record, or `--champion-eval`
when the champion was just re-evaluated, as the `retrain` flow does) are paired with the candidate's by
entry id. A different protocol, profile or entry set makes the comparison meaningless: it is REFUSED
(alias kept, decision `refused`, the reason says what differs and how to fix it). Otherwise the alias
moves only when the lower bound of the paired bootstrap CI (ops.stats, `n_bootstrap`, `level`) of the
accuracy difference, candidate - champion in percentage points, is above `min_improvement`. No champion:
the candidate becomes champion. A champion registered before per-entry records existed is replaced, and
the reason says so. The decision, the reason, both accuracies and the CI go to the run (metrics + tags),
the version's tags and `--out` (JSON, DVC metric).

Run: `rcgrpo promote --params params.yaml --eval-dir results/eval \
  --candidate rctp-rc_grpo=models/rl/rctp-rc_grpo --out metrics/promote.json`.
Departs from the paper: the paper has no registry; this is the project's deployment gate.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.evaluation.promotion import PromoteConfig, promote, read_eval
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.config import ConfigError, current_profile, load_config
from rcgrpo_tasks.ops.io import InputError, write_json

app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="Params file (section `promote`; its profile)."),
    candidate: list[str] = typer.Option(..., help="LABEL=MODEL_DIR of a candidate (repeat)."),
    eval_dir: Path = typer.Option(Path("results/eval"), help="Evaluate outputs: EVAL_DIR/LABEL/results.jsonl."),
    champion_eval: Path | None = typer.Option(None, help="Folder with the champion's fresh results.jsonl (same "
                                                  "entries, protocol and profile); default: its stored record."),
    out: Path = typer.Option(Path("metrics/promote.json"), help="Output: decision JSON."),
    report: Path | None = typer.Option(None, hidden=True, help="Ignored (the gate reads per-entry results)."),
) -> None:
    """Register the best candidate and move the `champion` alias if it wins the paired gate."""
    try:
        cfg = load_config(PromoteConfig, params, "promote")
        profile = current_profile(params)
        pairs = dict(c.split("=", 1) for c in candidate if "=" in c)
        if len(pairs) != len(candidate):
            raise InputError(f"--candidate must be LABEL=DIR, got {candidate}")
        cands = {label: (Path(d), read_eval(eval_dir / label, label, profile)) for label, d in pairs.items()}
        champ = read_eval(champion_eval, "champion", profile) if champion_eval else None
        record = promote(cfg, cands, champ)
    except (ConfigError, InputError, tracking.TrackingError) as exc:
        typer.echo(f"error: promote: {exc}", err=True)
        raise typer.Exit(2) from exc
    write_json(out, record)
    if record["decision"] == "refused":
        typer.echo(f"warning: promote: {record['reason']}", err=True)
    typer.echo(f"{record['candidate']} v{record['candidate_version']}: {record['decision'].upper()} "
               f"({record['reason']})")


if __name__ == "__main__":
    app()
