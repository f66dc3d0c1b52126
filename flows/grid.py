"""The parent flow across work pools (`rcgrpo`, `dispatch="pools"`): each stage of the plan a run of the stage
deployment (flows/stage_flow.py) on the work pool its resources name, the stages side by side as far as those
pools' own Prefect concurrency limits let them, their lock entries written into the parent's dvc.lock.

- Order and failure rule: the pipeline's one scheduler (`ops.schedule.run_dag`, no capacity of its own: every
  ready stage is dispatched at once, and what bounds the width is each pool's concurrency limit and each
  worker's `--limit`, Prefect's own).
- Dispatch: `run_deployment` (no wait: each run polled from the scheduler's thread), linked as a subflow of the
  parent's flow run; on a pool whose job template takes `gpu_count` (Kubernetes: infra/k8s) the stage's declared
  count goes there. The idempotency key is the commit, the profile, the stage and what it is handed: two
  parents started at once on one commit share each stage's run instead of running it twice.
- Faults: a run that CRASHED (its worker killed: the flow run's heartbeats stop and the server's automation,
  `ensure_zombie_automation`, marks it so) runs again, on whichever worker is alive, up to `retries` times; a
  FAILED run (the stage's own error, a transfer that kept failing) fails the parent naming the stage, the worker
  and the cause; a run that waits on a pool with no worker online for `no_worker_s` is cancelled and fails the
  parent naming the pool. Nothing is recorded of a stage that did not return: its entry goes into dvc.lock only
  once its worker has pushed every output (and the parent has fetched its `cache: false` ones).
- What runs: a stage is skipped when its dvc.lock entry still holds (DVC's status of its command, code and params
  in the parent's checkout, its outputs in the remote: `stale`) and no stage upstream of it made other outputs
  in this run; so a parent run again after a cut does only the rest.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_client, get_run_logger
from prefect.client.schemas.objects import StateType

from flows import dvc_lock
from flows.stage_flow import RESULTS_NAME
from rcgrpo_tasks.ops import schedule
from rcgrpo_tasks.ops.pipeline import PlannedStage
from rcgrpo_tasks.ops.resources import CPU, GPU
from rcgrpo_tasks.ops.schedule import Ended

STAGE_DEPLOYMENTS = {CPU: "stage/cpu", GPU: "stage/gpu"}
"""The stage deployment of each kind of resource (prefect.yaml); each deployment names its work pool."""
ZOMBIES = "rcgrpo: crash stage runs whose heartbeats stopped"
WAITING = (StateType.SCHEDULED, StateType.PENDING)


class StageDispatchFailed(RuntimeError):
    """A stage run across the pools failed, crashed past its retries, or found no worker."""


def kind_of(stage: PlannedStage) -> str:
    return GPU if stage.gpus else CPU


def idempotency_key(commit: str, profile: str, stage: str, upstream: Mapping[str, dict], force: bool) -> str:
    """What determines a stage's result: the same key is the same run, whichever parent asks."""
    blob = json.dumps({"upstream": upstream, "force": force}, sort_keys=True, default=str).encode()
    return f"{commit}:{profile}:{stage}:{hashlib.sha256(blob).hexdigest()[:16]}"


def where_of(run) -> str:
    """The worker a flow run ran on, from the tags its stage flow set (`worker:`, `host:`, `dir:`)."""
    tags = {t.partition(":")[0]: t.partition(":")[2] for t in run.tags if ":" in t}
    if not {"host", "dir"} & set(tags):
        return "no worker (it never started)"
    return f"worker {tags.get('worker') or '?'} (host {tags.get('host', '?')}, dir {tags.get('dir', '?')})"


def failure_text(stage: str, run, what: str) -> str:
    """`stage 'X' <what> on worker W (host H, dir D): flow run N (id) STATE: its message` (the cause's first lines)."""
    message = " ".join((run.state.message or "no message").split())[:1500] if run.state else "no state"
    return (f"stage {stage!r} {what} on {where_of(run)}: flow run {run.name} ({run.id}) "
            f"{run.state.name if run.state else '?'}: {message}")


def gpu_variables(pool, gpus: int) -> dict[str, Any]:
    """Job variables of a stage on `pool`: its GPU count where the pool's job template takes one (`gpu_count`:
    infra/k8s), nothing elsewhere (a process worker's host decides its devices)."""
    props = (pool.base_job_template or {}).get("variables", {}).get("properties", {})
    return {"gpu_count": gpus} if gpus and "gpu_count" in props else {}


def online(client, pool: str) -> int:
    """How many workers of `pool` are online (Prefect tracks their heartbeats)."""
    return sum(str(getattr(w.status, "value", w.status)).upper() == "ONLINE"
               for w in client.read_workers_for_work_pool(work_pool_name=pool))


