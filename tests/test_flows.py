"""The Prefect flow on a tiny synthetic DVC repo: discovery, plan, nested MLflow runs, skip on re-run,
stage failure, tracking preflight, push/pull through a local-folder DVC remote and retried transfers.
Uses Prefect's test harness (a temporary local API) and a temp sqlite MLflow store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))
from flows import rcgrpo_flow as fl  # noqa: E402

PY = sys.executable
STAGE_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from rcgrpo_tasks.cli import guarded
from rcgrpo_tasks.ops import tracking, tracking_log
name, out = sys.argv[1], Path(sys.argv[2])

def body():
    with tracking.stage_run(name.split("_")[0], {"lr": 0.1, "name": name}):  # train_x under train@x
        tracking_log.log_metrics({"score": len(name)})
        if name == "bad":
            print("some progress on stdout")
            sys.exit("bad stage: deliberate failure XYZZY")
        if name == "slow":
            Path("slow.pid").write_text(str(os.getpid()))
            time.sleep(120)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"stage": name}))
    return 0

sys.exit(guarded("stage", body))
"""


def _dvc(repo: Path, *args: str) -> None:
    out = subprocess.run([str(fl.BIN / "dvc"), *args], cwd=repo, capture_output=True, text=True)
    assert out.returncode == 0, f"dvc {args} failed:\n{out.stdout}\n{out.stderr}"


def make_repo(root: Path, with_bad: bool = False, with_slow: bool = False) -> Path:
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
    bad += f"""
  slow:
    cmd: {PY} stage.py slow out/slow.json
    outs: [out/slow.json]""" if with_slow else ""
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
    (repo / ".gitignore").write_text("/out\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], cwd=repo,
                   check=True)  # the committed params.yaml is the pristine base every profile starts from
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
    assert parent.info.status == "FINISHED" and parent.info.run_name == "pipeline@fast"
    assert parent.data.tags["rcgrpo.plan"] == "prep,train@x" and "dvc.lock.sha256" in parent.data.tags
    assert parent.data.tags["dvc.lock.train/x"] and parent.data.params["params.prep.n"] == "2"
    assert parent.data.tags["rcgrpo.profile"] == "fast" and len(parent.data.tags["rcgrpo.params_sha256"]) == 16
    assert parent.data.tags["git.commit"] != "unknown"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == ["prep", "train@x"]  # <stage>@<variant>
    exp = client.get_experiment_by_name("flow-test")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on the runs
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
    with pytest.raises(fl.StageFailed) as err:
        fl.rcgrpo(stages=["bad"], repo_dir=str(repo), push=False, pull=False)
    first = str(err.value).splitlines()[0]
    assert first == "stage 'bad' failed (exit 1): bad stage: deliberate failure XYZZY"  # what --watch shows
    assert "--- last stderr lines of bad ---" in str(err.value)
    assert "some progress on stdout" not in str(err.value)  # stderr only: the cause, not the chatter
    client, runs = _runs()
    parents = [r for r in runs if r.info.run_name == "pipeline@default"]
    assert parents[0].info.status == "FAILED" and "XYZZY" in parents[0].data.tags["rcgrpo.error"]
    assert parents[0].data.tags["rcgrpo.failed_stage"] == "bad"
    assert json.loads(parents[0].data.tags["rcgrpo.results"]) == {"prep": "ran", "bad": "failed"}  # what finished
    bad = [r for r in runs if r.info.run_name == "bad"][0]
    assert bad.info.status == "FAILED" and "XYZZY" in bad.data.tags["rcgrpo.error"]
    assert (repo / "out/prep.json").exists() and not (repo / "out/bad.json").exists()


def test_failure_message_names_stage_exit_code_and_cause():
    err = "Traceback...\nValueError: boom\nERROR: failed to reproduce 'x': failed to run: rcgrpo x, exited with 3"
    msg = fl.failure_message("x", 255, err)
    assert msg.splitlines()[0] == "stage 'x' failed (exit 3): ValueError: boom"
    assert fl.failure_message("y", 1, "").startswith("stage 'y' failed (exit 1): no error output")


def test_dvcs_missing_cache_warning_is_explained_once_where_it_appears():
    warning = ("WARNING: Some of the cache files do not exist neither locally nor on remote. Missing cache files:")
    note = fl.missing_cache_note(warning, "minio")
    assert note is not None and "remote 'minio' holds no copy" in note and "run again" in note
    assert fl.missing_cache_note("name: data/split.json, md5: 0123", "minio") is None


def test_unknown_profile_fails_first_and_leaves_params_untouched(tmp_path, harness, env):
    from rcgrpo_tasks.ops.config import ConfigError

    repo = make_repo(tmp_path)
    before = (repo / "params.yaml").read_bytes()
    with pytest.raises(ConfigError, match=r"unknown profile 'fsat'; valid profiles: default, fast"):
        fl.rcgrpo(profile="fsat", repo_dir=str(repo), push=False, pull=False)
    assert (repo / "params.yaml").read_bytes() == before and not (repo / "out").exists()
    import os

    import mlflow

    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert client.get_experiment_by_name("flow-test") is None  # failed before any tracking


