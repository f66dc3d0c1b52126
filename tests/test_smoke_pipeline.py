"""The DVC pipeline, every stage for real, on the smoke profile of each task: `dvc repro` in a copy of the
repo, with the conftest's 2-layer random-init model as `prepare_model.source` (the embedded SmolLM2 would
take CI past its time; the model's size is all that differs). A random model never succeeds, so the numbers
are zeros: what is checked is that the stages run, in order, on either task, and say which task they ran.

The default task (single_turn, `make test`) runs the chain to its RC-GRPO cell's evaluation and the
controllability check (13 stages: data, GX gate, labels, SFT and RCTP, on-policy samples and RL's pool, the
check, rl_rctp@0-rc_grpo, its evaluation; each a process that imports torch, TRL and PEFT), which holds every
task-specific path, then `rcgrpo dev-sweep` on its outputs (rl, evaluate on dev, the premise on dev before and
after RL, report). The paper's task
(multi_turn, `slow`: `make test-all`, which CI runs) runs the whole smoke grid (grid seed 0, the two RCTP
cells, and the premise after RL of each) to the report over seeds with its endpoints (21 stages). conftest hands this module out first, so a
chain runs on one core beside the rest of the suite. The report is also tested on built inputs
(test_seeded_report.py). The whole pipeline on the real model: `dvc repro` of the default (docs/log.md
"Pipeline runs").
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
SHORT = ("check_params", "prepare_data", "prepare_model", "generate_trajectories", "validate_trajectories", "label_rewards@sft",
         "sft", "sample_policy@rctp", "label_rewards@rctp", "rctp@0", "pool_rctp@0", "controllability@0",
         "rl_rctp@0-rc_grpo", "evaluate_rl_rctp@0-rc_grpo")
FULL = (*SHORT, "rl_rctp@0-grpo", "evaluate@base", "evaluate@sft", "evaluate_rctp@0", "evaluate_rl_rctp@0-grpo",
        "controllability_rl_rctp@0-grpo", "controllability_rl_rctp@0-rc_grpo", "report")
TARGETS = {SHORT: ("controllability@0", "evaluate_rl_rctp@0-rc_grpo"), FULL: ("report",)}


PROFILES = {"single_turn": "smoke", "multi_turn": "multi-turn+smoke"}


@pytest.mark.parametrize(("task", "chain"), [("single_turn", SHORT),
                                             pytest.param("multi_turn", FULL, marks=pytest.mark.slow)])
def test_the_stages_run_on_the_smoke_profile_of_the_task(tmp_path, tiny_model_dir, task, chain):
    """The task's chain under `dvc repro`, one thread (a stage is mostly a process importing torch, TRL and
    PEFT on one core); after the short chain the dev sweep runs on its outputs, the full one ends in the report."""
    repo, proc = _start(tmp_path / task, tiny_model_dir, PROFILES[task], TARGETS[chain])
    try:
        proc.wait(timeout=1200)
    finally:
        proc.kill()
    stdout, stderr = ((repo.parent / name).read_text() for name in ("stdout", "stderr"))
    assert proc.returncode == 0, f"{task}: " + stdout[-4000:] + stderr[-4000:]
    _check(repo, stdout, task, chain)
    if chain == SHORT:
        _check_dev_sweep(repo, tmp_path / task)
    else:
        _check_report(repo)


def _check_dev_sweep(repo: Path, root: Path) -> None:
    """`rcgrpo dev-sweep` on the pipeline's own inits: the rl stage's command, then evaluate on the DEV side,
    the report and the design table; `--pool` reads the finished sweep back."""
    spec = root / "spec.yaml"
    spec.write_text("cells: [rctp-rc_grpo]\npremise: true\ncommon: {evaluate: {margin: false}}\n"
                    "candidates: {default: {}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
    env.update({"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db"})
    run = subprocess.run([str(BIN / "rcgrpo"), "dev-sweep", "--spec", str(spec), "--out", "sweeps/t", "--bundle",
                          "sweeps/t.tar.gz"], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    design = json.loads((repo / "sweeps" / "t" / "design.json").read_text())
    assert [(r["candidate"], r["cell"], r["status"]) for r in design] == [("default", "rctp-rc_grpo", "ok")]
    dev = set(json.loads((repo / "data" / "split.json").read_text())["dev"])
    for folder in ("sweeps/t/default/rctp-rc_grpo/eval", "sweeps/t/init/rctp"):
        ids = [json.loads(line)["id"] for line in (repo / folder / "results.jsonl").read_text().splitlines()]
        assert ids and set(ids) <= dev, folder
    assert design[0]["n_dev"] == len(ids) and design[0]["vs_init"]["n"] == len(ids)
    for ctl in ("sweeps/t/init/ctl-rctp.json", "sweeps/t/default/rctp-rc_grpo/ctl.json"):  # the premise on dev
        assert json.loads((repo / ctl).read_text())["side"] == "dev", ctl
    assert design[0]["premise_before"] is not None and design[0]["premise_after"] is not None
    pooled = subprocess.run([str(BIN / "rcgrpo"), "dev-sweep", "--spec", str(spec), "--out", "sweeps/p", "--pool",
                             "sweeps/t"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert pooled.returncode == 0 and "| default | 1 |" in pooled.stdout, pooled.stdout + pooled.stderr


def _start(root: Path, tiny_model_dir: Path, profile: str, targets: tuple[str, ...]) -> tuple[Path, subprocess.Popen]:
    """A copy of the repo on `profile` with the tiny model as its source, and its `dvc repro` started."""
    repo = copy_tree(root / "repo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
    env.update({"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db",
                "OMP_NUM_THREADS": "1"})
    subprocess.run([str(BIN / "rcgrpo"), "params", "--profile", profile], cwd=repo, env=env, check=True,
                   capture_output=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["prepare_model"]["source"] = str(tiny_model_dir)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    with open(root / "stdout", "w") as out, open(root / "stderr", "w") as err:  # files: no pipe fills up
        return repo, subprocess.Popen([str(BIN / "dvc"), "repro", *targets], cwd=repo, env=env, stdout=out,
                                      stderr=err)


def _check(repo: Path, stdout: str, task: str, chain: tuple[str, ...]) -> None:
    """Every stage of the chain ran once, on `task`, and RL took a step."""
    ran = [ln.split("'")[1] for ln in stdout.splitlines() if ln.startswith("Running stage")]
    assert len(set(ran)) == len(ran), ran
    assert json.loads((repo / "metrics" / "prepare_data.json").read_text())["task"] == task
    assert set(chain) == set(ran), ran
    metrics = json.loads((repo / "results" / "eval" / "0" / "rctp-rc_grpo" / "metrics.json").read_text())
    assert metrics["task"] == task and metrics["settings"]["grid_seed"] == 0, metrics
    rl = json.loads((repo / "results" / "rl" / "0" / "rctp-rc_grpo" / "metrics.json").read_text())
    assert rl["steps"] >= 1 and rl["pool"]["size"] >= 1 and rl["pool_learning"]["prompts"] >= 0, rl
    assert set(chain) - {"prepare_data", "check_params"} <= _run_names(repo.parent / "mlflow.db")  # these track nothing


def _run_names(db: Path) -> set[str]:
    """The MLflow runs' names in the chain's store: each stage's run is named as its DVC stage
    (tests/test_run_names.py); the GX gates run inside another stage are named after it."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    ids = [e.experiment_id for e in client.search_experiments()]
    return {r.info.run_name for r in client.search_runs(ids, max_results=1000)}


def _check_report(repo: Path) -> None:
    """The report over seeds on the chain's real outputs: the declared endpoints first, the premise per seed."""
    report = json.loads((repo / "results" / "report" / "report.json").read_text())
    assert [e["rank"] for e in report["endpoints"]][:2] == ["primary", "primary"] and report["premise"], report
    table = (repo / "results" / "report" / "table.md").read_text()
    assert table.index("RCTP's premise") < table.index("## Endpoints") < table.index("## Seed 0"), table[:2000]
    assert "## What the injected variance is made of" in table and "(after RL)" in table
    check = subprocess.run([str(BIN / "rcgrpo"), "endpoints", "--recompute", "results/report/endpoints", "--check",
                            "results/report/table.md"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "equal to" in check.stdout, check.stdout + check.stderr