@dataclass
class Target:
    """Where a stage goes: its stage deployment, that deployment's pool, and the job variables for it."""

    deployment: str
    pool: str
    job_variables: dict = field(default_factory=dict)


class Targets:
    """Where each stage goes ({kind: stage deployment}), read from the server once per deployment: a kind with
    no deployment fails naming the deployment to create."""

    def __init__(self, deployments: Mapping[str, str]):
        self.deployments, self.found = deployments, {}

    def __call__(self, stage: PlannedStage) -> Target:
        name = self.deployments[kind_of(stage)]
        if name not in self.found:
            with get_client(sync_client=True) as client:
                try:
                    dep = client.read_deployment_by_name(name)
                except Exception as exc:
                    kind = f"gpu: {stage.gpus}" if stage.gpus else "cpu"
                    raise StageDispatchFailed(
                        f"stage {stage.name!r} ({kind}) goes to deployment {name!r}, which the Prefect server does "
                        f"not have ({type(exc).__name__}); create it: `prefect --no-prompt deploy --name "
                        f"{name.split('/')[-1]}`") from exc
                self.found[name] = (dep, client.read_work_pool(dep.work_pool_name))
        dep, pool = self.found[name]
        return Target(name, dep.work_pool_name, gpu_variables(pool, stage.gpus))


class StageRun:
    """One stage as runs of its deployment (`ops.schedule.Running`): dispatched, polled, run again after a crash,
    cancelled when stopped or when no worker serves its pool."""

    def __init__(self, stage: PlannedStage, target: Target, params: dict, key: str, retries: int,
                 no_worker_s: float, poll_s: float, log):
        self.stage, self.target, self.params, self.key = stage, target, params, key
        self.retries, self.no_worker_s, self.poll_s, self.log = retries, no_worker_s, poll_s, log
        self.attempt, self.next_poll, self.lonely_since = 0, 0.0, None
        self.runs: list = []
        self.dispatch()

    def dispatch(self) -> None:
        from prefect.deployments import run_deployment

        self.attempt += 1
        key = self.key if self.attempt == 1 else f"{self.key}:again:{self.runs[-1].id}"
        run = run_deployment(self.target.deployment, parameters=self.params, timeout=0, idempotency_key=key,
                             job_variables=self.target.job_variables or None, flow_run_name=self.stage.name,
                             tags=["rcgrpo", f"stage:{self.stage.name}"])
        self.runs.append(run)
        self.log.info("stage %s -> %s on pool %s: flow run %s (attempt %d/%d)", self.stage.name,
                      self.target.deployment, self.target.pool, run.id, self.attempt, self.retries + 1)

    def poll(self) -> Ended | None:
        if time.monotonic() < self.next_poll:
            return None
        self.next_poll = time.monotonic() + self.poll_s
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(self.runs[-1].id)
            self.runs[-1] = run
            state = run.state.type if run.state else StateType.SCHEDULED
            if state == StateType.COMPLETED:
                return self.completed(run)
            if state == StateType.CRASHED and self.attempt <= self.retries:
                self.log.warning("%s; running it again (attempt %d/%d)", failure_text(self.stage.name, run, "crashed"),
                                 self.attempt + 1, self.retries + 1)
                self.dispatch()
                return None
            if state in (StateType.FAILED, StateType.CRASHED, StateType.CANCELLED):
                what = {StateType.FAILED: "failed", StateType.CRASHED: "crashed", StateType.CANCELLED: "was cancelled"}
                return Ended("failed", failure_text(self.stage.name, run, what[state]))
            return self.watch_pool(client, run) if state in WAITING else None

    def completed(self, run) -> Ended:
        result = run.state.result()
        if self.attempt == 1 and len(self.runs) == 1 and result.get("stage") != self.stage.name:
            raise StageDispatchFailed(f"flow run {run.id} returned stage {result.get('stage')!r}, not {self.stage.name!r}")
        self.log.info("stage %s %s on %s (host %s, dir %s): %s", self.stage.name, result["status"],
                      result.get("worker") or "?", result["host"], result["dir"], result.get("steps"))
        return Ended("ran", result["status"], result)

    def watch_pool(self, client, run) -> Ended | None:
        """None while a worker serves the pool; a failure once none has for `no_worker_s` (the run cancelled,
        so a worker that comes later does not start what the parent gave up on)."""
        if online(client, self.target.pool):
            self.lonely_since = None
            return None
        self.lonely_since = self.lonely_since or time.monotonic()
        if time.monotonic() - self.lonely_since < self.no_worker_s:
            return None
        self.cancel(client)
        kind = f"gpu: {self.stage.gpus}" if self.stage.gpus else "cpu"
        return Ended("failed", f"stage {self.stage.name!r} ({kind}) waited {self.no_worker_s:.0f} s on work pool "
                               f"{self.target.pool!r}, which has no worker online: start one there "
                               f"(`RCGRPO_WORKER_DIR=<its own dir> prefect worker start --pool {self.target.pool} "
                               f"--limit 1`); flow run {run.name} ({run.id}) cancelled, nothing of the stage ran")

    def cancel(self, client) -> None:
        from prefect.states import Cancelled

        client.set_flow_run_state(self.runs[-1].id, state=Cancelled(message="the parent flow stopped"), force=True)

    def stop(self) -> None:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(self.runs[-1].id)
            if not (run.state and run.state.is_final()):
                from prefect.states import Cancelling

                client.set_flow_run_state(run.id, state=Cancelling(message="the parent flow stopped"), force=True)


