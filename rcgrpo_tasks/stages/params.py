"""`rcgrpo params --profile NAME`: write a profile (configs/<name>.yaml) over the pristine params into
params.yaml, so DVC reruns exactly the stages whose sections changed (`ops.profiles.apply_profile`); what it
would write is checked whole first where dvc.yaml declares the root check (`sweep.params_check`): a bad value
writes nothing."""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.pipeline import declares_root_check
from rcgrpo_tasks.ops.profiles import apply_profile
from rcgrpo_tasks.sweep.params_check import check_params

app = typer.Typer(add_completion=False, help="Materialize a profile overlay into a params file.")


@app.command()
def main(
    profile: str = typer.Option(..., help="Profile: default (no overlay), a name in configs/ (smoke, gpu, "
                                          "paper, cpu-long), a YAML path, or layers joined by '+' "
                                          "(gpu+smoke: the gpu switches with the smoke budgets)."),
    base: Path | None = typer.Option(None, help="Base params file; default: the pristine params (OUT itself when "
                                                "written by hand, else its committed version)."),
    out: Path = typer.Option(Path("params.yaml"), help="Params file to write (profiles are read from ./configs "
                                                       "and the default base is ./params.yaml wherever it goes)."),
) -> None:
    """Write OUT = pristine base + the profile's sections (DVC then reruns what changed). Applying one
    profile after another never mixes them: the base is always the pristine params."""
    try:
        check = check_params if declares_root_check(Path.cwd()) else None  # the pipeline's own check, first
        merged = apply_profile(base, profile, out, root=Path.cwd(), check=check)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {out} ({len(merged)} sections): profile {profile}")


if __name__ == "__main__":
    app()
