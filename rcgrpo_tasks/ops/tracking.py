"""MLflow runs of the stages: one small wrapper, so stages never talk to MLflow directly. This module is
the run lifecycle; `ops.tracking_store` is the store (where, the experiment, bounded calls, `preflight`) and
`ops.tracking_log` the logging calls into a run (params, metrics, artifacts, tags).

- `stage_run(stage, config, variant=...)` opens a run named as its DVC stage (`run_name`: `rctp@0`,
  `rl_rctp@0-rc_grpo`, `evaluate_rl_rctp@0-rc_grpo`), nested under the flow's parent run
  when `RCGRPO_PARENT_RUN_ID` is set, logging the config as flattened params plus git/DVC tags;
  `published_run` ties a stage's outputs to its run (both or neither).

Never hangs, never silent:
- Server lost mid-run: FAIL FAST. The failing call raises TrackingError (never swallowed: a run whose
  numbers were not recorded must not look like a success); the stage stops before publishing outputs
  (they are atomic) and the `rcgrpo` entry point prints one line and exits 2. Its run is ended FAILED
  with the error as the `rcgrpo.error` tag with short timeouts and no retries; if the server is still
  gone, the run is left to the reaper below.
- No run stays RUNNING: SIGTERM/SIGHUP/Ctrl-C end a stage's run KILLED (ops.stops raises Terminated);
  an error ends it FAILED with `rcgrpo.error`; an atexit hook ends a run the process forgot FAILED; and
  every run carries `rcgrpo.owner` = host:pid:start, so `reap_orphans()` ends KILLED any RUNNING run whose
  process is gone (SIGKILL, OOM, tracking lost): at each tracked stage's start, at the start of any command
  that finds a killed stage's marker (`ops.recovery`), and at the start and end of a flow.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping
from typing import Any

from rcgrpo_tasks.ops import stops
from rcgrpo_tasks.ops.config import check_params_unchanged
from rcgrpo_tasks.ops.outputs import OutputSet, atomic_outputs, claim_outputs
from rcgrpo_tasks.ops.tracking_log import flatten as flatten
from rcgrpo_tasks.ops.tracking_log import log_artifact as log_artifact
from rcgrpo_tasks.ops.tracking_log import log_dict as log_dict
from rcgrpo_tasks.ops.tracking_log import log_files as log_files
from rcgrpo_tasks.ops.tracking_log import log_metrics as log_metrics
from rcgrpo_tasks.ops.tracking_log import log_table as log_table
from rcgrpo_tasks.ops.tracking_log import safe_params, tag_key
from rcgrpo_tasks.ops.tracking_log import set_tags as set_tags
from rcgrpo_tasks.ops.tracking_store import TrackingError as TrackingError
from rcgrpo_tasks.ops.tracking_store import call, experiment_id, mlflow_module, preflight, quick

PARENT_ENV = "RCGRPO_PARENT_RUN_ID"
OWNER_TAG = "rcgrpo.owner"
ERROR_TAG = "rcgrpo.error"
_OPEN_RUNS: list[str] = []  # stage runs of this process not yet ended (for the atexit hook)
_HOOKED: list[bool] = []


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def owner() -> str:
    """`host:pid:start` of this process: lets a later process tell whether a RUNNING run's owner died."""
    return f"{socket.gethostname()}:{os.getpid()}:{stops.proc_start_time(os.getpid()) or ''}"


def run_tags(stage: str, tags: Mapping[str, Any] | None = None) -> dict[str, str]:
    base = {"rcgrpo.stage": stage, "git.commit": git_commit(), OWNER_TAG: owner(),
            "dvc.stage": os.environ.get("DVC_STAGE", ""), "dvc.root": os.environ.get("DVC_ROOT", "")}
    base.update({k: str(v) for k, v in (tags or {}).items()})
    return {tag_key(k): v for k, v in base.items() if v}