@dataclass
class Grid:
    """What one parent run across the pools knows: its checkout, the commit and profile its stages run at, its
    MLflow parent run, the DVC remote, where each kind of stage goes and how faults are met."""

    repo: Path
    commit: str
    profile: str
    remote: str
    parent_run_id: str | None
    deployments: Mapping[str, str] = field(default_factory=lambda: dict(STAGE_DEPLOYMENTS))
    force: bool = False
    retries: int = 1
    no_worker_s: float = 300.0
    poll_s: float = 2.0
    stage_params: dict = field(default_factory=dict)
    """More parameters of every stage run (`repository`, `transfer_retries`, `stage_timeout_s`, ...)."""


def upstream_outs(stage: PlannedStage, by_name: Mapping[str, PlannedStage]) -> list[str]:
    return [p for u in stage.upstream if u in by_name for p in (*by_name[u].outs, *by_name[u].records)]


def stale(grid: Grid, stages: list[PlannedStage], entries: Mapping[str, dict]) -> dict[str, str]:
    """{stage: why it must run} for the stages whose dvc.lock entry in the parent's checkout does not hold: none,
    a changed command, code or params dependency (`dvc_lock.stale_reasons` over DVC's status), or outputs the
    remote lacks (the `cache: false` ones this checkout holds at their recorded hash are pushed first: a lock a
    local run wrote). Of a stage whose entry holds, the checkout gets the `cache: false` outputs it records."""
    by_name = {s.name: s for s in stages}
    reasons: dict[str, str] = {}
    with dvc_lock.repo_at(grid.repo, locked=False) as repo:
        status = repo.status(targets=[s.name for s in stages], with_deps=False)
    for s in stages:
        if grid.force or s.name not in entries:
            reasons[s.name] = "forced" if grid.force else "no dvc.lock entry"
            continue
        why = dvc_lock.stale_reasons(status.get(s.name, []), upstream_outs(s, by_name))
        if not why:
            try:
                dvc_lock.push_entry(grid.repo, entries[s.name], grid.remote, uncached_only=True)
            except Exception:  # a record this checkout does not hold: the remote decides below
                pass
            missing = dvc_lock.in_remote(grid.repo, entries[s.name], grid.remote)
            why = [f"not in remote {grid.remote!r}: {', '.join(missing)}"] if missing else []
        if why:
            reasons[s.name] = "; ".join(why)
        elif s.records:  # the checkout's copies of what the entry records (a clone of a lock made elsewhere)
            dvc_lock.pull_entries(grid.repo, {s.name: entries[s.name]}, list(s.records), grid.remote)
    return reasons


def same_outputs(ended: Ended, before: dict | None, read: list[str]) -> bool:
    """Whether a stage that ran made the outputs at `read` (a downstream stage's dependency paths, from its entry)
    as its earlier entry records them; outputs no dependency reads (records of wall times) do not count, as in DVC."""
    def reads(entry: dict) -> dict[str, str]:
        return {p: h for p, h in dvc_lock.outs_of(entry).items() if any(dvc_lock.covers(p, d) for d in read)}
    return ended.status == "skipped" or (before is not None and isinstance(ended.detail, dict)
                                         and reads(ended.detail["entry"]) == reads(before))


