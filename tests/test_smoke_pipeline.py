"""The DVC pipeline, every stage for real, on the smoke profile of each task: `dvc repro` in a copy of the
repo, with the conftest's 2-layer random-init model as `prepare_model.source` (the embedded SmolLM2 would
take CI past its time; the model's size is all that differs). A random model never succeeds, so the numbers
are zeros: what is checked is that the stages run, in order, on either task, and say which task they ran.

Each task runs the chain to its RC-GRPO cell's evaluation plus the controllability check (12 of the 27
stages: data, GX gate, labels, both fine-tunes, on-policy samples, rl@rctp-rc_grpo, evaluate; ~2.5 min on 2
cores, each stage a process that imports torch and TRL), which holds every task-specific path; the rest of
the grid is the same code on other inputs, and the report is tested on built inputs (test_report.py). The
whole pipeline on the real model: `dvc repro` of the default (docs/rl.md "Measured").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import copy_tree

BIN = Path(sys.executable).parent
TARGETS = ("controllability", "evaluate@rctp-rc_grpo")
CHAIN = ("prepare_data", "prepare_model", "generate_trajectories", "validate_trajectories", "label_rewards@sft",
         "sft@sft", "sample_policy", "label_rewards@rctp", "sft@rctp", "controllability", "rl@rctp-rc_grpo",
         "evaluate@rctp-rc_grpo")


@pytest.mark.parametrize("profile,task", [
    ("smoke", "single_turn"),
    ("multi-turn+smoke", "multi_turn"),
])
def test_the_stages_run_on_the_smoke_profile(tmp_path, tiny_model_dir, profile, task):
    repo = copy_tree(tmp_path / "repo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
    env.update({"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
                "RCGRPO_CPU_BF16": "0"})
    subprocess.run([str(BIN / "rcgrpo"), "params", "--profile", profile], cwd=repo, env=env, check=True,
                   capture_output=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["prepare_model"]["source"] = str(tiny_model_dir)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = subprocess.run([str(BIN / "dvc"), "repro", *TARGETS], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

    ran = [ln.split("'")[1] for ln in out.stdout.splitlines() if ln.startswith("Running stage")]
    assert len(set(ran)) == len(ran), ran
    assert json.loads((repo / "metrics" / "prepare_data.json").read_text())["task"] == task
    assert set(CHAIN) == set(ran), ran
    metrics = json.loads((repo / "results" / "eval" / "rctp-rc_grpo" / "metrics.json").read_text())
    assert metrics["task"] == task, metrics
    rl = json.loads((repo / "metrics" / "rl_rctp-rc_grpo.json").read_text())
    assert rl["steps"] >= 1, rl
