"""Stage `check_params`, the pipeline's root: the whole params file checked before any other stage works
(`sweep.params_check`: every section in its stage's config, the rules across sections).

Every other stage follows it in dvc.yaml (the first ones depend on `--out`), so `dvc repro` runs it first
whenever it is changed: when params.yaml or the code that checks it changed, or when a killed stage left its
marker in the run folder (`ops.rundir`; the `rcgrpo` entry point clears that first, `ops.recovery`). `--out`
holds the same bytes whatever the params say, so checking a section makes no stage depend on it: DVC reruns
exactly the stages whose own `params:` name what changed. On a bad value: one line per problem, naming the file,
the section, the field and what is allowed; exit 2, nothing written.

Run: `rcgrpo check-params --params params.yaml --out .rcgrpo/params-checked` (what `dvc repro check_params` does).
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.outputs import write_text
from rcgrpo_tasks.sweep.params_check import SECTIONS, check_file

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])

CHECKED = "params checked whole by `rcgrpo check-params` (the same bytes whatever they say: no lineage)\n"
"""What `--out` holds: constant, so the stages that depend on it never rerun because it was rewritten."""


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="Params file to check (every section)."),
    out: Path | None = typer.Option(None, help="Output: the constant file the pipeline's first stages depend on "
                                               "(written only when the check passes)."),
) -> None:
    """Check every section of PARAMS and the rules across sections; write OUT when they hold."""
    with cli_errors():
        check_file(params)
    if out is not None and (not out.is_file() or out.read_text() != CHECKED):
        write_text(out, CHECKED)
    typer.echo(f"{params}: {len(SECTIONS)} sections and the rules across them hold")


if __name__ == "__main__":
    app()
