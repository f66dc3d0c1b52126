"""params.yaml `grid`: what dvc.yaml runs is what the report and the promotion gate read; the full-grid profile
adds the other cells; a malformed grid fails naming the field."""

from __future__ import annotations

import pytest
import yaml
from helpers import REPO_ROOT, copy_tree

from rcgrpo_tasks.evaluation.grid import GridConfig
from rcgrpo_tasks.ops.config import ConfigError, apply_profile, from_dict, load_config
from rcgrpo_tasks.ops.pipeline import dvc_stages


def _names(repo) -> set[str]:
    return {s.name for s in dvc_stages(repo, with_status=False)}


def test_dvc_runs_the_grid_and_the_full_grid_profile_adds_the_rest(tmp_path):
    grid = load_config(GridConfig, REPO_ROOT / "params.yaml", "grid")
    assert grid.cells == ["sft-grpo", "rctp-grpo", "rctp-rc_grpo"]  # the paper's comparison
    names = _names(REPO_ROOT)
    assert {n for n in names if n.startswith("rl@")} == {f"rl@{c}" for c in grid.cells}
    assert {n for n in names if n.startswith("evaluate@")} == {f"evaluate@{label}" for label in grid.labels}
    repo = copy_tree(tmp_path / "repo")
    apply_profile(None, "full-grid", repo / "params.yaml")
    full = load_config(GridConfig, repo / "params.yaml", "grid")
    assert set(full.cells) == {f"{i}-{a}" for i in ("sft", "rctp") for a in ("grpo", "rc_grpo", "dynamic")}
    assert {"rctp-notoken", "rctp-rc_grpo-notoken"} <= set(full.labels)
    names = _names(repo)
    assert {n for n in names if n.startswith("rl@")} == {f"rl@{c}" for c in full.cells}
    assert {n for n in names if n.startswith("evaluate@")} == {f"evaluate@{label}" for label in full.labels}


@pytest.mark.parametrize("grid,needle", [
    ({"rl": {"sft-grpo": {"init": "sft", "algo": "ppo"}}}, "rl.sft-grpo"),
    ({"rl": {"x": {"init": "sft", "algo": "grpo"}}}, "rl.x"),
    ({"rl": {"sft-grpo": {"init": "sft"}}}, "rl.sft-grpo"),
    ({"rl": {"sft-rc_grpo": {"init": "sft", "algo": "rc_grpo"}}}, "no evaluation"),
    ({"evaluate": {"a b": {"model": "m", "adapter": "", "dep": "m", "reward_token": "", "flags": ""}}}, "a b"),
    ({"evaluate": {"sft": {"model": "m"}}}, "evaluate.sft"),
])
def test_a_malformed_grid_fails_naming_the_field(grid, needle):
    with pytest.raises(ConfigError, match=needle):
        from_dict(GridConfig, grid, "params.yaml:grid")


def test_the_report_reads_what_the_grid_names(tmp_path):
    """Without --eval the report takes every label of the grid from --eval-root; a label whose evaluation is
    missing fails naming it, and a stale folder the grid does not name is not read."""
    from typer.testing import CliRunner

    from rcgrpo_tasks.ops.outputs import write_jsonl
    from rcgrpo_tasks.stages import report as report_stage

    params = tmp_path / "params.yaml"
    item = {"adapter": "", "dep": "m", "reward_token": "", "flags": ""}
    params.write_text(yaml.safe_dump({"grid": {"rl": {}, "evaluate": {"base": {"model": "m", **item},
                                                                      "sft": {"model": "m", **item}}}}))
    row = {"category": "simple_python", "valid": True, "official_valid": True, "partial_credit": 1.0,
           "paper_reward": 1.0}
    for label in ("base", "stale"):
        write_jsonl(tmp_path / "eval" / label / "results.jsonl", [{"id": "simple_python_0", **row}])
    args = ["--params", str(params), "--eval-root", str(tmp_path / "eval"), "--rl-root", str(tmp_path / "rl"),
            "--no-track", "--table", str(tmp_path / "t.md"), "--json", str(tmp_path / "r.json"),
            "--plot", str(tmp_path / "a.png")]
    res = CliRunner().invoke(report_stage.app, args)
    assert res.exit_code == 2 and "sft" in res.output
    write_jsonl(tmp_path / "eval" / "sft" / "results.jsonl", [{"id": "simple_python_0", **row}])
    res = CliRunner().invoke(report_stage.app, args)
    assert res.exit_code == 0, res.output
    table = (tmp_path / "t.md").read_text()
    assert "| Base |" in table and "| SFT |" in table and "stale" not in table
