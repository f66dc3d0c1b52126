"""The smoke grid across work pools on the real local stack (SeaweedFS S3 as the DVC remote, the MLflow and
Prefect servers): two process workers, each in its own directory (its own clone, DVC cache, HOME, TMPDIR and
Prefect home), run the smoke profile's RL cells and everything upstream of them (13 stages, the tiny
random-init model as the base) through the parent flow (`--dispatch pools`), from a bare repository holding a
snapshot of this working tree. One worker is SIGKILLed, with every process under it, while it runs a stage.

Checked: the parent's dvc.lock entries equal a local `dvc repro` of the same commit (records, which hold wall times,
by path); stages overlapped on the two workers (the stage runs' own times and worker tags); the killed stage's run
CRASHED (its heartbeats stopped), it ran again on the other worker, the parent says so naming the stage and the
worker; every object in the remote is whole (its md5 is its name); no file was written outside the workers'
directories, the remote's, the parent's and the local clone's; a rerun dispatches nothing; the S3 server down fails
the parent naming the stage, the worker and the transfer, recording nothing, and a rerun after it is back runs only
that stage; two parents started at once on the commit share each stage run. Marked `integration` and `slow`; every
process it starts is stopped in a finalizer. Its timings: bench/grid_workers.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, copy_tree, free_port_base

sys.path.insert(0, str(REPO_ROOT))
from flows import dvc_lock  # noqa: E402
from rcgrpo_tasks.ops import stack as st  # noqa: E402
from rcgrpo_tasks.ops import stack_grid, stack_state  # noqa: E402
from rcgrpo_tasks.ops.pipeline import dvc_stages  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PY = sys.executable
BIN = Path(PY).parent
KEY, SECRET = f"gridKEY{secrets.token_hex(6)}", f"gridSECRET{secrets.token_hex(12)}"
TARGET = "rl_rctp"
"""The smoke grid's RL cells (rl_rctp@0-grpo, rl_rctp@0-rc_grpo) and everything upstream of them."""
KILLED = "rl_rctp@0-rc_grpo"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True).stdout.strip()


def snapshot(root: Path, tiny_model_dir: Path) -> tuple[Path, str, str]:
    """A bare repository of this working tree with a profile layer naming the tiny model; (repo, commit, profile)."""
    seed = copy_tree(root / "seed")
    (seed / "configs" / "tiny.yaml").write_text(f"prepare_model:\n  source: {tiny_model_dir}\n")
    git(seed, "add", "-A")
    git(seed, "commit", "-qm", "snapshot")
    subprocess.run(["git", "clone", "-q", "--bare", str(seed), str(root / "origin.git")], check=True)
    return root / "origin.git", git(seed, "rev-parse", "HEAD"), "smoke+tiny"


def kill_tree(pid: int) -> list[int]:
    """SIGKILL process `pid` and every process under it (a machine lost: nothing of it cleans up)."""
    import psutil

    tree = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    for each in tree:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass
    stack_state.reap({"pid": pid})
    return tree


@pytest.fixture(scope="module")
def lab(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("gridstack")
    origin, commit, profile = snapshot(root, tiny_model_dir)
    stack = stack_state.make_stack(root / "state", port_base=free_port_base())
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "OMP_NUM_THREADS")}
    os.environ.update({"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "OMP_NUM_THREADS": "1"})
    lab = {"root": root, "origin": origin, "commit": commit, "profile": profile, "stack": stack,
           "untracked": untracked()}
    try:
        client_env = st.up(stack, grid_workers=2, git_url=str(origin))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "RCGRPO_"))}
        env.update(client_env)
        env.update({"PATH": f"{BIN}{os.pathsep}{env['PATH']}", "PYTHONDONTWRITEBYTECODE": "1"})
        lab["env"] = env
        parent = root / "parent"
        subprocess.run(["git", "clone", "-q", str(origin), str(parent)], check=True)
        st.configure_dvc(stack, parent)
        lab["parent"] = parent
        yield lab
    finally:
        st.down(stack)
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def untracked() -> set[str]:
    out = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
    return {ln for ln in out.stdout.splitlines() if ln.startswith("??")}


