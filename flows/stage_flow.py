"""Prefect flow `stage`: ONE stage of the pipeline at one git commit, on whichever worker runs it, in that
worker's own directory; the parent flow (`rcgrpo`, `dispatch="pools"`: flows/grid.py) runs it through the stage
deployment of the pool the stage's resources name (prefect.yaml `stage/cpu`, `stage/gpu`).

In order, in `$RCGRPO_WORKER_DIR` (the worker's own clone, its own DVC cache; one stage at a time there, held by
a lock, also when a worker takes more than one run at once):
1. checkout: the commit, fetched from `repository` (the URL the deployment names) into the clone (cloned on first
   use), then everything git does not track removed but DVC's cache and local config, so the stage starts from
   what a fresh clone holds;
2. the profile applied from the pristine params, as the parent applied it (the same bytes);
3. `pull`: the outputs of the stage's upstream stages that it depends on, from the DVC remote by the lock entries
   the parent hands over (flows/dvc_lock.py; a path inside a directory output: that part only), retried; those
   entries written into the clone's dvc.lock, as a local run's lock holds them when the stage starts;
4. the stage: `dvc repro --single-item` in its own process group (flows/dvc_tasks.run_stage: its MLflow run a
   child of the parent's, a stop stopping the whole group);
5. `push`: every output of the stage's new lock entry (its `cache: false` ones included) to the remote, retried;
6. back to the parent, as this flow run's result (persisted to the result storage beside the DVC remote, which
   the parent sets up: the one store both reach): the stage's dvc.lock entry, its MLflow run id (tagged with
   this worker's host, directory and name), where it ran, and how long each step took.

What the workers share is git, the DVC remote and the Prefect and MLflow servers: nothing else is read or
written outside the worker's directory (its temporary files included when the worker sets TMPDIR there).
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `flows` as a package under a deployment
from flows import dvc_lock  # noqa: E402
from flows.dvc_tasks import BIN, TransferFailed, ensure_remote, run_stage, stage_env  # noqa: E402
from rcgrpo_tasks.ops import profiles  # noqa: E402

WORKER_DIR_ENV = "RCGRPO_WORKER_DIR"
RESULTS_NAME = "rcgrpo-stage-results"


def results_block(remote_url: str) -> str:
    """The result storage of stage runs: a block the parent saves (flows/grid.py `ensure_result_storage`) over a
    folder beside the DVC remote `remote_url`, where this flow's result is written and the parent reads it;
    Prefect's RemoteFileSystem for a URL, its LocalFileSystem for a folder (a remote on one machine)."""
    kind = "remote-file-system" if "://" in remote_url else "local-file-system"
    return f"{kind}/{RESULTS_NAME}"


RESULTS_BLOCK = results_block(os.environ.get("RCGRPO_DVC_REMOTE_URL") or "s3://")
"""This worker's: its remote is `$RCGRPO_DVC_REMOTE_URL`, the parent's the same."""
KEPT = ("/.dvc/cache", "/.dvc/tmp", "/.dvc/config.local")
"""What the checkout step keeps of a clone beside what git tracks: DVC's cache, its state and local config."""


class CheckoutFailed(RuntimeError):
    """The commit could not be fetched or checked out in the worker's directory."""


def worker_dir() -> Path:
    """The worker's own directory (`$RCGRPO_WORKER_DIR`, set in the worker's environment); RuntimeError without."""
    where = os.environ.get(WORKER_DIR_ENV)
    if not where:
        raise RuntimeError(f"${WORKER_DIR_ENV} is not set on this worker: start it with its own directory, "
                           f"e.g. `{WORKER_DIR_ENV}=/srv/rcgrpo-w1 prefect worker start --pool rcgrpo-cpu --limit 1`")
    return Path(where).resolve()


