"""The parent flow across work pools on a synthetic DVC project: two real process workers, each in its own
directory (its own clone, DVC cache, HOME and TMPDIR), against Prefect's test server, a local-folder DVC
remote and a temp sqlite MLflow store; the project's git is a bare repository the workers fetch from.

Checked: the parent's dvc.lock entries equal a local `dvc repro`'s at the same commit (a `cache: false` output
too, in the parent's workspace); independent stages ran at once on different workers (the stage runs' own
start/end and the worker tags); every stage's MLflow run is a child of the parent, tagged with its worker;
nothing was written outside the workers' directories, the remote, the parent's checkout and the stores; a rerun
dispatches nothing; a stage on a pool no worker serves fails naming the stage and the pool, nothing recorded.
The real stack and the smoke grid: tests/test_grid_stack.py. Marked `slow` (two workers and a Prefect server:
~2 min of a core).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))
from flows import dvc_lock  # noqa: E402

pytestmark = pytest.mark.slow
PY = sys.executable
BIN = Path(PY).parent
STAGE = """
import json, os, sys, time
from pathlib import Path
from rcgrpo_tasks.cli import guarded
from rcgrpo_tasks.ops import tracking, tracking_log
name, out, nap = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])

def body():
    with tracking.stage_run(name, {"nap": nap}):
        src = [p.read_text() for p in map(Path, sys.argv[4:])]
        time.sleep(nap)  # long enough that two stages side by side overlap
        tracking_log.log_metrics({"inputs": len(src)})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"stage": name, "inputs": src}, sort_keys=True))
    Path("metrics").mkdir(exist_ok=True)
    Path(f"metrics/{name}.json").write_text(json.dumps({"n": len(src)}))
    return 0

