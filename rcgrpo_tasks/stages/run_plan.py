"""`rcgrpo run-plan --plan plan.json --bundle run.tar.gz`: run the pipeline where DVC is not installed.

Runs the plan `rcgrpo plan` wrote, in its order (`--jobs N`: up to N stages side by side, each once what it
depends on is done), by the rule of `ops.pipeline` (a stage DVC found stale runs; an up-to-date one runs only
if an output is missing here; one recorded in dvc.lock since the plan was made is skipped, and a plan whose
params.yaml or dvc.yaml changed since is refused, naming the command that re-plans), each stage's commands
with this environment's executables first on PATH (`plan_runner.stage_env`), stops at the first failing stage, and
rewrites `--bundle` after every stage: per-stage wall times (`timings.json`) and logs, the plan, params.yaml,
every metric, plot and table, and the small per-entry outputs, in one file small enough to copy back.
`--gpus N` (this host's devices): a stage that declares GPUs (params `resources`, recorded in the plan) runs while
that many are free and sees only its own (`CUDA_VISIBLE_DEVICES`), so an 8-GPU host runs the paper's RL cells one
at a time on all 8 and its evaluations side by side on one each. `--dry-run` prints what would run and why. `--dvc-commit` (where DVC is installed) records each stage that
finished in dvc.lock as it finishes (`dvc commit -f <stage>`), so that a plan made after a cut finds the
finished stages up to date and runs only the rest (`make study` run again). Exit 0, or 2 naming the failing
stage and its log.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

from rcgrpo_tasks.ops import pipeline, plan_runner, recovery
from rcgrpo_tasks.ops.cli import cli_errors, fail

app = typer.Typer(add_completion=False, help="Run a plan from `rcgrpo plan` without DVC.")


@app.command()
def main(
    plan: Path = typer.Option(..., help="Plan file from `rcgrpo plan`."),
    root: Path = typer.Option(Path("."), help="Project root the stage commands run in."),
    stages: list[str] | None = typer.Option(None, "--stage", help="Only these stages (names or prefixes such "
                                                                  "as `evaluate`) and what they need; repeatable."),
    bundle: Path | None = typer.Option(None, help="Results bundle (.tar.gz), rewritten after every stage."),
    logs: Path = typer.Option(Path("logs/run-plan"), help="One log per stage."),
    jobs: int = typer.Option(1, min=1, help="Stages side by side (each once what it depends on is done); "
                                            "1 = the plan's order. A GPU host's one device holds several "
                                            "of the embedded model's stages at once."),
    dry_run: bool = typer.Option(False, help="Print what would run and why; run nothing."),
    dvc_commit: bool = typer.Option(False, help="Record each finished stage in dvc.lock as it finishes "
                                                "(`dvc commit -f`; needs DVC), so a re-plan after a cut skips it."),
    gpus: int | None = typer.Option(None, min=0, help="This host's GPUs: a stage runs while the GPUs its params "
                                                      "`resources` declare are free, and sees only those "
                                                      "(CUDA_VISIBLE_DEVICES). Unset: no bound, every stage "
                                                      "sees every device."),
) -> None:
    """Run the plan's stages that must run here; bundle the results."""
    with cli_errors():
        planned, meta = pipeline.read_plan(plan)
        names = set(pipeline.select({s.name: s.upstream for s in planned}, stages))
        planned = [s for s in planned if s.name in names]
        recorded = pipeline.recorded_since(planned, meta, root, replan=f"rcgrpo plan --out {plan}")
    if root.resolve() != Path.cwd().resolve():  # the entry point cleared the working directory's checkout
        recovery.recover(root, "rcgrpo run-plan")
    typer.echo(f"[run-plan] {plan}: {len(planned)} stages, profile {meta.get('profile', '?')}, "
               f"commit {meta.get('commit', '?')}"
               + (f"; recorded in dvc.lock since it was made: {', '.join(sorted(recorded))}" if recorded else ""))
    if dry_run:
        typer.echo("\n".join(pipeline.describe(planned, root, recorded)))
        return
    on_done = (lambda stage: commit_stage(stage.name, root)) if dvc_commit else None
    with cli_errors():
        record = plan_runner.run_plan(planned, root, logs, bundle, extra=[plan, root / "params.yaml"], jobs=jobs,
                                      on_done=on_done, recorded=recorded, gpus=gpus)
    typer.echo(plan_runner.timing_table(record))
    if bundle is not None:
        typer.echo(f"[run-plan] bundle: {bundle} ({bundle.stat().st_size / 2**20:.1f} MB)")
    failed = [(name, run) for name, run in record.stages.items() if run.status == "failed"]
    if failed:
        name, run = failed[0]
        fail(f"run-plan: stage {name} failed (exit {run.rc}); its log: {run.log}")


def commit_stage(name: str, root: Path) -> None:
    """`dvc commit -f -q <name>` in `root`: the stage's deps and outs as they are now, into dvc.lock. Called
    one stage at a time (dvc.lock has one writer); a failure is a hard error (a run that cannot record its
    progress would silently lose it at the next cut)."""
    done = subprocess.run([sys.executable, "-m", "dvc", "commit", "-f", "-q", name], cwd=root, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"dvc commit {name} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")


if __name__ == "__main__":
    app()