def worker_proc(lab: dict, name: str) -> dict:
    return stack_state.read_state(lab["stack"])["procs"][f"{stack_grid.PREFIX}{name}"]


def parent_cmd(lab: dict, *args: str) -> list[str]:
    return [PY, str(REPO_ROOT / "flows" / "rcgrpo_flow.py"), "--dispatch", "pools", "--profile", lab["profile"],
            "--retry-delay-s", "1", "--transfer-retries", "1", *args]


def parent_env(lab: dict, home: str = "parent-home") -> dict:
    return {**lab["env"], "PREFECT_HOME": str(lab["root"] / home), "RCGRPO_DVC_REMOTE_URL": ""}


def stage_runs(lab: dict) -> list:
    """Every run of the stage deployment on the server (its tags say where it ran)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: lab["env"]["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["stage"])), limit=200)


def stage_run_open(lab: dict, name: str) -> bool:
    """Whether the stage `name` has an MLflow run RUNNING (its process has started its work)."""
    import mlflow

    client = mlflow.MlflowClient(lab["env"]["MLFLOW_TRACKING_URI"])
    exps = [e.experiment_id for e in client.search_experiments()]
    return bool(client.search_runs(exps, f"attributes.run_name = '{name}' and attributes.status = 'RUNNING'"))


def worker_of(run) -> str | None:
    return next((t.split(":", 1)[1] for t in run.tags if t.startswith("worker:")), None)


@pytest.fixture(scope="module")
def grid_run(lab):
    """The grid through the parent, one worker SIGKILLed while it runs KILLED; the worker is started again after."""
    out = open(lab["root"] / "parent.log", "w")  # noqa: SIM115
    t0 = time.monotonic()
    proc = subprocess.Popen(parent_cmd(lab, "--stages", TARGET), cwd=lab["parent"], env=parent_env(lab), stdout=out,
                            stderr=subprocess.STDOUT)
    killed = None
    try:
        while proc.poll() is None and killed is None and time.monotonic() - t0 < 1500:
            running = [r for r in stage_runs(lab) if r.name == KILLED and r.state and r.state.name == "Running"
                       and worker_of(r)]
            if running and stage_run_open(lab, KILLED):  # inside the stage, not its checkout or pull
                killed = worker_of(running[0])
                kill_tree(worker_proc(lab, killed)["pid"])
            time.sleep(2)
        proc.wait(timeout=2400)
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    wall = time.monotonic() - t0
    text = (lab["root"] / "parent.log").read_text()
    assert proc.returncode == 0, text[-6000:]
    st.up(lab["stack"], grid_workers=2, git_url=str(lab["origin"]))  # the killed worker again, same directory
    print(f"grid: {wall:.0f} s, {killed} killed")
    return {"result": json.loads(text.strip().splitlines()[-1]), "text": text, "killed": killed, "wall_s": wall}


def test_the_parent_lock_equals_a_local_repro_of_the_commit(lab, grid_run):
    local = lab["root"] / "local"
    subprocess.run(["git", "clone", "-q", str(lab["origin"]), str(local)], check=True)
    (lab["root"] / "local-store").mkdir()
    env = {**lab["env"], "MLFLOW_TRACKING_URI": f"sqlite:///{lab['root']}/local-store/mlflow.db"}
    subprocess.run([str(BIN / "rcgrpo"), "params", "--profile", lab["profile"]], cwd=local, env=env, check=True,
                   capture_output=True)
    done = subprocess.run([str(BIN / "dvc"), "repro", TARGET], cwd=local, env=env, capture_output=True, text=True,
                          timeout=2400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ours, theirs = dvc_lock.read_entries(lab["parent"]), dvc_lock.read_entries(local)
    planned = set(grid_run["result"]["stages"])
    assert planned == {s for s in theirs if s in planned} and len(planned) == 13, planned
    # Records (`cache: false` metrics, plots, steps.tsv) carry each run's wall times, so two runs' bytes differ:
    # they must be the same files; everything a later stage reads (cached outputs, deps, params, cmd) equal.
    records = {s.name: set(s.records) for s in dvc_stages(local, with_status=False)}
    for name in sorted(planned):
        own = {o["path"]: o for o in ours[name]["outs"]}
        outs = [own.get(o["path"], o) if o["path"] in records[name] else o for o in theirs[name]["outs"]]
        assert ours[name] == {**theirs[name], "outs": outs}, name
    pulled = subprocess.run([str(BIN / "dvc"), "pull", *planned], cwd=lab["parent"], env=lab["env"],
                            capture_output=True, text=True)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    status = subprocess.run([str(BIN / "dvc"), "status", *planned], cwd=lab["parent"], capture_output=True, text=True)
    assert "up to date" in status.stdout, status.stdout


def test_stages_overlapped_on_two_workers_and_the_killed_one_ran_again_elsewhere(lab, grid_run):
    runs = [r for r in stage_runs(lab) if r.state and r.state.name == "Completed"]
    spans = [(r.start_time, r.end_time, worker_of(r), r.name) for r in runs]
    overlaps = [(a[3], b[3]) for i, a in enumerate(spans) for b in spans[i + 1:]
                if a[2] != b[2] and a[0] < b[1] and b[0] < a[1]]
    assert overlaps, spans
    crashed = [r for r in stage_runs(lab) if r.name == KILLED and r.state.name == "Crashed"]
    assert len(crashed) == 1 and worker_of(crashed[0]) == grid_run["killed"]
    again = [r for r in runs if r.name == KILLED]
    assert len(again) == 1 and worker_of(again[0]) != grid_run["killed"]
    assert f"stage '{KILLED}' crashed on worker {grid_run['killed']}" in grid_run["text"]
    assert "running it again (attempt 2/2)" in grid_run["text"]


def test_one_lineage_every_stage_a_child_tagged_with_its_worker(lab, grid_run):
    import mlflow

    client = mlflow.MlflowClient(lab["env"]["MLFLOW_TRACKING_URI"])
    parent = client.get_run(grid_run["result"]["parent_run_id"])
    exp = parent.info.experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=200)
    planned = set(grid_run["result"]["stages"])
    done = {r.info.run_name: r for r in children if r.info.status == "FINISHED"}
    assert planned <= set(done), sorted(done)
    for run in (done[name] for name in planned):  # a stage's own nested runs (its GX gate's) are not stages
        assert run.data.tags["rcgrpo.worker.dir"].startswith(str(lab["stack"].state_dir / "workers")), run.data.tags
    killed = [r for r in children if r.info.run_name.startswith("rl") and r.info.status == "KILLED"]
    assert killed, [(r.info.run_name, r.info.status) for r in children]


def test_the_remote_holds_only_whole_objects_and_nothing_was_written_elsewhere(lab, grid_run):
    data = lab["stack"].state_dir / "seaweedfs"
    assert data.is_dir()
    import boto3

    s3 = boto3.client("s3", endpoint_url=lab["env"]["AWS_ENDPOINT_URL_S3"], aws_access_key_id=KEY,
                      aws_secret_access_key=SECRET, region_name="us-east-1")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="rcgrpo", Prefix="dvc/files/md5/")
            for o in page.get("Contents", [])]
    assert keys
    for key in keys:
        body = s3.get_object(Bucket="rcgrpo", Key=key)["Body"].read()
        assert hashlib.md5(body).hexdigest() == key.split("/")[-2] + key.split("/")[-1].removesuffix(".dir"), key
    root, state = lab["root"], lab["stack"].state_dir
    allowed = [state / "workers", state / "seaweedfs", state / "prefect", state / "logs", state / "pids",
               *(state / f for f in ("stack.json", "env.sh", "s3-identities.json", "mlflow.db")),
               root / "parent", root / "parent2", root / "parent-home", root / "parent2-home", root / "local",
               root / "local-store", root / "seed", lab["origin"]]
    stray = [str(p) for p in root.rglob("*") if p.is_file() and not p.name.endswith(".log")
             and not any(p.is_relative_to(a) for a in allowed)]
    assert not stray, stray
    assert git(lab["origin"], "rev-parse", "HEAD") == lab["commit"]  # the workers only read git
    assert untracked() == lab["untracked"]  # nothing in the code the workers ran the stage flow from


def test_a_rerun_dispatches_nothing(lab, grid_run):
    done = subprocess.run(parent_cmd(lab, "--stages", TARGET), cwd=lab["parent"], env=parent_env(lab),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ended = json.loads(done.stdout.strip().splitlines()[-1])["stages"]
    assert set(ended.values()) == {"skipped"}, (ended, done.stderr[-3000:])


def test_s3_down_fails_naming_stage_and_worker_then_a_rerun_runs_only_that_stage(lab, grid_run):
    lock = (lab["parent"] / "dvc.lock").read_text()
    st.down(lab["stack"], only=["s3"])
    try:
        done = subprocess.run(parent_cmd(lab, "--stages", "prepare_data", "--force"), cwd=lab["parent"],
                              env=parent_env(lab), capture_output=True, text=True, timeout=900)
    finally:
        st.up(lab["stack"])
    text = done.stdout + done.stderr
    assert done.returncode != 0
    assert "failed on worker w" in text and "is the S3 server up?" in text, text[-4000:]
    assert (lab["parent"] / "dvc.lock").read_text() == lock  # nothing recorded
    done = subprocess.run(parent_cmd(lab, "--stages", "prepare_data"), cwd=lab["parent"], env=parent_env(lab),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ended = json.loads(done.stdout.strip().splitlines()[-1])["stages"]
    assert set(ended.values()) == {"skipped"}, (ended, done.stderr[-3000:])


def test_two_parents_at_once_on_one_commit_share_each_stage_run(lab, grid_run):
    other = lab["root"] / "parent2"
    subprocess.run(["git", "clone", "-q", str(lab["origin"]), str(other)], check=True)
    st.configure_dvc(lab["stack"], other)
    (other / "dvc.lock").write_text((lab["parent"] / "dvc.lock").read_text())  # the same state: the same stage runs
    layer = lab["root"] / "parent" / "limit5.yaml"
    layer.write_text("sample_policy:\n  n_entries: 1\n")
    profile = f"{lab['profile']}+{layer}"
    args = ["--stages", "sample_policy@rctp", "--profile", profile]
    procs = [subprocess.Popen(parent_cmd(lab, *args), cwd=cwd, env=parent_env(lab, home), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for cwd, home in ((lab["parent"], "parent-home"), (other, "parent2-home"))]
    outs = [p.communicate(timeout=1200) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    ours, theirs = dvc_lock.read_entries(lab["parent"]), dvc_lock.read_entries(other)
    assert ours["sample_policy@rctp"] == theirs["sample_policy@rctp"]
    # the grid's own run of the stage (the fixture's profile) is not one of these: only runs at this profile count
    runs = [r for r in stage_runs(lab) if r.name == "sample_policy@rctp" and r.parameters.get("profile") == profile]
    assert [r.state.name for r in runs] == ["Completed"], [(r.id, r.state.name, r.parameters) for r in runs]


def test_the_pool_limit_is_prefects_own(lab, grid_run):
    done = subprocess.run([str(BIN / "prefect"), "work-pool", "inspect", "rcgrpo-cpu"], env=parent_env(lab),
                          capture_output=True, text=True)
    assert "concurrency_limit=2" in done.stdout.replace(" ", ""), done.stdout
    assert yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