sys.exit(guarded("stage", body))
"""


def dvc_yaml() -> str:
    def stage(name: str, deps: list[str], nap: float) -> str:
        return textwrap.dedent(f"""\
          {name}:
            cmd: python stage.py {name} out/{name}.json {nap} {' '.join(deps)}
            deps: [stage.py, {', '.join(deps) if deps else 'stage.py'}]
            params: [prep]
            outs: [out/{name}.json]
            metrics:
              - metrics/{name}.json: {{cache: false}}
        """)
    body = stage("prep", [], 0) + stage("left", ["out/prep.json"], 6) + stage("right", ["out/prep.json"], 6) + \
        stage("join", ["out/left.json", "out/right.json"], 0)
    return "stages:\n" + textwrap.indent(body, "  ")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def make_origin(root: Path) -> tuple[Path, str]:
    """A bare repository holding the project (the stage script, dvc.yaml, params, a profile); its commit."""
    work = root / "seed"
    work.mkdir()
    git(work, "init", "-q")
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=work, check=True)
    (work / "stage.py").write_text(STAGE)
    (work / "dvc.yaml").write_text(dvc_yaml())
    # mode: the string "off", which DVC's YAML 1.2 keeps and YAML 1.1 reads as false: a lock read the other way
    # would hold a value params.yaml does not, and the rerun would find the stage stale
    (work / "params.yaml").write_text('prep:\n  n: 1\n  mode: "off"\nresources:\n  stages: {}\n')
    (work / "configs").mkdir()
    (work / "configs" / "two.yaml").write_text("prep:\n  n: 2\n")
    (work / ".gitignore").write_text("/out\n")
    git(work, "add", "-A")
    git(work, "commit", "-qm", "project")
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(root / "origin.git")], check=True)
    return root / "origin.git", git(work, "rev-parse", "HEAD")


def files_under(root: Path, skip: list[Path]) -> set[str]:
    return {str(p) for p in root.rglob("*") if p.is_file() and not any(p.is_relative_to(s) for s in skip)}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    root = tmp_path_factory.mktemp("grid")
    origin, commit = make_origin(root)
    remote = root / "remote"
    store = root / "mlflow"
    store.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
    env.update({"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db",
                "MLFLOW_EXPERIMENT_NAME": "grid-test", "RCGRPO_DVC_REMOTE_URL": str(remote),
                "PYTHONDONTWRITEBYTECODE": "1", "PREFECT_WORKER_QUERY_SECONDS": "1",
                "PREFECT_WORKER_PREFETCH_SECONDS": "1", "RCGRPO_CODE_DIR": str(REPO_ROOT)})
    workers: list[subprocess.Popen] = []
    with prefect_test_harness(server_startup_timeout=180):
        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", "rcgrpo-cpu", "--type", "process"], env=env,
                       check=True, capture_output=True)
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", "rcgrpo-gpu", "--type", "process"], env=env,
                       check=True, capture_output=True)
        for kind in ("cpu", "gpu"):
            deploy = (f"from flows.stage_flow import stage\nstage.from_source({str(REPO_ROOT)!r}, "
                      f"'flows/stage_flow.py:stage').deploy(name={kind!r}, work_pool_name='rcgrpo-{kind}', "
                      f"parameters={{'repository': {str(origin)!r}}}, print_next_steps=False)")
            subprocess.run([PY, "-c", deploy], env=env, cwd=REPO_ROOT, check=True, capture_output=True)
        for name in ("w1", "w2"):
            home = root / name
            (home / "tmp").mkdir(parents=True)
            wenv = {**env, "RCGRPO_WORKER_DIR": str(home), "HOME": str(home), "TMPDIR": str(home / "tmp"),
                    "PREFECT_HOME": str(home / "prefect")}
            log = open(root / f"{name}.log", "w")  # noqa: SIM115 (closed with the worker)
            workers.append(subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "rcgrpo-cpu",
                                             "--name", name, "--limit", "1"], env=wenv, cwd=home, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True))
        parent = root / "parent"
        subprocess.run(["git", "clone", "-q", str(origin), str(parent)], check=True)
        subprocess.run([str(BIN / "dvc"), "remote", "add", "--local", "-d", "shared", str(remote)], cwd=parent,
                       check=True)
        try:
            yield {"root": root, "origin": origin, "commit": commit, "env": env, "parent": parent, "remote": remote,
                   "store": store}
        finally:
            for proc in workers:
                os.killpg(proc.pid, 15)
            for proc in workers:  # a worker busy on a loaded host may outlive SIGTERM's grace: then SIGKILL
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    proc.wait(timeout=60)


def run_parent(grid, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [PY, str(REPO_ROOT / "flows" / "rcgrpo_flow.py"), "--dispatch", "pools", "--retry-delay-s", "1", *args]
    return subprocess.run(cmd, cwd=grid["parent"], env={**grid["env"], "RCGRPO_DVC_REMOTE_URL": ""},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def first(grid):
    done = run_parent(grid, "--profile", "two", "--no-worker-s", "20")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_parent_lock_equals_a_local_repro_of_the_commit(grid, first):
    assert first["stages"] == {"prep": "ran", "left": "ran", "right": "ran", "join": "ran"}
    local = grid["root"] / "local"
    subprocess.run(["git", "clone", "-q", str(grid["origin"]), str(local)], check=True)
    (grid["root"] / "local-store").mkdir()
    env = {**grid["env"], "MLFLOW_TRACKING_URI": f"sqlite:///{grid['root']}/local-store/mlflow.db"}
    subprocess.run([str(BIN / "rcgrpo"), "params", "--profile", "two"], cwd=local, env=env, check=True,
                   capture_output=True)
    done = subprocess.run([str(BIN / "dvc"), "repro"], cwd=local, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    ours, theirs = dvc_lock.read_entries(grid["parent"]), dvc_lock.read_entries(local)
    assert ours == theirs
    assert (grid["parent"] / "metrics" / "join.json").read_text() == (local / "metrics" / "join.json").read_text()
    pulled = subprocess.run([str(BIN / "dvc"), "pull"], cwd=grid["parent"], env=grid["env"], capture_output=True,
                            text=True)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert (grid["parent"] / "out" / "join.json").read_bytes() == (local / "out" / "join.json").read_bytes()
    status = subprocess.run([str(BIN / "dvc"), "status"], cwd=grid["parent"], capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout


def _runs(grid) -> list:
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{grid['store']}/mlflow.db")
    exp = client.get_experiment_by_name("grid-test")
    return client.search_runs([exp.experiment_id], max_results=100)


def test_independent_stages_overlap_on_two_workers_under_one_lineage(grid, first):
    runs = {r.info.run_name: r for r in _runs(grid)}
    parent = runs["pipeline@two"]
    for name in ("prep", "left", "right", "join"):
        run = runs[name]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id, name
        assert run.data.tags["rcgrpo.worker.dir"].startswith(str(grid["root"] / "w")), run.data.tags
    left, right = runs["left"], runs["right"]
    assert left.data.tags["rcgrpo.worker.name"] != right.data.tags["rcgrpo.worker.name"]
    assert left.info.start_time < right.info.end_time and right.info.start_time < left.info.end_time


def test_nothing_written_outside_the_workers_the_remote_and_the_parent(grid, first):
    root = grid["root"]
    allowed = [root / "w1", root / "w2", grid["remote"], grid["remote"].with_name("remote-prefect-results"),
               grid["parent"], grid["store"], grid["origin"], root / "seed", root / "local", root / "local-store"]
    stray = {p for p in files_under(root, allowed) if not p.endswith(".log")}
    assert not stray, stray
    assert git(grid["origin"], "rev-parse", "HEAD") == grid["commit"]  # the workers only read git


def test_a_rerun_dispatches_nothing(grid, first):
    done = run_parent(grid, "--profile", "two")
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["stages"].values()) == {"skipped"}, result


def test_a_stage_on_a_pool_without_workers_fails_naming_it_and_records_nothing(grid, first):
    profile = grid["parent"] / "gpu-prep.yaml"
    profile.write_text("prep:\n  n: 3\nresources:\n  stages:\n    left: {gpu: 1}\n")
    before = dvc_lock.read_entries(grid["parent"])
    t0 = time.monotonic()
    done = run_parent(grid, "--profile", f"two+{profile}", "--no-worker-s", "10")
    text = done.stdout + done.stderr
    assert done.returncode != 0
    assert "stage 'left' (gpu: 1) waited 10 s on work pool 'rcgrpo-gpu', which has no worker online" in text, text[-3000:]
    entries = dvc_lock.read_entries(grid["parent"])
    assert "left" not in {k for k, v in entries.items() if v != before.get(k)}
    print(f"no-worker refusal in {time.monotonic() - t0:.0f} s")