def run_name(stage: str, variant: str | None = None) -> str:
    """A stage run's name: the DVC stage it runs in (`dvc stage list`). `stage` already a stage's name (one
    holding `@`, `ops.names.stage_name`: `rctp@0`, `evaluate_rl_rctp@0-rc_grpo`) is kept; with `variant`,
    `<stage>@<variant>` (a run named after the stage it serves: `validate_trajectories@pool_rctp@0`); else
    the stage `$DVC_STAGE` names when DVC runs it (`pool_rctp@0` for the sample_policy module; its file
    prefix dropped), else `stage`."""
    if "@" in stage:
        return stage
    if variant:
        return f"{stage}@{variant}"
    return os.environ.get("DVC_STAGE", "").rsplit(":", 1)[-1] or stage


def describe_error(exc: BaseException) -> str:
    """`Type: message` on one line for the `rcgrpo.error` tag; a stop signal without a message (Prefect's
    TerminationSignal carries only `.signal`) is named: `TerminationSignal: stopped by SIGTERM`."""
    if isinstance(exc, GeneratorExit):  # the `with` was never left: its generator is collected at exit
        return "process exited with the run still open"
    text, signum = " ".join(str(exc).split()), getattr(exc, "signal", None)
    if isinstance(signum, int) and text in ("", str(signum)) and signum in signal.valid_signals():
        text = f"stopped by {signal.Signals(signum).name}"
    return f"{type(exc).__name__}: {text or 'no message'}"[:5000]


def _end(run_id: str, status: str, error: str | None) -> None:
    """End run `run_id` with `status` (+ the error tag); quick and best effort after a failure: a run it
    cannot close is left to reap_orphans()."""
    mlflow = mlflow_module()
    client = mlflow.MlflowClient()
    with quick():
        if error is not None:
            with contextlib.suppress(Exception):
                client.set_tag(run_id, ERROR_TAG, error)
        active = mlflow.active_run()
        with contextlib.suppress(Exception):
            if active is not None and active.info.run_id == run_id:
                mlflow.end_run(status=status)  # pops it from MLflow's stack even when the server is gone
            else:
                client.set_terminated(run_id, status)


def _end_forgotten() -> None:
    """atexit: a stage run still open when the interpreter exits ends FAILED, never RUNNING (and before
    MLflow's own atexit hook, registered earlier, would end it FINISHED)."""
    while _OPEN_RUNS:
        _end(_OPEN_RUNS[-1], "FAILED", "process exited with the run still open")
        _OPEN_RUNS.pop()



@contextlib.contextmanager
def stage_run(stage: str, config: Any = None, tags: Mapping[str, Any] | None = None,
              variant: str | None = None) -> Iterator[Any]:
    """Open a run named `run_name(stage, variant)` (nested under the flow's parent run if any); yields the
    MLflow Run. The body's exception propagates unchanged and ends the run FAILED with `rcgrpo.error`
    (KILLED for Ctrl-C / SIGTERM / SIGHUP)."""
    preflight()
    mlflow = mlflow_module()
    if not _HOOKED:  # after MLflow's own atexit hook (it ends runs FINISHED): atexit runs last-in first
        atexit.register(_end_forgotten)
        _HOOKED.append(True)
    exp_id = experiment_id()
    reap_orphans(exp_id)
    active = mlflow.active_run()
    parent = None if active else os.environ.get(PARENT_ENV) or None
    name = run_name(stage, variant)
    all_tags = run_tags(stage, {**({"rcgrpo.variant": name.partition("@")[2]} if "@" in name else {}),
                                **(tags or {})})
    run = call("start_run", mlflow.start_run, experiment_id=exp_id, run_name=name,
               nested=active is not None, parent_run_id=parent, tags=all_tags)
    run_id = run.info.run_id
    _OPEN_RUNS.append(run_id)
    handlers = stops.raise_on_terminate()
    try:
        params = safe_params(config)
        if params:
            call("log_params", mlflow.log_params, params)
        yield run
    except BaseException as exc:
        killed = isinstance(exc, (KeyboardInterrupt, stops.Terminated))
        _end(run_id, "KILLED" if killed else "FAILED", describe_error(exc))
        if run_id in _OPEN_RUNS:  # only now: if _end was cut short, the atexit hook ends the run
            _OPEN_RUNS.remove(run_id)
        raise
    else:
        _finish(run_id)
    finally:
        stops.restore(handlers)


