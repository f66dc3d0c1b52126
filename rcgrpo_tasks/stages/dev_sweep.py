"""`rcgrpo dev-sweep --spec configs/sweeps/rl-dev.yaml --out sweeps/rl-dev`: RL's levers judged on the dev split.

Runs every candidate of the spec (params overrides) through the `rl` stage's command for each of its cells
(from the pipeline's `models/sft/<init>` and `data/policy`: run `dvc repro sft@rctp sample_policy` first),
scores each result on the DEV side with the `evaluate` stage's command, builds each candidate's tables with
the `report` stage's command and writes the design table (`<out>/design.md`, `design.json`: dev accuracy
vs init paired over dev entries, the fixed probe's change, zero-variance groups of RC-GRPO vs GRPO paired
group by group, wall seconds). `--jobs N` runs N chains side by side (a GPU holds several); `--bundle`
rewrites a .tar.gz of the results (no models) after every chain. Library: `ops.sweep` (running) and
`evaluation.design` (judging). The held-out side is never read: the design chosen here is reported on it by
the pipeline. docs/rl.md "Chosen on dev".

`--pool DIR --pool DIR ...` runs nothing: it pools finished sweeps of the same spec (replicates) into one
table per candidate (`<out>/pooled.md`): dev accuracy over cells x runs, the spread between runs, and the
difference to the init and to the `default` candidate, each paired over dev entries.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.evaluation.design import design_markdown, design_rows, pooled_markdown, pooled_rows
from rcgrpo_tasks.ops.cli import cli_errors, fail
from rcgrpo_tasks.ops.outputs import write_json, write_text
from rcgrpo_tasks.ops.sweep import read_spec, run_sweep, write_sweep_bundle

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    spec: Path = typer.Option(Path("configs/sweeps/rl-dev.yaml"), help="Sweep spec (cells, common, candidates)."),
    out: Path = typer.Option(Path("sweeps/rl-dev"), help="Output folder (one folder per candidate)."),
    params: Path = typer.Option(Path("params.yaml"), help="The params every candidate starts from."),
    jobs: int = typer.Option(1, min=1, help="Chains (rl + evaluate on dev) side by side."),
    only: list[str] | None = typer.Option(None, "--only", help="Only these candidates (repeatable)."),
    bundle: Path | None = typer.Option(None, help="Results bundle (.tar.gz, no models), rewritten after every chain."),
    pool: list[Path] | None = typer.Option(None, "--pool", help="Finished sweep folders of this spec to pool "
                                                                  "(repeatable); runs nothing."),
) -> None:
    """Run the sweep; print the design table."""
    with cli_errors():
        checked = read_spec(spec)
        if pool:
            missing = [str(p) for p in pool if not p.is_dir()]
            if missing:
                fail(f"--pool: not a folder: {missing}")
            rows = pooled_rows(list(pool), checked)
            write_json(out / "pooled.json", rows)
            write_text(out / "pooled.md", pooled_markdown(rows, "default"))
            typer.echo((out / "pooled.md").read_text())
            return
        unknown = sorted(set(only or ()) - set(checked.candidates))
        if unknown:
            fail(f"--only: unknown candidate(s) {unknown}; the spec has {list(checked.candidates)}")
        for need in ("models/sft", "data/policy/trajectories.jsonl", "data/split.json"):
            if not Path(need).exists():
                fail(f"{need} not found: run `dvc repro sft@rctp sample_policy` (the inits and RL's pool) first")
        ran, names = run_sweep(spec, out, params, jobs, only, bundle)
        rows = [r for r in design_rows(out, ran) if r["candidate"] in names]
        write_json(out / "design.json", rows)
        write_text(out / "design.md", design_markdown(rows))
        if bundle is not None:
            write_sweep_bundle(out, bundle)
    typer.echo((out / "design.md").read_text())
    failed = [f"{r['candidate']}/{r['cell']}" for r in rows if r["status"] != "ok"]
    if failed:
        fail(f"dev-sweep: {len(failed)} chain(s) failed: {failed}; logs in {out / 'logs'}")


if __name__ == "__main__":
    app()
