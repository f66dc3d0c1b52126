"""The Prefect flow on a tiny synthetic DVC repo: discovery, plan, nested MLflow runs, skip on re-run,
stage failure, tracking preflight, push/pull through a local-folder DVC remote and retried transfers.
Uses Prefect's test harness (a temporary local API) and a temp sqlite MLflow store."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from flows import rcgrpo_flow as fl  # noqa: E402

PY = sys.executable
STAGE_SCRIPT = """
import json, sys
from pathlib import Path
from rcgrpo_tasks import tracking
name, out = sys.argv[1], Path(sys.argv[2])
if name == "bad":
    sys.exit("bad stage: deliberate failure XYZZY")
with tracking.stage_run(name, {"lr": 0.1, "name": name}):
    tracking.log_metrics({"score": len(name)})
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps({"stage": name}))
"""


def _dvc(repo: Path, *args: str) -> None:
    out = subprocess.run([str(fl.BIN / "dvc"), *args], cwd=repo, capture_output=True, text=True)
    assert out.returncode == 0, f"dvc {args} failed:\n{out.stdout}\n{out.stderr}"


def make_repo(root: Path, with_bad: bool = False) -> Path:
    repo = root / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _dvc(repo, "init", "-q")
    (repo / "stage.py").write_text(STAGE_SCRIPT)
    (repo / "params.yaml").write_text("prep:\n  n: 1\n")
    (repo / "configs").mkdir()
    (repo / "configs" / "fast.yaml").write_text("prep:\n  n: 2\n")
    bad = f"""
  bad:
    cmd: {PY} stage.py bad out/bad.json
    deps: [out/prep.json]
    outs: [out/bad.json]""" if with_bad else ""
    (repo / "dvc.yaml").write_text(textwrap.dedent(f"""\
        stages:
          prep:
            cmd: {PY} stage.py prep out/prep.json
            deps: [stage.py]
            params: [prep]
            outs: [out/prep.json]
          train:
            foreach: [x, y]
            do:
              cmd: {PY} stage.py train_${{item}} out/train_${{item}}.json
              deps: [out/prep.json]
              outs: ["out/train_${{item}}.json"]
          grid:
            matrix:
              m: [x]
              k: [1, 2]
            cmd: {PY} stage.py grid out/grid_${{item.m}}_${{item.k}}.json
            deps: ["out/train_${{item.m}}.json"]
            outs: ["out/grid_${{item.m}}_${{item.k}}.json"]""") + bad + "\n")
    return repo


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture()
def env(tmp_path, monkeypatch):
    store = tmp_path / "mlflow"
    store.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}/mlflow.db")
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(store / "artifacts"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "flow-test")
    monkeypatch.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    return store


def test_discovery_expands_foreach_and_matrix_in_order(tmp_path):
    repo = make_repo(tmp_path)
    stages = fl.discover_stages(repo)
    assert list(stages) == ["prep", "train@x", "train@y", "grid@x-1", "grid@x-2"]
    assert stages["grid@x-2"] == ["train@x"] and stages["prep"] == []
    assert fl.plan(stages, ["grid@x-1"]) == ["prep", "train@x", "grid@x-1"]
    assert fl.plan(stages, ["train"]) == ["prep", "train@x", "train@y"]
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        fl.plan(stages, ["nope"])


def _runs(experiment: str = "flow-test"):
    import mlflow

    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id], max_results=200)


def test_flow_nested_runs_skip_and_push_pull(tmp_path, harness, env):
    repo = make_repo(tmp_path)
    remote = tmp_path / "remote"
    _dvc(repo, "remote", "add", "--local", "-d", "store", str(remote))
    result = fl.rcgrpo(profile="fast", stages=["train@x"], repo_dir=str(repo), transfer_retries=0)
    assert result["stages"] == {"prep": "ran", "train@x": "ran"}
    assert "n: 2" in (repo / "params.yaml").read_text()  # the profile was materialized for DVC
    client, runs = _runs()
    parent = client.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["rcgrpo.plan"] == "prep,train@x" and "dvc.lock.sha256" in parent.data.tags
    assert parent.data.tags["dvc.lock.train/x"] and parent.data.params["params.prep.n"] == "2"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == ["prep", "train_x"]
    assert all(r.data.metrics["score"] > 0 for r in children)
    assert {r.data.tags["dvc.stage"] for r in children} == {"prep", "train@x"}
    assert any(remote.rglob("*")), "dvc push put nothing in the remote"

    again = fl.rcgrpo(profile="fast", stages=["train@x"], repo_dir=str(repo), transfer_retries=0)
    assert again["stages"] == {"prep": "skipped", "train@x": "skipped"}
    _, runs2 = _runs()
    assert not [r for r in runs2 if r.data.tags.get("mlflow.parentRunId") == again["parent_run_id"]]

    clone = tmp_path / "clone"
    shutil.copytree(repo, clone, ignore=shutil.ignore_patterns("out", "cache", "tmp"))
    _dvc(clone, "pull", "train@x")
    assert json.loads((clone / "out/train_x.json").read_text()) == {"stage": "train_x"}


def test_failing_stage_fails_flow_with_its_own_error(tmp_path, harness, env):
    repo = make_repo(tmp_path, with_bad=True)
    with pytest.raises(fl.StageFailed, match="XYZZY"):
        fl.rcgrpo(stages=["bad"], repo_dir=str(repo), push=False, pull=False)
    client, runs = _runs()
    parents = [r for r in runs if r.info.run_name == "rcgrpo-flow"]
    assert parents[0].info.status == "FAILED" and "XYZZY" in parents[0].data.tags["rcgrpo.error"]
    assert (repo / "out/prep.json").exists() and not (repo / "out/bad.json").exists()


def test_tracking_down_fails_before_any_stage(tmp_path, harness, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    repo = make_repo(tmp_path)
    from rcgrpo_tasks.tracking import TrackingError

    with pytest.raises(TrackingError, match="unreachable"):
        fl.rcgrpo(repo_dir=str(repo), push=False, pull=False)
    assert not (repo / "out").exists()


@pytest.mark.slow  # the same fault against real S3 runs in tests/test_stack_integration.py
def test_push_failure_is_retried_then_fails_clearly(tmp_path, harness, env):
    repo = make_repo(tmp_path)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the remote folder should be")
    _dvc(repo, "remote", "add", "--local", "-d", "broken", str(blocker / "remote"))
    with pytest.raises(fl.TransferFailed, match=r"dvc push .* failed \(exit \d+, attempt 3/3\)"):
        fl.rcgrpo(stages=["prep"], repo_dir=str(repo), pull=False, transfer_retries=2, retry_delay_s=0.1)
    assert (repo / "out/prep.json").exists()  # the stage itself finished; a re-run will skip it


def test_remote_from_env_goes_to_config_local_only(tmp_path, monkeypatch):
    repo = make_repo(tmp_path)
    assert fl.ensure_remote(repo) is None  # nothing configured, nothing in the env: no remote
    monkeypatch.setenv("RCGRPO_DVC_REMOTE_URL", "s3://bucket/dvc")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SECRET-NOT-IN-CONFIG")
    assert fl.ensure_remote(repo) == "shared"
    local = (repo / ".dvc" / "config.local").read_text()
    assert "s3://bucket/dvc" in local and "http://127.0.0.1:9" in local
    assert "SECRET-NOT-IN-CONFIG" not in local and "shared" not in (repo / ".dvc" / "config").read_text()
