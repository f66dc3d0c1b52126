"""params.yaml `grid`: what dvc.yaml runs is what the report and the promotion gate read; seeds multiply every
stage downstream of SFT; the full-grid profile adds the other cells; a malformed grid fails naming the field."""

from __future__ import annotations

import pytest
import yaml
from helpers import REPO_ROOT, copy_tree

from rcgrpo_tasks.evaluation.grid import GridConfig
from rcgrpo_tasks.ops.config import ConfigError, from_dict, load_config
from rcgrpo_tasks.ops.pipeline import dvc_stages
from rcgrpo_tasks.ops.profiles import apply_profile

SEEDED = ("rctp", "pool_rctp", "controllability", "evaluate_rctp")


def _names(repo) -> set[str]:
    return {s.name for s in dvc_stages(repo, with_status=False)}


def _expected(grid: GridConfig) -> set[str]:
    """The stage names dvc.yaml must expand to for `grid`."""
    names = {f"{stage}@{s}" for stage in SEEDED for s in grid.seeds}
    names |= {f"{kind}_{init}@{s}-{algo}" for kind in ("rl", "evaluate_rl") for init, algos in grid.rl.items()
              for algo in algos for s in grid.seeds}
    return names | {f"evaluate@{label}" for label in grid.labels}


def _grid_stages(names: set[str]) -> set[str]:
    return {n for n in names if n.split("@")[0] in SEEDED + ("evaluate", "rl_sft", "rl_rctp", "evaluate_rl_sft",
                                                              "evaluate_rl_rctp")}


def test_dvc_runs_the_grid_per_seed_and_the_full_grid_profile_adds_the_rest(tmp_path):
    grid = load_config(GridConfig, REPO_ROOT / "params.yaml", "grid")
    assert grid.cells == ["sft-grpo", "rctp-grpo", "rctp-rc_grpo"] and grid.seeds == (0,)  # the paper's comparison
    assert _grid_stages(_names(REPO_ROOT)) == _expected(grid)
    repo = copy_tree(tmp_path / "repo")
    apply_profile(None, "full-grid", repo / "params.yaml")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["grid"]["seeds"] = [0, 3]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    full = load_config(GridConfig, repo / "params.yaml", "grid")
    assert set(full.cells) == {f"{i}-{a}" for i in ("sft", "rctp") for a in ("grpo", "rc_grpo", "dynamic")}
    assert {"rctp-notoken", "rctp-rc_grpo-notoken"} <= set(full.labels)
    names = _names(repo)
    assert _grid_stages(names) == _expected(full)
    stages = {s.name: s for s in dvc_stages(repo, with_status=False)}
    assert "models/rctp/3" in stages["rctp@3"].outs and "models/rl/3/sft-dynamic" in stages["rl_sft@3-dynamic"].outs


@pytest.mark.parametrize("grid,needle", [
    ({"seeds": [0], "rl": {"sft": ["ppo"], "rctp": []}, "evaluate": {}}, "rl.sft"),
    ({"seeds": [0], "rl": {"sft": ["grpo"]}, "evaluate": {}}, "rl"),
    ({"seeds": [0], "rl": {"sft": [], "rctp": []}, "evaluate": {}}, "no cell"),
    ({"seeds": [], "rl": {"sft": ["grpo"], "rctp": []}, "evaluate": {}}, "seeds"),
    ({"seeds": [1, 1], "rl": {"sft": ["grpo"], "rctp": []}, "evaluate": {}}, "seeds"),
    ({"seeds": [0], "rl": {"sft": ["grpo"], "rctp": []},
      "evaluate": {"a b": {"model": "m", "adapter": "", "dep": "m", "reward_token": "", "flags": ""}}}, "a b"),
    ({"seeds": [0], "rl": {"sft": ["grpo"], "rctp": []}, "evaluate": {"sft": {"model": "m"}}}, "evaluate.sft"),
    ({"seeds": [0], "rl": {"sft": ["grpo"], "rctp": []},
      "evaluate": {"rctp": {"model": "m", "adapter": "", "dep": "m", "reward_token": "", "flags": ""}}}, "seeded"),
])
def test_a_malformed_grid_fails_naming_the_field(grid, needle):
    with pytest.raises(ConfigError, match=needle):
        from_dict(GridConfig, grid, "params.yaml:grid")
