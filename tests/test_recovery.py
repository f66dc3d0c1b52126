"""A stage SIGKILLed under `dvc repro`, then `dvc repro` again, whether the rerun runs the stage or DVC restores it
from its run cache: `dvc status` clean, `git status` clean (no lock, marker or temp left, tracked or not), and
the killed stage's MLflow run ended KILLED with the reason. A tiny DVC project with the pipeline's root stage
(`rcgrpo check-params` on the committed params, its run-folder dep) and one stage written as every stage is
(`cli.guarded`, `tracking.published_run`: claimed outputs, staged temps, an MLflow run). Also the run folder's
parts on their own: locks out of the output folders, a dead holder's temps removed by the next one, the sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from rcgrpo_tasks.ops import outputs, recovery, rundir
from rcgrpo_tasks.stages.check_params import CHECKED

BIN = Path(sys.executable).parent
STAGE = """
import os, sys, time
from pathlib import Path
from rcgrpo_tasks.cli import guarded
from rcgrpo_tasks.ops import tracking
model, metrics = Path(sys.argv[1]), Path(sys.argv[2])

def body():
    with tracking.published_run("work", {"x": 1}, outputs=(model, metrics)) as (run, staged):
        (staged.dir(model) / "w.bin").write_bytes(b"weights")
        staged.file(metrics).write_text('{"m": 1}\\n')
        if os.environ.get("HANG"):
            Path(os.environ["HANG"]).write_text(run.info.run_id)
            time.sleep(300)
    return 0

sys.exit(guarded("rollout", body))
"""
DVC_YAML = """\
stages:
  check_params:
    cmd: rcgrpo check-params --params params.yaml --out .rcgrpo/params-checked
    deps: [params.yaml, .rcgrpo/run]
    outs:
      - .rcgrpo/params-checked: {cache: false, persist: true}
  work:
    cmd: python stage.py results/work/model results/work/metrics.json
    deps: [.rcgrpo/params-checked, stage.py]
    outs: [results/work/model]
    metrics:
      - results/work/metrics.json: {cache: false}
