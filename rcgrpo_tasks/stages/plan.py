"""`rcgrpo plan --out plan.json`: the pipeline as DVC resolves it here, for `rcgrpo run-plan` on a host
without DVC (a lent GPU machine with no package index; `ops.pipeline` states the rule it runs by).

First the whole params file is checked, as the pipeline's root stage checks it (`sweep.params_check`): a bad
value fails in about a second, nothing written. Then writes every `dvc.yaml` stage (foreach/matrix expanded,
topological order) with its commands, outputs and whether `dvc status` finds it up to date, plus the profile
and git commit it was made from. With
`--outputs-archive`, the outputs of the up-to-date stages that exist here and are at most `--max-output-mb`
each go into one .tar.gz to travel with the plan; larger ones (the base model) are rebuilt there.
"""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import typer

from rcgrpo_tasks.ops import pipeline
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.outputs import atomic_outputs
from rcgrpo_tasks.ops.profiles import current_profile
from rcgrpo_tasks.sweep.params_check import check_file

app = typer.Typer(add_completion=False, help="Write the DVC pipeline as a plan that runs without DVC.")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _commit(repo: Path) -> str:
    out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+changes" if dirty else "")


@app.command()
def main(
    out: Path = typer.Option(..., help="Plan file to write (JSON)."),
    repo: Path = typer.Option(Path("."), help="Project root (its dvc.yaml and params.yaml)."),
    outputs_archive: Path | None = typer.Option(None, help="Also pack the up-to-date stages' outputs into this "
                                                           ".tar.gz (paths relative to the project root)."),
    max_output_mb: float = typer.Option(16.0, min=0.0, help="Outputs larger than this stay behind (rebuilt "
                                                            "by run-plan from the same deps)."),
    status: bool = typer.Option(True, help="Ask `dvc status` which stages are up to date (else: none is)."),
) -> None:
    """Write the plan (and the outputs archive); print each stage's state."""
    with cli_errors():
        if pipeline.declares_root_check(repo):  # the whole params file, before DVC hashes anything (seconds)
            check_file(repo / "params.yaml")
        stages = pipeline.dvc_stages(repo, with_status=status)
        carried: list[str] = []
        lines = []
        for s in stages:
            note = ""
            if s.done and outputs_archive is not None:
                for rel in s.outs:
                    path = repo / rel
                    if not path.exists():
                        note += f" {rel}: missing here"
                    elif (size := _size(path)) > max_output_mb * 2**20:
                        note += f" {rel}: {size / 2**20:.0f} MB, rebuilt there"
                    else:
                        carried.append(rel)
            where = f"gpu: {s.gpus}" if s.gpus else "cpu"
            lines.append(f"{s.name:<28} {where:<7} {'up to date' if s.done else 'to run'}{note}")
        meta = {"profile": current_profile(repo / "params.yaml"), "commit": _commit(repo), "carried": carried,
                **pipeline.plan_state(repo)}  # what `run-plan` compares with dvc.lock before it runs
        with atomic_outputs() as staged:  # the plan and its archive are published together or not at all
            if outputs_archive is not None:
                with tarfile.open(staged.file(outputs_archive), "w:gz") as tar:
                    for rel in carried:
                        tar.add(repo / rel, arcname=rel)
            pipeline.write_plan(stages, staged.file(out), meta)
    typer.echo("\n".join(lines))
    size = f" ({outputs_archive.stat().st_size / 2**20:.1f} MB)" if outputs_archive is not None else ""
    typer.echo(f"wrote {out}: {len(stages)} stages, {sum(not s.done for s in stages)} to run, profile "
               f"{meta['profile']}, commit {meta['commit']}"
               + (f"; {outputs_archive}{size}: {', '.join(carried) or 'nothing'}" if outputs_archive else ""))


if __name__ == "__main__":
    app()
