"""Prefect 3 flow `rcgrpo`: the DVC pipeline as Prefect tasks under one MLflow parent run.

What it does, in order:
1. profile: ALWAYS applied first, from the pristine params (`rcgrpo params --profile`, ops.config): every
   deployment pins one (`default` = the committed params.yaml), so a smoke run can never leak its
   budgets into `full`; an unknown profile fails the run at once, listing the valid ones, params.yaml
   untouched; what it would write is checked whole first, as the pipeline's root stage checks it
   (`sweep.params_check`): a bad value in any section fails the run here, nothing written, no MLflow run;
2. preflight: the MLflow tracking store must answer (clear error before any training; retried briefly,
   since a server that is just starting is a transient failure); what a killed stage left in the checkout
   is cleared and every run left RUNNING by a dead process ended KILLED (`recover_checkout`);
3. opens an MLflow parent run `pipeline@<profile>` (params: flow parameters + the merged params file;
   tags: git commit, profile, params hash) and hands its id to every stage through
   `RCGRPO_PARENT_RUN_ID`, so each stage's own `tracking.stage_run` becomes a nested child run;
4. discovers the stages from `dvc.yaml` with DVC itself (foreach/matrix expanded, topological order), so
   stages that land later are picked up without touching this file; `stages=[...]` selects some (a
   foreach group by its prefix, e.g. `sft` = every `sft@...`), their upstream stages are included;
5. pull = `dvc fetch` (network only: retried with backoff, S3 is the transient part) + `dvc checkout`
   (local, best effort) so a fresh worker starts from the remote;
6. one Prefect task per stage: `dvc repro --single-item <stage>` in its OWN process group (never
   retried: training is deterministic, a retry would only fail again slower), up to `jobs` side by side,
   each once the stages it depends on are done (flows/dvc_tasks.py `run_stages`). A failing stage fails its
   task and the flow with the stage's name, exit code and the last lines of its stderr (in the task's
   failure, the flow run's logs and `prefect deployment run ... --watch`); nothing new starts after it, the
   stages running finish; a cancelled, timed-out (`stage_timeout_s`) or SIGTERMed task stops the whole group
   (dvc and the stage; SIGKILL after a grace period), and the stage's MLflow run ends KILLED; unchanged stages
   are skipped by DVC;
7. `dvc push` (retried with backoff) so other workers and `dvc pull` elsewhere get the outputs;
8. records `dvc.lock` hashes on the parent run, ends any child run still RUNNING as KILLED (its stage
   process is gone), and closes the parent FINISHED (FAILED on any error, with the error as a tag).

Run locally: `python flows/rcgrpo_flow.py --profile smoke` (or `prefect deployment run rcgrpo/full`
against a server + worker, see docs/operations.md). Credentials only come from the environment; they are
never flow parameters, so they never reach Prefect's database, logs or MLflow params.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `flows` as a package under a deployment
from flows import dvc_lock, grid  # noqa: E402
from flows.dvc_tasks import (  # noqa: E402  (names the retrain flow and the tests use, from here)
    BIN,
    StageFailed,
    TransferFailed,
    dvc_checkout,
    dvc_transfer,
    ensure_remote,
    failure_message,
    missing_cache_note,
    run_stage,
    run_stages,
    stage_env,
)
from rcgrpo_tasks.ops import config, pipeline, profiles, recovery, stops, tracking, tracking_log, tracking_store  # noqa: E402
from rcgrpo_tasks.sweep.params_check import check_params  # noqa: E402

__all__ = ["BIN", "StageFailed", "TransferFailed", "dvc_checkout", "dvc_transfer", "ensure_remote", "failure_message",
           "missing_cache_note", "run_stage", "run_stages", "stage_env"]


ZOMBIE_AFTER_S = 90
"""A stage run whose heartbeats (every 30 s: prefect.yaml's stage deployments) stop this long is CRASHED."""


# -- pure helpers (unit-tested without Prefect) ---------------------------------------------------------

def discover_stages(repo_dir: str | Path) -> dict[str, list[str]]:
    """{stage: [upstream stages]} for every dvc.yaml stage, foreach/matrix expanded, in topological order
    (DVC resolves it: `ops.pipeline.dvc_stages`)."""
    return {s.name: list(s.upstream) for s in pipeline.dvc_stages(repo_dir, with_status=False, main_only=False)}


plan = pipeline.select
"""Stages to run, in order: `selected` (exact names or foreach prefixes) plus everything upstream."""


def lock_hashes(repo_dir: str | Path) -> dict[str, str]:
    """Short sha256 of dvc.lock and of each stage's lock entry (deps, params, outs hashes: `pipeline.lock_entries`)."""
    path = Path(repo_dir) / "dvc.lock"
    if not path.is_file():
        return {}
    return {"dvc.lock.sha256": hashlib.sha256(path.read_bytes()).hexdigest()[:16],
            **{f"dvc.lock.{name}": sha for name, sha in pipeline.lock_entries(repo_dir).items()}}


def read_repo_params(repo_dir: str | Path) -> dict:
    return config.read_params(Path(repo_dir) / "params.yaml")


# -- tasks ----------------------------------------------------------------------------------------------

@task(name="check-tracking", retries=2, retry_delay_seconds=[2, 5])
def check_tracking() -> str:
    return tracking_store.check_tracking()


@task(name="open-parent-run", retries=2, retry_delay_seconds=[2, 5])
def open_parent_run(name: str, params: dict, tags: dict) -> str:
    return tracking.open_run(name, params=params, tags=tags)


@task(name="close-parent-run", retries=2, retry_delay_seconds=[2, 5])
def close_parent_run(run_id: str, status: str, tags: dict) -> list[str]:
    """Close the parent; first end KILLED any child still RUNNING (every stage process has exited by now,
    so such a run belongs to a stage that was killed or lost its tracking server). Returns those ids."""
    stale = tracking.reap_orphans(parent_run_id=run_id)
    if stale:
        get_run_logger().warning("ended %d stage run(s) left RUNNING as KILLED: %s", len(stale), ", ".join(stale))
    tracking.close_run(run_id, status=status, tags=tags)
    return stale


@task(name="apply-profile")
def apply_profile(repo_dir: str, profile: str) -> dict[str, str]:
    """Write params.yaml = pristine params + `profile` (`rcgrpo params --profile`), so DVC sees exactly
    which sections changed and reruns those stages; where dvc.yaml declares the root check, what it would write
    is checked whole first (`sweep.params_check`: a bad value writes nothing and fails the flow before its
    MLflow run opens). Returns what the parent run records."""
    params = Path(repo_dir) / "params.yaml"
    check = check_params if pipeline.declares_root_check(repo_dir) else None
    merged = profiles.apply_profile(None, profile, params, check=check)
    digest = tracking_log.params_hash(merged)
    get_run_logger().info("profile %r applied to %s from the pristine params (params sha256 %s)",
                          profile, params, digest)
    return {"rcgrpo.profile": profile, "rcgrpo.params_sha256": digest}


def run_across_pools(across: grid.Grid, planned: list, results: dict[str, str]) -> None:
    """The stages across the work pools (flows/grid.py), one parent per checkout; `results` gets each stage's
    state as it ends, also when a stage fails."""
    if not across.remote:
        raise RuntimeError("dispatch='pools' needs a DVC remote: workers share nothing else (`rcgrpo stack up`, or "
                           "RCGRPO_DVC_REMOTE_URL)")
    url, endpoint = dvc_lock.remote_url(across.repo, across.remote)
    ended: dict = {}
    with grid.parent_lock(across.repo):
        grid.ensure_result_storage(url, endpoint)
        grid.ensure_zombie_automation(ZOMBIE_AFTER_S)
        try:
            grid.run_grid(across, planned, ended)
        finally:
            results.update({name: e.status for name, e in ended.items()})


# -- the flow -------------------------------------------------------------------------------------------

@task(name="recover-checkout")
def recover_checkout(repo_dir: str) -> list[str]:
    """What a killed stage left in the checkout (`ops.recovery`: stale locks and markers, half-written temps),
    and every RUNNING run whose process is gone, ended KILLED with the reason, before this run opens its own."""
    by = f"flow run {flow_run.id or '?'}"
    reaped = recovery.recover(repo_dir, by, echo=get_run_logger().warning, reap=True)["reaped"]
    if reaped:
        get_run_logger().warning("ended %d run(s) left RUNNING by dead processes as KILLED: %s", len(reaped),
                                 ", ".join(reaped))
    return reaped


@flow(name="rcgrpo", log_prints=True)
def rcgrpo(
    profile: str = "default",
    stages: list[str] | None = None,
    force: bool = False,
    push: bool = True,
    pull: bool = True,
    repo_dir: str = ".",
    transfer_retries: int = 3,
    retry_delay_s: float = 10.0,
    stage_timeout_s: float | None = None,
    jobs: int = 2,
    dispatch: str = "local",
    repository: str | None = None,
    stage_retries: int = 1,
    no_worker_s: float = 300.0,
    stage_deployments: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the DVC pipeline (or `stages` and their upstream) as Prefect tasks under one MLflow parent run.

    profile: `default` (the committed params), an overlay name in configs/ (e.g. `smoke`, `paper`) or a
        path to an overlay YAML; applied to the pristine params before anything else, every run.
    stages: stage names or foreach prefixes; default all. force: rerun even unchanged stages.
    push/pull: sync with the default DVC remote (skipped with a warning when none is configured).
    stage_timeout_s: stop a stage (its whole process group) that runs longer; default: no limit.
    jobs: stages side by side at most (each once the stages it depends on are done; each with its share of
        the worker's cores for its CPU threads); 2 = two one-thread stages on the 2-core default host, 1 = one
        at a time (a GPU worker whose stages each fill the device).
    dispatch: `local` (every stage in this checkout, as above) or `pools` (flows/grid.py: each stage a run of
        the stage deployment of its resources' kind, on that deployment's work pool, at the checkout's commit;
        `jobs`, `pull` and `push` are the workers' then). repository: the git URL workers fetch the commit from
        (default: the stage deployment's own). stage_retries: runs again of a stage whose worker died.
        no_worker_s: how long a stage waits on a pool with no worker online. stage_deployments: {kind:
        deployment} (default `grid.STAGE_DEPLOYMENTS`).
    """
    log = get_run_logger()
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if dispatch not in ("local", "pools"):
        raise ValueError(f"dispatch must be 'local' or 'pools', got {dispatch!r}")
    repo = str(Path(repo_dir).resolve())
    profile_tags = apply_profile(repo, profile)
    uri = check_tracking()
    recover_checkout(repo)
    # The main pipeline only: other dvc.yaml files (retrain/, written by the retrain flow) are not its stages.
    every = pipeline.dvc_stages(repo, with_status=False)
    order = plan({s.name: s.upstream for s in every}, stages)
    planned = [s for s in every if s.name in order]
    log.info("tracking %s; profile %s; %d side by side at most; stages: %s", uri, profile, jobs, ", ".join(order))
    if tracking_store.runs_table_url():
        log.info("MLflow runs table: %s", tracking_store.runs_table_url())
    commit = grid.clean_commit(Path(repo), every) if dispatch == "pools" else tracking.git_commit()
    params = {"flow": {"profile": profile, "stages": stages, "force": force, "push": push, "pull": pull,
                       "jobs": jobs, "dispatch": dispatch}, "params": read_repo_params(repo)}
    parent = open_parent_run(f"pipeline@{profile}", params, {
        "git.commit": tracking.git_commit(), "prefect.flow_run_id": flow_run.id or "", "rcgrpo.plan": ",".join(order),
        **profile_tags})
    remote = ensure_remote(repo)
    if remote is None and (push or pull):
        log.warning("no default DVC remote configured: outputs stay in this workspace (no pull/push)")
    transfer = dvc_transfer.with_options(
        retries=transfer_retries, retry_delay_seconds=[retry_delay_s * 2**i for i in range(transfer_retries)])
    results: dict[str, str] = {}
    status, error = "FAILED", None
    try:
        if dispatch == "pools":
            across = grid.Grid(Path(repo), commit, profile, remote or "", parent, force=force, retries=stage_retries,
                               no_worker_s=no_worker_s, stage_params={
                                   "transfer_retries": transfer_retries, "retry_delay_s": retry_delay_s,
                                   "stage_timeout_s": stage_timeout_s, **({"repository": repository} if repository
                                                                           else {})},
                               **({"deployments": stage_deployments} if stage_deployments else {}))
            run_across_pools(across, planned, results)
        else:
            if pull and remote:
                transfer("fetch", repo, order, remote, transfer_retries)
                dvc_checkout(repo, order)
            run_stages(planned, repo, stage_env(jobs=jobs, parent_run_id=parent), force, jobs, stage_timeout_s,
                       results)
            if push and remote:
                transfer("push", repo, order, remote, transfer_retries)
        status = "FINISHED"
    except BaseException as exc:
        error = exc
        stopped = isinstance(exc, (KeyboardInterrupt, TimeoutError)) or type(exc).__name__ == "TerminationSignal"
        status = "KILLED" if stopped else "FAILED"
        raise
    finally:
        tags = {**lock_hashes(repo), "rcgrpo.results": json.dumps(results)}
        if error is not None:
            tags["rcgrpo.error"] = tracking.describe_error(error)[:4000]
            failed = [name for name, state in results.items() if state == "failed"]
            if failed:  # the first to fail: the one raised
                tags["rcgrpo.failed_stage"] = failed[0]
        with contextlib.suppress(Exception) if error is not None else contextlib.nullcontext():
            close_parent_run(parent, status, tags)
    log.info("done: %s (parent run %s)", results, parent)
    return {"parent_run_id": parent, "stages": results, "profile": profile}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="default")
    ap.add_argument("--stages", nargs="*")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--no-push", action="store_true")
    ap.add_argument("--no-pull", action="store_true")
    ap.add_argument("--repo-dir", default=".")
    ap.add_argument("--transfer-retries", type=int, default=3)
    ap.add_argument("--retry-delay-s", type=float, default=10.0)
    ap.add_argument("--stage-timeout-s", type=float)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dispatch", choices=("local", "pools"), default="local")
    ap.add_argument("--repository")
    ap.add_argument("--stage-retries", type=int, default=1)
    ap.add_argument("--no-worker-s", type=float, default=300.0)
    a = ap.parse_args(argv)
    # SIGTERM/SIGHUP unwind like Ctrl-C: the stage group is stopped (`dvc_tasks.stream`) and the interpreter exits
    # normally, so Prefect's atexit hook stops the temporary API server it started (none is left behind).
    handlers = stops.raise_on_terminate()
    try:
        result = rcgrpo(profile=a.profile, stages=a.stages, force=a.force, push=not a.no_push,
                        pull=not a.no_pull, repo_dir=a.repo_dir, transfer_retries=a.transfer_retries,
                        retry_delay_s=a.retry_delay_s, stage_timeout_s=a.stage_timeout_s, jobs=a.jobs,
                        dispatch=a.dispatch, repository=a.repository, stage_retries=a.stage_retries,
                        no_worker_s=a.no_worker_s)
    except (config.ConfigError, tracking_store.TrackingError, StageFailed, grid.StageDispatchFailed) as exc:
        shown = str(exc) if isinstance(exc, config.ConfigError) else str(exc).splitlines()[0]  # every bad value
        print(f"error: {shown}", file=sys.stderr)
        return 2 if not isinstance(exc, (StageFailed, grid.StageDispatchFailed)) else 1
    except stops.Terminated as exc:
        print(f"error: flow {exc}; stages stopped", file=sys.stderr)
        return 128 + exc.signum
    finally:
        stops.restore(handlers)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