"""


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_", "HANG"))}
    env.update({"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "PYTHONPATH": str(REPO_ROOT),
                "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db", "MLFLOW_EXPERIMENT_NAME": "recovery", **extra})
    return env


def _sh(repo: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=repo, env=_env(repo.parent), capture_output=True, text=True, timeout=300)
    assert not check or done.returncode == 0, done.stdout + done.stderr
    return done


def _git(repo: Path, *args: str) -> str:
    return _sh(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", *args).stdout


@pytest.fixture()
def project(tmp_path) -> Path:
    repo = tmp_path / "repo"
    (repo / ".rcgrpo" / "run").mkdir(parents=True)
    (repo / ".rcgrpo" / "run" / ".gitkeep").touch()
    (repo / ".rcgrpo" / "params-checked").write_text(CHECKED)
    (repo / "params.yaml").write_text((REPO_ROOT / "params.yaml").read_text())
    (repo / "stage.py").write_text(STAGE.replace("python", sys.executable))
    (repo / "dvc.yaml").write_text(DVC_YAML.replace("cmd: python", f"cmd: {sys.executable}"))
    (repo / ".gitignore").write_text("/.rcgrpo/run/*\n!/.rcgrpo/run/.gitkeep\n/results/work/model\n")
    _git(repo, "init", "-q")
    _sh(repo, str(BIN / "dvc"), "init", "-q")
    (repo / ".dvcignore").write_text((REPO_ROOT / ".dvcignore").read_text())
    _sh(repo, str(BIN / "dvc"), "repro")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "a finished run")
    return repo


def _runs(root: Path) -> dict[str, tuple[str, str]]:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("recovery")
    return {r.info.run_id: (r.info.status, r.data.tags.get("rcgrpo.error", ""))
            for r in client.search_runs([exp.experiment_id])}


@pytest.mark.parametrize("rerun", ["run cache", "real rerun"])
def test_a_killed_stage_then_one_dvc_repro_leaves_a_clean_checkout_and_no_running_run(project, rerun):
    repo = project
    hang = repo.parent / "hang"
    proc = subprocess.Popen([str(BIN / "dvc"), "repro", "-f", "work"], cwd=repo, start_new_session=True,
                            env=_env(repo.parent, HANG=str(hang)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not hang.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert hang.is_file(), "the stage never reached its work"
    time.sleep(0.2)  # the run id is written: the stage is inside its run, outputs staged
    os.killpg(proc.pid, signal.SIGKILL)  # dvc and the stage: nothing of ours runs after this
    proc.wait()
    killed = hang.read_text()
    left = sorted(p.name for p in (repo / ".rcgrpo" / "run").iterdir())
    assert any(n.startswith(rundir.MARKER_PREFIX) for n in left) and any(n.endswith(".lock") for n in left), left
    assert not list((repo / "results").rglob("*.lock"))  # no lock inside an output folder
    assert list((repo / "results" / "work").glob(".model.*.tmp")), "the staged temps a kill leaves"
    assert _runs(repo.parent)[killed][0] == "RUNNING"
    assert "check_params" in _sh(repo, str(BIN / "dvc"), "status").stdout  # the run folder is its dep

    args = ["repro"] if rerun == "run cache" else ["repro", "--force"]  # --no-run-cache restores it still (3.67)
    done = _sh(repo, str(BIN / "dvc"), *args)
    ran = [ln.split("'")[1] for ln in done.stdout.splitlines() if ln.startswith("Running stage")]
    assert ran == (["check_params"] if rerun == "run cache" else ["check_params", "work"]), done.stdout
    if rerun == "run cache":
        assert "Stage 'work' is cached - skipping run" in done.stdout, done.stdout
    assert "recovered after a killed process" in done.stderr and "work (pid" in done.stderr, done.stderr
    assert "Data and pipelines are up to date." in _sh(repo, str(BIN / "dvc"), "status").stdout
    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    assert sorted(p.name for p in (repo / ".rcgrpo" / "run").iterdir()) == [".gitkeep"]
    assert not [p for p in (repo / "results").rglob(".*") if p.name != ".gitignore"]
    status, error = _runs(repo.parent)[killed]
    assert status == "KILLED" and "its process ended without closing it" in error, (status, error)
    assert "closed by rcgrpo check-params" in error, error
    assert (repo / "results" / "work" / "model" / "w.bin").read_bytes() == b"weights"


def test_locks_live_in_the_run_folder_and_the_next_holder_removes_a_dead_ones_temps(tmp_path):
    root = tmp_path / "checkout"
    (root / rundir.RUN_DIR).mkdir(parents=True)
    out = root / "models" / "rl" / "0" / "cell"
    holder = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os
        from rcgrpo_tasks.ops import outputs
        with outputs.atomic_outputs() as staged:
            (staged.dir({str(out)!r}) / "half").write_text("x")
            os._exit(9)  # killed mid-write: no cleanup runs
        """)], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert holder.returncode == 9
    lock = outputs.lock_path(out)
    assert lock.parent == root / rundir.RUN_DIR and lock.name == "models%2Frl%2F0%2Fcell.lock"
    temps = list(out.parent.glob(".cell.*.tmp"))
    assert len(temps) == 1 and str(temps[0]) in lock.read_text()
    with outputs.atomic_dir(out) as tmp:  # the next writer: the dead one's temp goes first
        assert not temps[0].exists()
        (tmp / "w").write_text("w")
    assert (out / "w").read_text() == "w" and not lock.exists() and not list(out.parent.glob(".*"))


def test_the_sweep_takes_only_what_no_live_process_holds(tmp_path, store):
    root = tmp_path / "checkout"
    run = root / rundir.RUN_DIR
    run.mkdir(parents=True)
    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        os.chdir({str(root)!r})
        from rcgrpo_tasks.ops import outputs, rundir
        with rundir.marker("rcgrpo evaluate"), outputs.output_lock("results/eval/x"):
            print("held", flush=True)
            time.sleep(60)
        """)], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "held"
        dead = run / f"{rundir.MARKER_PREFIX}1-1.json"
        dead.write_text(json.dumps({"pid": 1, "what": "rcgrpo rl", "dvc_stage": "rl_rctp@0-rc_grpo"}) + "\n")
        found = recovery.recover(root / "results", "a test", echo=lambda _: None)
        assert [(s.kind, s.holder) for s in found["swept"]] == [("process", "rl_rctp@0-rc_grpo (pid 1)")]
        assert len(list(run.iterdir())) == 2  # the live holder's marker and lock stay
    finally:
        live.kill()
        live.wait()
    assert {s.kind for s in rundir.sweep(run)} == {"process", "lock"} and list(run.iterdir()) == []
