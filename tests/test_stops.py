"""Clean stops: a signal to `dvc repro` leaves no stage process behind and no
output; a process group is stopped whole; a real MLflow server lost mid-stage ends the stage within a
minute with one clear line, and no run stays RUNNING."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT, free_port_base

from rcgrpo_tasks.ops import stops

BIN = Path(sys.executable).parent
SLEEPER = """
import os, sys, time
from pathlib import Path
from rcgrpo_tasks.cli import guarded

def body():
    Path("stage.pid").write_text(str(os.getpid()))
    time.sleep(60)
    Path(sys.argv[1]).write_text("written after the pipeline was stopped")
    return 0

sys.exit(guarded("sleeper", body))
"""


def _wait(predicate, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def _dvc_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=repo, check=True)
    (repo / "sleeper.py").write_text(SLEEPER)
    (repo / "dvc.yaml").write_text(textwrap.dedent(f"""\
        stages:
          sleeper:
            cmd: {sys.executable} sleeper.py out.txt
            deps: [sleeper.py]
            outs: [out.txt]
        """))
    return repo


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_sigterm_to_dvc_repro_leaves_no_stage_behind(tmp_path, shell):
    """bash execs the stage (its parent is dvc: PR_SET_PDEATHSIG); sh (dash) stays in between and does
    not die with dvc (the watch thread of ops.stops.die_with_parent covers it)."""
    if not shutil.which(shell):
        pytest.skip(f"no {shell}")
    repo = _dvc_repo(tmp_path)
    env = {**os.environ, "SHELL": shutil.which(shell), "PYTHONPATH": str(REPO_ROOT)}
    dvc = subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=repo, env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _wait(lambda: (repo / "stage.pid").exists(), 90), "the stage never started"
        stage = int((repo / "stage.pid").read_text())
        dvc.send_signal(signal.SIGTERM)  # dvc alone, not its group: as `kill <dvc pid>` does
        dvc.wait(timeout=30)
        assert _wait(lambda: not stops.alive(stage), 15), "the stage outlived dvc repro"
        assert not (repo / "out.txt").exists()
    finally:
        stops.stop_group(dvc, grace_s=5)


def test_stop_group_reaches_children_after_the_leader_exits(tmp_path):
    """The leader dies at once; a child that ignores nothing is still stopped (SIGTERM), one that
    ignores SIGTERM gets SIGKILL after the grace period."""
    script = textwrap.dedent("""
        import signal, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        time.sleep(60)
    """)
    proc = stops.start_group([sys.executable, "-c", script])
    time.sleep(1.5)
    assert stops.group_alive(proc.pid)
    stops.stop_group(proc, grace_s=2)  # the one that ignores SIGTERM too: SIGKILL after the grace
    assert not stops.group_alive(proc.pid)


# -- a real MLflow server lost mid-stage --------------------------------------------------------------------

STAGE = """
import sys, time
from pathlib import Path
from rcgrpo_tasks.cli import guarded
from rcgrpo_tasks.ops import tracking, tracking_log

def body():
    with tracking.stage_run("evaluate", {"n": 1}) as run:
        tracking_log.log_metrics({"first": 1.0})
        print(run.info.run_id, flush=True)
        while not Path(sys.argv[1]).exists():  # the test stops the server, then says go
            time.sleep(0.1)
        tracking_log.log_metrics({"second": 2.0})
        Path(sys.argv[2]).write_text("must not be written: tracking failed")
    return 0

sys.exit(guarded("evaluate", body))
"""


def _server(store: Path, port: int) -> subprocess.Popen:
    cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{store}/mlflow.db", "--default-artifact-root", str(store / "art")]
    proc = stops.start_group(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    def up() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    if not _wait(up, 120, step=0.5):
        stops.stop_group(proc)
        pytest.fail("mlflow server did not start")
    return proc


@pytest.mark.slow  # starts an MLflow server twice
def test_server_lost_mid_stage_one_line_within_a_minute_no_running_run(tmp_path, monkeypatch):
    store = tmp_path / "store"
    store.mkdir()
    port = free_port_base(span=1)
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lost-server")
    monkeypatch.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    server = _server(store, port)
    go, out = tmp_path / "go", tmp_path / "out.txt"
    stage = subprocess.Popen([sys.executable, "-c", STAGE, str(go), str(out)], cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_id = stage.stdout.readline().strip()
        assert run_id, stage.stderr.read()
        stops.stop_group(server, grace_s=10)
        t0 = time.monotonic()
        go.write_text("go")
        _, err = stage.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if stage.poll() is None:
            stage.kill()
    print(f"stage gave up {elapsed:.1f} s after the server stopped")  # bounded retries; no bound asserted here
    assert stage.returncode == 2 and not out.exists()
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"error: rcgrpo evaluate: MLflow log_metrics failed (tracking URI {uri}): connection refused"]

    server = _server(store, port)  # the server is back: the next stage start (or the flow's end) reaps
    try:
        from rcgrpo_tasks.ops import tracking

        assert run_id in tracking.reap_orphans()
        import mlflow

        client = mlflow.MlflowClient(uri)
        assert client.get_run(run_id).info.status == "KILLED"
        exp = client.get_experiment_by_name("lost-server")
        assert not client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")
    finally:
        stops.stop_group(server, grace_s=10)


def test_unreachable_server_fails_a_tracked_command_in_seconds(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port_base(span=1)}")
    r = subprocess.run([str(BIN / "rcgrpo"), "report", "--help-not-reached"], capture_output=True, text=True,
                       cwd=REPO_ROOT, timeout=60)  # a hang guard; the seconds: bench/refusals.py
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "is unreachable (connection refused)" in lines[0], r.stderr
