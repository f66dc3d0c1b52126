"""`rcgrpo dev-sweep --spec configs/sweeps/rl-dev.yaml --out sweeps/rl-dev`: RL's levers judged on the dev split.

Runs every candidate of the spec (params overrides) through the pipeline's own stage commands, as DVC
resolves dvc.yaml here (or as `--plan`, the plan `rcgrpo plan` wrote, has them: a host without DVC), with
only the candidate's params file and output folders substituted (`sweep.run` lists the substitutions): the
`rl` stage for each of its cells (from the pipeline's init models and RL pools: the stages that make them
run first, and a missing one is named), the `evaluate` stage on the DEV side, the `report` stage for each
candidate's tables; then writes the design table (`<out>/design.md`, `design.json`: dev accuracy vs init
paired over dev entries, the fixed probe's change, zero-variance groups of RC-GRPO vs GRPO paired group by
group, wall seconds). The plan runner runs them (`ops.plan_runner`, as `rcgrpo run-plan`): `--jobs N`
stages side by side (a GPU holds several), one log per stage in `<out>/logs`, `--bundle` (a .tar.gz of
the results, no models) rewritten after every stage; a failed chain does not stop the others. Library:
`sweep.run` (running) and `sweep.design` (judging). The held-out side is never read: the design chosen
here is reported on it by the pipeline. docs/rl.md "Chosen on dev".

`--pool DIR --pool DIR ...` runs nothing: it pools finished sweeps of the same spec (replicates) into one
table per candidate (`<out>/pooled.md`): dev accuracy over cells x runs, the spread between runs, and the
difference to the init and to the `default` candidate, each paired over dev entries; and one row per
(candidate, cell) over the replicates (`sweep.design.pooled_cells`: dev accuracy per run, the premise after RL
on dev where the spec asks for it, the token gap on RL's pool in the last third of training): what an ablation
of RC-GRPO is chosen on (`configs/sweeps/ablation-dev.yaml`, one replicate per `--seed`).
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.ops import pipeline
from rcgrpo_tasks.ops.cli import cli_errors, fail
from rcgrpo_tasks.ops.outputs import write_json, write_text
from rcgrpo_tasks.sweep.design import (
    cells_markdown,
    design_markdown,
    design_rows,
    pooled_cells,
    pooled_markdown,
    pooled_rows,
)
from rcgrpo_tasks.sweep.run import read_spec, run_sweep, write_sweep_bundle

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


def _planned(plan: Path | None) -> list[pipeline.PlannedStage]:
    """The pipeline's stages: from `plan`, else from dvc.yaml as DVC resolves it here (no status: the sweep
    runs its own copies of the stages whatever the pipeline's state)."""
    if plan is not None:
        return pipeline.read_plan(plan)[0]
    try:
        return pipeline.dvc_stages(Path("."), with_status=False)
    except ImportError:  # a GPU host: no DVC there, but the plan `rcgrpo plan` wrote travelled with the run
        fail("DVC is not installed here: pass --plan, the plan `rcgrpo plan` wrote (docs/gpu-run.md)")


@app.command()
def main(
    spec: Path = typer.Option(Path("configs/sweeps/rl-dev.yaml"), help="Sweep spec (cells, common, candidates)."),
    out: Path = typer.Option(Path("sweeps/rl-dev"), help="Output folder (one folder per candidate)."),
    params: Path = typer.Option(Path("params.yaml"), help="The params every candidate starts from."),
    jobs: int = typer.Option(1, min=1, help="Stages (rl, evaluate on dev, report) side by side."),
    only: list[str] | None = typer.Option(None, "--only", help="Only these candidates (repeatable)."),
    bundle: Path | None = typer.Option(None, help="Results bundle (.tar.gz, no models), rewritten after every stage."),
    plan: Path | None = typer.Option(None, help="The stages' commands from this plan (`rcgrpo plan`; a host without "
                                                "DVC) instead of dvc.yaml as DVC resolves it here."),
    pool: list[Path] | None = typer.Option(None, "--pool", help="Finished sweep folders of this spec to pool "
                                                                  "(repeatable); runs nothing."),
    seed: int | None = typer.Option(None, help="The grid seed the cells start from, overriding the spec's (one "
                                               "replicate per seed; `--pool` them)."),
) -> None:
    """Run the sweep; print the design table."""
    with cli_errors():
        checked = read_spec(spec, seed)
        if pool:
            missing = [str(p) for p in pool if not p.is_dir()]
            if missing:
                fail(f"--pool: not a folder: {missing}")
            rows, cells = pooled_rows(list(pool), checked), pooled_cells(list(pool), checked)
            write_json(out / "pooled.json", {"candidates": rows, "cells": cells})
            write_text(out / "pooled.md", pooled_markdown(rows, "default") + "\n" + cells_markdown(cells))
            typer.echo((out / "pooled.md").read_text())
            return
        unknown = sorted(set(only or ()) - set(checked.candidates))
        if unknown:
            fail(f"--only: unknown candidate(s) {unknown}; the spec has {list(checked.candidates)}")
        run = run_sweep(spec, out, params, _planned(plan), jobs, only, bundle, seed=seed)
        rows = [r for r in design_rows(out, run.spec) if r["candidate"] in run.names]
        write_json(out / "design.json", rows)
        write_text(out / "design.md", design_markdown(rows))
        if bundle is not None:
            write_sweep_bundle(run, bundle)
    typer.echo((out / "design.md").read_text())
    failed = [f"{r['candidate']}/{r['cell']}" for r in rows if r["status"] != "ok"]
    if failed:
        fail(f"dev-sweep: {len(failed)} chain(s) failed: {failed}; logs in {out / 'logs'}")


if __name__ == "__main__":
    app()
