"""Every `rcgrpo` command line the pipeline and the retrain round run (dvc.yaml as DVC expands it, and
flows/retrain.dvc.yaml) names a command the CLI has and passes only options that command takes: a renamed or
dropped option fails here, not minutes into a `dvc repro` or a weekly round."""

from __future__ import annotations

import importlib
import shlex

import pytest
import typer
import yaml
from helpers import REPO_ROOT

from rcgrpo_tasks.cli import COMMANDS
from rcgrpo_tasks.ops.pipeline import dvc_stages


def _options(command: str) -> set[str]:
    module, _ = COMMANDS[command]
    click_cmd = typer.main.get_command(importlib.import_module(module).app)
    return {opt for p in click_cmd.params for opt in (*p.opts, *p.secondary_opts)}


def _command_lines() -> list[tuple[str, str]]:
    """(where, command line) of every `rcgrpo` command of dvc.yaml's stages and the retrain template."""
    out = [(s.name, cmd) for s in dvc_stages(REPO_ROOT, with_status=False) for cmd in s.cmds]
    template = yaml.safe_load((REPO_ROOT / "flows" / "retrain.dvc.yaml").read_text())["stages"]
    for name, stage in template.items():
        cmds = stage.get("do", stage)["cmd"]
        out += [(f"retrain:{name}", cmd) for cmd in ([cmds] if isinstance(cmds, str) else cmds)]
    return [(where, cmd) for where, cmd in out if cmd.lstrip().startswith("rcgrpo ")]


@pytest.mark.parametrize(("where", "cmd"), _command_lines(), ids=lambda v: v if "rcgrpo" not in v else "")
def test_every_command_line_uses_options_its_command_takes(where, cmd):
    argv = shlex.split(cmd)
    assert argv[1] in COMMANDS, f"{where}: unknown command {argv[1]!r}"
    passed = {a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")}
    unknown = sorted(passed - _options(argv[1]))
    assert not unknown, f"{where}: `rcgrpo {argv[1]}` takes no {unknown}"


def test_the_check_sees_an_unknown_option():
    assert "--pool" in _options("rl") and "--no-such-option" not in _options("rl")
