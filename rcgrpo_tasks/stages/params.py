"""`rcgrpo params --profile NAME`: write a profile (configs/<name>.yaml) over the pristine params into
params.yaml, so DVC reruns exactly the stages whose sections changed (`ops.profiles.apply_profile`); what it
would write is checked whole first where dvc.yaml declares the root check (`sweep.params_check`): a bad value
writes nothing. `--show` prints what the profile changes against the pristine params, resolved, and writes
nothing; `--table DOC` regenerates the profiles table in DOC (`sweep.profiles`: every profile's budgets and
design)."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from rcgrpo_tasks.ops.config import ConfigError, as_dict, from_dict
from rcgrpo_tasks.ops.pipeline import declares_root_check
from rcgrpo_tasks.ops.profiles import UNSET, apply_profile, changes, resolve_profile
from rcgrpo_tasks.sweep.params_check import check_params
from rcgrpo_tasks.sweep.profiles import rewrite
from rcgrpo_tasks.train.sft.config import SftConfig

app = typer.Typer(add_completion=False, help="Materialize a profile overlay into a params file.")


def _flow(value) -> str:
    """A value as one line of YAML (`[a, b]`, `null`, `1.0e-05`); `(unset)` for a key that is not there."""
    if value is UNSET:
        return "(unset)"
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def effective(params: dict, where: str) -> dict:
    """`params` with each `sft.variants` entry as the stage trains it: the shared `sft` keys with the variant's
    over them (`SftConfig.resolve`), so a shared value a variant inherits, or overrides, shows as its own."""
    sft = from_dict(SftConfig, params["sft"], f"{where}:sft")
    variants = {v: {k: x for k, x in as_dict(sft.resolve(v)).items() if k != "variants"} for v in sft.variants}
    return {**params, "sft": {**params["sft"], "variants": variants}}


def shown(profile: str, root: Path, base: Path | None, out: Path) -> str:
    """Every key the profile changes against the pristine params, `key: pristine -> profile`, resolved: the
    sections deep-merged and each fine-tune variant as it trains (`effective`); `(unset)` for a key one side
    lacks."""
    got = resolve_profile(profile, root, base, out)
    diff = changes(effective(got.params, got.origin), effective(got.merged, f"profile {profile}"))
    lines = [f"profile {profile} against {got.origin}: {len(diff)} key(s) change (resolved; nothing written)"]
    lines += [f"  {key}: {_flow(a)} -> {_flow(b)}" for key, a, b in diff]
    return "\n".join(lines)


@app.command()
def main(
    profile: str | None = typer.Option(None, help="Profile: default (no overlay), a name in configs/ (smoke, gpu, "
                                                "paper, cpu-long), a YAML path, or layers joined by '+' "
                                                "(gpu+smoke: the gpu switches with the smoke budgets)."),
    base: Path | None = typer.Option(None, help="Base params file; default: the pristine params (OUT itself when "
                                                "written by hand, else its committed version)."),
    out: Path = typer.Option(Path("params.yaml"), help="Params file to write (profiles are read from ./configs "
                                                       "and the default base is ./params.yaml wherever it goes)."),
    show: bool = typer.Option(False, help="Print what the profile changes against the pristine params (resolved "
                                          "values) and write nothing."),
    table: Path | None = typer.Option(None, help="Without --profile: regenerate the profiles table in this doc "
                                                 "(docs/profiles.md) and write nothing else."),
) -> None:
    """Write OUT = pristine base + the profile's sections (DVC then reruns what changed). Applying one
    profile after another never mixes them: the base is always the pristine params."""
    try:
        if (profile is None) == (table is None):
            raise ConfigError("give --profile NAME (to write or --show it) or --table DOC, not both")
        if table is not None:
            typer.echo(f"{table}: {'rewritten' if rewrite(table, Path.cwd()) else 'up to date'}")
            return
        if show:
            typer.echo(shown(profile, Path.cwd(), base, out))
            return
        check = check_params if declares_root_check(Path.cwd()) else None  # the pipeline's own check, first
        merged = apply_profile(base, profile, out, root=Path.cwd(), check=check)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {out} ({len(merged)} sections): profile {profile}")


if __name__ == "__main__":
    app()