def test_profile_never_leaks_into_the_next_run(tmp_path, harness, env):
    repo = make_repo(tmp_path)
    pristine = (repo / "params.yaml").read_bytes()
    fl.rcgrpo(profile="fast", stages=["prep"], repo_dir=str(repo), push=False, pull=False)
    assert "n: 2" in (repo / "params.yaml").read_text()
    result = fl.rcgrpo(stages=["prep"], repo_dir=str(repo), push=False, pull=False)  # default profile
    assert (repo / "params.yaml").read_bytes() == pristine and result["stages"] == {"prep": "ran"}
    client, _ = _runs()
    assert client.get_run(result["parent_run_id"]).data.tags["rcgrpo.profile"] == "default"


def test_stage_timeout_stops_the_whole_group_and_ends_its_run_killed(tmp_path, harness, env):
    import time

    from rcgrpo_tasks.ops import stops

    repo = make_repo(tmp_path, with_slow=True)
    with pytest.raises(BaseException) as err:
        fl.rcgrpo(stages=["slow"], repo_dir=str(repo), push=False, pull=False, stage_timeout_s=30)
    assert "timed out" in str(err.value).lower()  # the stage sleeps 120 s: the timeout, not its end, stopped it
    pid = int((repo / "slow.pid").read_text())
    deadline = time.monotonic() + 10
    while stops.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not stops.alive(pid), "the stage outlived its cancelled task"
    assert not stops.group_alive(pid)  # nor did anything else of its process group
    assert not (repo / "out/slow.json").exists()
    _, runs = _runs()
    slow = [r for r in runs if r.info.run_name == "slow"][0]
    assert slow.info.status == "KILLED" and "SIGTERM" in slow.data.tags["rcgrpo.error"]
    parent = [r for r in runs if r.info.run_name == "pipeline@default"][0]
    assert parent.info.status == "KILLED"


def test_tracking_down_fails_before_any_stage(tmp_path, harness, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    repo = make_repo(tmp_path)
    from rcgrpo_tasks.ops.tracking_store import TrackingError

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


def _waits_for(me: str, other: str) -> str:
    """A command that marks itself started and succeeds only if `other` starts while it runs (<= 30 s)."""
    return (f"bash -c 'touch out/{me}.started; for i in $(seq 300); do [ -f out/{other}.started ] && break; sleep 0.1; "
            f"done; [ -f out/{other}.started ] && echo {me} > out/{me}.txt'")


def test_independent_stages_run_side_by_side_and_dvc_records_every_one(tmp_path, harness, env):
    """`jobs=2`: the two stages after `prep` succeed only if each starts while the other runs; what depends on
    both waits for both; DVC's lineage intact after (`dvc status` clean, every stage in dvc.lock, no lock error)."""
    import yaml

    repo = make_repo(tmp_path)
    side = {"left": {"cmd": _waits_for("left", "right"), "deps": ["out/prep.json"], "outs": ["out/left.txt"]},
            "right": {"cmd": _waits_for("right", "left"), "deps": ["out/prep.json"], "outs": ["out/right.txt"]},
            "both": {"cmd": "cat out/left.txt out/right.txt > out/both.txt",
                     "deps": ["out/left.txt", "out/right.txt"], "outs": ["out/both.txt"]}}
    pipeline = yaml.safe_load((repo / "dvc.yaml").read_text())
    pipeline["stages"].update(side)
    (repo / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    result = fl.rcgrpo(stages=["both"], repo_dir=str(repo), push=False, pull=False, jobs=2)
    assert result["stages"] == {"prep": "ran", "left": "ran", "right": "ran", "both": "ran"}
    assert (repo / "out" / "both.txt").read_text() == "left\nright\n"
    status = subprocess.run([str(fl.BIN / "dvc"), "status", "--with-deps", "both"], cwd=repo, capture_output=True,
                            text=True)
    assert "Data and pipelines are up to date." in status.stdout, status.stdout + status.stderr


def test_a_bad_value_anywhere_fails_the_flow_before_its_mlflow_run_opens(tmp_path, harness, env):
    """A project that declares the root check: the flow checks the params it is about to write, whole, first."""
    import mlflow
    import yaml

    repo = make_repo(tmp_path)
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["grid"]["seeds"] = [0, 0]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (repo / "dvc.yaml").write_text((repo / "dvc.yaml").read_text().replace(
        "stages:\n", f"stages:\n  check_params:\n    cmd: {PY} -c pass\n", 1))
    before = (repo / "params.yaml").read_bytes()
    with pytest.raises(Exception, match=r"params.yaml.*:grid: seeds: distinct integers >= 0, at least one, got \[0, 0\]"):
        fl.rcgrpo(repo_dir=str(repo), push=False, pull=False)
    assert (repo / "params.yaml").read_bytes() == before and not (repo / "out").exists()
    assert mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).get_experiment_by_name("flow-test") is None