def run_grid(grid: Grid, stages: list[PlannedStage], results: dict[str, Ended] | None = None,
             echo: Callable[[str], None] | None = None) -> dict[str, Ended]:
    """Run `stages` (a plan) across the pools (module docstring); {stage: Ended}, filled into `results` as each
    stage ends. Raises StageDispatchFailed with the first failure's message after the stages running end."""
    log = get_run_logger()
    entries = dvc_lock.read_entries(grid.repo)
    before = dict(entries)
    reasons = stale(grid, stages, entries)
    by_name = {s.name: s for s in stages}
    results = {} if results is None else results
    where = Targets(grid.deployments)

    def start(stage: PlannedStage) -> StageRun | Ended:
        read = [d["path"] for d in (before.get(stage.name) or {}).get("deps") or []]
        moved = [u for u in stage.upstream if u in results and not same_outputs(results[u], before.get(u), read)]
        if stage.name not in reasons and not moved:
            return Ended("skipped", "its dvc.lock entry holds and its outputs are in the remote")
        upstream = {u: entries[u] for u in stage.upstream if u in entries}
        params = {"stage": stage.name, "commit": grid.commit, "profile": grid.profile, "upstream": upstream,
                  "parent_run_id": grid.parent_run_id, "force": grid.force, **grid.stage_params}
        log.info("stage %s: %s", stage.name, reasons.get(stage.name) or f"upstream {moved[0]} made other outputs")
        key = idempotency_key(grid.commit, grid.profile, stage.name, upstream, grid.force)
        return StageRun(stage, where(stage), params, key, grid.retries, grid.no_worker_s, grid.poll_s, log)

    def on_end(stage: PlannedStage, ended: Ended) -> Ended:
        if ended.status != "ran":
            log.info("stage %s %s", stage.name, ended.status) if ended.status == "skipped" else \
                log.error(ended.reason)
            return ended
        entry = ended.detail["entry"]
        records = list(by_name[stage.name].records)
        try:
            if records:
                dvc_lock.pull_entries(grid.repo, {stage.name: entry}, records, grid.remote)
            dvc_lock.write_entries(grid.repo, {stage.name: entry})
        except Exception as exc:
            return Ended("failed", f"stage {stage.name!r} ran on {ended.detail['host']}:{ended.detail['dir']}, but "
                                   f"its results could not be recorded here: {type(exc).__name__}: {exc}")
        entries[stage.name] = entry
        return Ended(ended.detail["status"] if ended.detail["status"] == "skipped" else "ran", ended.reason,
                     ended.detail)

    ended = schedule.run_dag(stages, start, poll_s=0.2, on_end=on_end, results=results)
    failed = [e.reason for e in ended.values() if e.status == "failed"]
    if failed:
        raise StageDispatchFailed(failed[0])
    return ended


def ensure_result_storage(remote_url: str, endpoint: str | None) -> str:
    """Save the block stage runs persist their result to (`flows.stage_flow.results_block`): a folder beside the
    DVC remote (`<remote>-prefect-results`), the one store every worker and the parent reach; the endpoint is no
    secret, the credentials stay in each machine's environment. Returns the folder."""
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    url = f"{remote_url.rstrip('/')}-prefect-results"
    if "://" not in url:  # a local-folder remote (one machine, tests)
        LocalFileSystem(basepath=str(Path(url).resolve())).save(RESULTS_NAME, overwrite=True)
        return url
    settings = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint and url.startswith("s3://") else {}
    RemoteFileSystem(basepath=url, settings=settings).save(RESULTS_NAME, overwrite=True)
    return url


def ensure_zombie_automation(after_s: int) -> None:
    """The server automation that marks a flow run CRASHED when its heartbeats stop for `after_s` (Prefect's
    own zombie detection: a worker SIGKILLed, a machine lost); created once, by name."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    try:
        if Automation.read(name=ZOMBIES):
            return
    except Exception:  # not found
        pass
    Automation(name=ZOMBIES, trigger=EventTrigger(
        after={"prefect.flow-run.heartbeat"},
        expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
        match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
        for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1, within=timedelta(seconds=after_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {after_s} s: its worker died or lost the server")],
    ).create()


def clean_commit(repo: Path, stages: list[PlannedStage]) -> str:
    """The commit the parent's checkout is at: what every worker checks out, so nothing but what the flow itself
    writes (params.yaml by the profile, dvc.lock, the `cache: false` outputs of `stages`) may differ from it.
    `stages`: every stage of the pipeline, not this run's only: an earlier run in the checkout may have written
    the records of stages this one does not plan."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    ours = {"params.yaml", "dvc.lock", *(r for s in stages for r in s.records)}
    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
             if not any(dvc_lock.covers(p, line[3:].strip()) for p in ours)]
    if dirty:
        raise StageDispatchFailed(f"{repo} has changes no commit holds ({', '.join(dirty[:5])}): workers check out "
                                  "the commit, so commit (and push) them first")
    return git("rev-parse", "HEAD").strip()


def parent_lock(repo: Path):
    """One parent at a time in a checkout (an flock in DVC's tmp folder): a second fails at once naming it."""
    import contextlib
    import fcntl
    import os

    @contextlib.contextmanager
    def held():
        path = repo / ".dvc" / "tmp" / "rcgrpo-parent.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as fd:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fd.seek(0)
                raise StageDispatchFailed(f"another parent flow runs in {repo} ({fd.read().strip() or '?'}): one "
                                          "parent per checkout (a second checkout of the same commit shares its "
                                          "stage runs)") from None
            fd.seek(0)
            fd.truncate()
            fd.write(f"pid {os.getpid()}")
            fd.flush()
            yield

    return held()