@contextmanager
def held(where: Path):
    """One stage at a time in `where` (an flock beside the clone): a worker that takes several runs at once
    (no `--limit 1`) queues them here instead of letting two stages share a checkout."""
    where.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f".{where.name}.lock", "w") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def git(where: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise CheckoutFailed(f"git {' '.join(args[:2])} in {where} failed (exit {out.returncode}): "
                             f"{out.stderr.strip()[-500:]}")
    return out.stdout.strip()


@task(name="checkout", retries=2, retry_delay_seconds=[5, 15])
def checkout(repository: str, commit: str, where: str) -> str:
    """The commit in `where` (cloned on first use), checked out detached; every file git does not track
    removed but `KEPT`. Returns the commit checked out (full sha)."""
    repo = Path(where)
    if not (repo / ".git").is_dir():
        git(repo.parent, "clone", "--quiet", "--no-checkout", repository, str(repo))
    try:
        git(repo, "fetch", "--quiet", repository, commit)
    except CheckoutFailed:  # a server that serves no bare sha: every branch and tag
        git(repo, "fetch", "--quiet", repository, "+refs/heads/*:refs/remotes/origin/*", "+refs/tags/*:refs/tags/*")
    git(repo, "checkout", "--quiet", "--force", "--detach", commit)
    git(repo, "clean", "-ffdxq", *(arg for keep in KEPT for arg in ("-e", keep)))
    return git(repo, "rev-parse", "HEAD")


def site_cache(where: Path) -> None:
    """DVC's per-checkout state (its `site_cache_dir`, by default under /var/tmp) inside the worker's directory."""
    subprocess.run([str(BIN / "dvc"), "config", "--local", "core.site_cache_dir", str(where / ".dvc" / "tmp" / "site")],
                   cwd=where, check=True, capture_output=True)


def upstream_deps(where: Path, stage: str) -> list[str]:
    """The stage's dependency paths as DVC resolves them in `where`."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    with Repo(str(where)) as repo:
        main = str(where / "dvc.yaml")
        found = [s for s in repo.index.stages if getattr(s, "name", None) == stage and s.dvcfile.path == main]
        if not found:
            raise ValueError(f"no stage {stage!r} in {where}/dvc.yaml at this commit")
        return [str(d.def_path) for d in found[0].deps if not isinstance(d, ParamsDependency)]


def transfer(what: str, call, retries: int, delay_s: float, log) -> Any:
    """`call()` retried `retries` times with growing delays (S3 is the transient part); the last failure raises
    TransferFailed naming what moved and why."""
    for attempt in range(1, retries + 2):
        try:
            return call()
        except Exception as exc:  # DVC raises its own and botocore's errors
            log.warning("%s failed (attempt %d/%d): %s", what, attempt, retries + 1, exc)
            if attempt > retries:
                raise TransferFailed(f"{what} failed (attempt {attempt}/{retries + 1}); is the S3 server up? "
                                     f"{type(exc).__name__}: {str(exc)[:300]}") from exc
            time.sleep(delay_s * 2 ** (attempt - 1))


def where_tags(where: Path) -> dict[str, str]:
    """What names this worker in MLflow and in the parent's messages."""
    return {"rcgrpo.worker.host": socket.gethostname(), "rcgrpo.worker.dir": str(where),
            "rcgrpo.worker.name": os.environ.get("PREFECT__WORKER_NAME", ""),
            "prefect.flow_run_id": str(flow_run.id or "")}


def tag_flow_run(tags: dict[str, str]) -> None:
    """This flow run's tags gain `host:`, `dir:` and `worker:` so the parent names where a run died even when
    it never returned (best effort: no server, no tags)."""
    from prefect import get_client

    if not flow_run.id:
        return
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run.id)
            extra = [f"host:{tags['rcgrpo.worker.host']}", f"dir:{tags['rcgrpo.worker.dir']}"]
            extra += [f"worker:{tags['rcgrpo.worker.name']}"] if tags["rcgrpo.worker.name"] else []
            client.update_flow_run(flow_run.id, tags=sorted({*run.tags, *extra}))
    except Exception as exc:  # the stage does not depend on it
        get_run_logger().warning("could not tag the flow run with its worker: %s", exc)


