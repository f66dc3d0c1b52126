"""One name per thing: every stage's MLflow run is named as its DVC stage (`ops.names.stage_name`, the rule
`ops.tracking.run_name` keeps), so the MLflow UI reads as `dvc stage list` and `dvc status` do. Checked on
`dvc.yaml` as DVC expands it, for the default grid and for the full grid over two seeds (every cell and
label a profile adds); the smoke pipeline (tests/test_smoke_pipeline.py) reads the names back from MLflow."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT

from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.config import deep_merge
from rcgrpo_tasks.ops.names import ALGOS, INITS, split_cell, stage_name
from rcgrpo_tasks.ops.pipeline import dvc_stages

NAMED_BY_ARGS = ("sft", "rl", "evaluate", "controllability")
"""Stage commands that name their run from their arguments (one module, several stages); the others are
named by the stage DVC runs them in (`$DVC_STAGE`)."""


def _options(cmd: str) -> tuple[str, dict[str, str]]:
    """(`rcgrpo` subcommand, {--option: value}) of a stage command."""
    words = shlex.split(cmd)
    assert words[0] == "rcgrpo", cmd
    opts = {w: words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
            for i, w in enumerate(words) if w.startswith("--")}
    return words[1], opts


def _named(sub: str, opts: dict[str, str]) -> str:
    """The name the stage module computes from its arguments (stages/evaluate.py, stages/controllability.py,
    train/sft/run.py, train/rl/run.py)."""
    seed = int(opts["--grid-seed"]) if opts.get("--grid-seed") else None
    model = {"sft": lambda: opts["--variant"], "rl": lambda: f"{opts['--init']}-{opts['--algo']}",
             "evaluate": lambda: opts.get("--name") or Path(opts["--out"]).name,
             "controllability": lambda: opts.get("--cell") or "rctp"}[sub]()
    return stage_name(sub, model, seed)


def _repo_with(tmp_path: Path, overlay: dict) -> Path:
    """A DVC project of this dvc.yaml under params.yaml with `overlay` merged in (no outputs: DVC only expands)."""
    from dvc.repo import Repo

    root = tmp_path / "repo"
    root.mkdir()
    Repo.init(str(root), no_scm=True)
    shutil.copy(REPO_ROOT / "dvc.yaml", root / "dvc.yaml")
    params = deep_merge(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()), overlay)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root


def _full_grid() -> dict:
    grid = yaml.safe_load((REPO_ROOT / "configs" / "full-grid.yaml").read_text())
    return deep_merge(grid, {"grid": {"seeds": [0, 3]}})


@pytest.mark.parametrize("overlay", [None, "full-grid"])
def test_every_stage_run_is_named_as_its_dvc_stage(tmp_path, monkeypatch, overlay):
    root = REPO_ROOT if overlay is None else _repo_with(tmp_path, _full_grid())
    stages = dvc_stages(root, with_status=False)
    checked = 0
    for stage in stages:
        sub, opts = _options(stage.cmds[0])
        module = sub.replace("-", "_")
        if module in NAMED_BY_ARGS:
            assert _named(module, opts) == stage.name, stage.cmds[0]
            checked += 1
        else:  # the stage DVC runs the module in
            monkeypatch.setenv("DVC_STAGE", stage.name)
            assert tracking.run_name(module) == stage.name
    seeds = 2 if overlay else 1
    assert checked >= seeds * 4 + 2, [s.name for s in stages]  # sft, evaluate@...; per seed rctp, RL, evaluations


def test_dvc_stage_names_the_run_of_a_module_that_serves_several(monkeypatch):
    monkeypatch.setenv("DVC_STAGE", "pool_rctp@3")
    assert tracking.run_name("sample_policy") == "pool_rctp@3"
    assert tracking.run_name("validate_trajectories", "pool_rctp@3") == "validate_trajectories@pool_rctp@3"
    assert tracking.run_name(stage_name("rl", "rctp-grpo", 3)) == "rl_rctp@3-grpo"  # its own name wins


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_stage_names_are_distinct_and_round_trip_the_cell(seed):
    names = {}
    for init in INITS:
        for algo in ALGOS:
            cell = f"{init}-{algo}"
            assert split_cell(cell) == (init, algo)
            for stage in ("rl", "evaluate", "controllability"):
                names.setdefault(stage_name(stage, cell, seed), []).append((stage, cell))
    names.setdefault(stage_name("controllability", "rctp", seed), []).append(("controllability", "rctp"))
    for variant in ("sft", "rctp"):
        names.setdefault(stage_name("sft", variant, seed), []).append(("sft", variant))
    assert all(len(v) == 1 for v in names.values()), names
    assert split_cell("rctp-rc_grpo-notoken") is None and split_cell("base") is None