def _finish(run_id: str) -> None:
    """End run `run_id` FINISHED (once); a failure raises TrackingError."""
    if run_id in _OPEN_RUNS:
        _OPEN_RUNS.remove(run_id)
        call("end_run", mlflow_module().end_run, status="FINISHED")


@contextlib.contextmanager
def published_run(stage: str, config: Any = None, outputs: tuple = (), tags: Mapping[str, Any] | None = None,
                  variant: str | None = None, track: bool = True) -> Iterator[tuple[Any, OutputSet]]:
    """A stage run whose outputs and record succeed or fail together; yields (run, staged outputs).

    The outputs (`outputs`: final paths, claimed at once so a concurrent writer fails before any work) are
    written into `staged` temps and logged from there inside the body. After the body the run is ended
    FINISHED, THEN the outputs are renamed into place: a tracking server lost at any point publishes
    nothing (exit 2, run FAILED or reaped); a failed rename ends the already-finished run FAILED. The
    only window left is a crash between the two, which publishes nothing under a FINISHED run.
    Before both, the params the stage read must still be what their file says (`ops.config.
    check_params_unchanged`), else nothing is published and the run ends FAILED with the changed keys.
    `track=False`: the same claim, check and all-or-nothing outputs without a run (yields None for it)."""
    with claim_outputs(*outputs), stage_run(stage, config, tags, variant) if track else contextlib.nullcontext() as run:
        def commit() -> None:
            check_params_unchanged(run_name(stage, variant))
            if run is not None:
                _finish(run.info.run_id)

        with atomic_outputs(before_commit=commit) as staged:
            yield run, staged


def reap_orphans(exp_id: str | None = None, parent_run_id: str | None = None, closed_by: str | None = None
                 ) -> list[str]:
    """End KILLED every RUNNING run of the experiment whose owner process (same host) is gone; with
    `parent_run_id`, also every RUNNING child of that parent (the flow calls this when all its stages
    have exited). The reason goes to `rcgrpo.error` (`closed_by`: who noticed). Best effort and quick:
    never raises. Returns the ids it ended."""
    ended: list[str] = []
    try:
        client = mlflow_module().MlflowClient()
        with quick():
            runs = client.search_runs([exp_id or experiment_id()], "attributes.status = 'RUNNING'",
                                      max_results=500)
            host = socket.gethostname()
            for run in runs:
                who = run.data.tags.get(OWNER_TAG, "")
                h, _, rest = who.partition(":")
                pid, _, start = rest.partition(":")
                orphan = h == host and pid.isdigit() and not stops.alive(int(pid), start or None)
                child = parent_run_id and run.data.tags.get("mlflow.parentRunId") == parent_run_id
                if (orphan or child) and run.info.run_id not in _OPEN_RUNS:
                    note = ("its process ended without closing it (killed, or tracking lost)"
                            + (f"; closed by {closed_by}" if closed_by else ""))
                    with contextlib.suppress(Exception):
                        client.set_tag(run.info.run_id, ERROR_TAG, run.data.tags.get(ERROR_TAG) or note)
                        client.set_terminated(run.info.run_id, "KILLED")
                        ended.append(run.info.run_id)
    except Exception:  # the reaper must never be the reason a stage fails
        pass
    return ended


def open_run(name: str, params: Any = None, tags: Mapping[str, Any] | None = None) -> str:
    """Create a (parent) run without making it active in this process; returns its id."""
    from mlflow.entities import Param

    client = mlflow_module().MlflowClient()
    run = call("create_run", client.create_run, experiment_id(), run_name=name, tags=run_tags(name, tags))
    params = [Param(k, v) for k, v in safe_params(params).items()]
    call("log_batch", client.log_batch, run.info.run_id, params=params)  # MLflow chunks by 100
    return run.info.run_id


def close_run(run_id: str, status: str = "FINISHED", tags: Mapping[str, Any] | None = None) -> None:
    from mlflow.entities import RunTag

    client = mlflow_module().MlflowClient()
    items = [RunTag(tag_key(k), str(v)[:5000]) for k, v in (tags or {}).items()]
    call("log_batch", client.log_batch, run_id, tags=items)
    call("set_terminated", client.set_terminated, run_id, status)