@task(name="lineage", retries=2, retry_delay_seconds=[2, 5])
def lineage(stage: str, parent_run_id: str | None, tags: dict[str, str], since_ms: int) -> str | None:
    """The MLflow run of `stage` under `parent_run_id` made here (the newest started since `since_ms` whose
    `dvc.root` is this checkout), tagged with where it ran; a stage that opens no run of its own (the root
    check, prepare_data) gets one, so every stage is a child of the parent. None without a parent run."""
    if not parent_run_id:
        return None
    from rcgrpo_tasks.ops import tracking_store

    mlflow = tracking_store.mlflow_module()
    client = mlflow.MlflowClient()
    exp = tracking_store.experiment_id()
    query = (f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.`dvc.root` = '{tags['rcgrpo.worker.dir']}' "
             f"and attributes.start_time >= {since_ms}")
    runs = [r for r in client.search_runs([exp], query, order_by=["attributes.start_time DESC"])
            if r.info.run_name == stage.rsplit(":", 1)[-1]]
    if runs:
        run_id = runs[0].info.run_id
    else:
        run_id = client.create_run(exp, run_name=stage, tags={"mlflow.parentRunId": parent_run_id,
                                                               "rcgrpo.stage": stage, "dvc.stage": stage}).info.run_id
        client.set_terminated(run_id, "FINISHED")
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    return run_id


@flow(name="stage", log_prints=True, persist_result=True, result_storage=RESULTS_BLOCK)
def stage(stage: str, commit: str, profile: str = "default", upstream: dict[str, dict] | None = None,
          parent_run_id: str | None = None, repository: str = "", force: bool = False, transfer_retries: int = 3,
          retry_delay_s: float = 10.0, stage_timeout_s: float | None = None) -> dict[str, Any]:
    """Run `stage` at `commit` under `profile` in this worker's directory (module docstring).

    upstream: {stage: dvc.lock entry} of the stages it depends on (the parent's, as they ended); their outputs
        that it reads are pulled from the DVC remote. parent_run_id: the MLflow parent run its run nests under.
    repository: the git URL to fetch the commit from (the deployment names it). force: `dvc repro --force`.
    """
    log = get_run_logger()
    if not repository or repository.startswith("{{"):
        raise ValueError(f"no repository ({repository!r}): the stage deployment names the git URL workers fetch "
                         "commits from (parameter `repository`; deploy with RCGRPO_GIT_URL set)")
    where = worker_dir() / "repo"
    tags = where_tags(where)
    tag_flow_run(tags)
    steps: dict[str, float] = {}
    with held(where):
        t0 = time.monotonic()
        sha = checkout(repository, commit, str(where))
        profiles.apply_profile(None, profile, where / "params.yaml")
        site_cache(where)
        remote = ensure_remote(where)
        if remote is None:
            raise RuntimeError(f"no DVC remote on worker {tags['rcgrpo.worker.name'] or tags['rcgrpo.worker.host']}: "
                               "set RCGRPO_DVC_REMOTE_URL (and AWS_ENDPOINT_URL_S3) in its environment")
        steps["checkout_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        deps = upstream_deps(where, stage)
        transfer(f"dvc pull of {stage}'s dependencies", lambda: dvc_lock.pull_entries(where, upstream or {}, deps, remote),
                 transfer_retries, retry_delay_s, log)
        # The lock a local run holds when the stage starts: stages record their inputs' hashes from it
        # (train.common.runs.dvc_hashes), so the commit's entries for the upstream stages would differ.
        dvc_lock.write_entries(where, upstream or {})
        steps["pull_s"] = time.monotonic() - t0
        t0, since_ms = time.monotonic(), int(time.time() * 1000) - 1000
        env = {**stage_env(parent_run_id=parent_run_id), "PYTHONPATH": str(where)}  # the commit's code, not the worker's
        status = run_stage.with_options(name=stage, task_run_name=stage, timeout_seconds=stage_timeout_s)(
            stage, str(where), env, force)
        steps["stage_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        entry = dvc_lock.read_entries(where)[stage]
        sent = transfer(f"dvc push of {stage}'s outputs", lambda: dvc_lock.push_entry(where, entry, remote),
                        transfer_retries, retry_delay_s, log)
        steps["push_s"] = time.monotonic() - t0
        run_id = lineage(stage, parent_run_id, tags, since_ms)
    log.info("stage %s %s at %s on %s (%s); pushed %d object(s); %s", stage, status, sha[:10],
             tags["rcgrpo.worker.host"], where, sent, ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    return {"stage": stage, "status": status, "entry": entry, "mlflow_run_id": run_id, "commit": sha,
            "host": tags["rcgrpo.worker.host"], "dir": str(where), "worker": tags["rcgrpo.worker.name"],
            "steps": {k: round(v, 2) for k, v in steps.items()}}

