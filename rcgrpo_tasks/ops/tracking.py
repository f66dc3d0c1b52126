"""MLflow tracking for every stage: one small wrapper, so stages never talk to MLflow directly.

- Where: `MLFLOW_TRACKING_URI` (default `sqlite:///mlflow.db`; with a local store, artifacts go to
  `MLFLOW_ARTIFACT_ROOT` or `./mlartifacts`; with a server, the server decides, e.g. S3 via its proxy).
- Experiment: `MLFLOW_EXPERIMENT_NAME` (default `rcgrpo`), tagged `mlflow.experimentKind =
  custom_model_development` (the UI's "machine learning" type) so the UI opens on the runs table, not
  on MLflow 3's GenAI traces page.
- `stage_run(stage, config, variant=...)` opens a run named `<stage>@<variant>` (the variant defaults to
  the DVC foreach key of `$DVC_STAGE`, e.g. `evaluate@rctp-rc_grpo`), nested under the flow's parent run
  when `RCGRPO_PARENT_RUN_ID` is set, logging the config as flattened params plus git/DVC tags.

Never hangs, never silent:
- `preflight()` checks a remote server's `/health` in seconds; the `rcgrpo` entry point calls it before a
  tracked command does any work: one line, exit 2.
- Every HTTP call is bounded: unless already set, `MLFLOW_HTTP_REQUEST_TIMEOUT`=10 s,
  `..._MAX_RETRIES`=3, `..._BACKOFF_FACTOR`=1, `..._BACKOFF_JITTER`=0 (MLflow's own defaults: 120 s and
  7 retries with a factor 2, i.e. minutes per call). A server that refuses fails a call in ~7 s, one that
  hangs in ~50 s.
- Server lost mid-run: FAIL FAST. The failing call raises TrackingError (never swallowed: a run whose
  numbers were not recorded must not look like a success); the stage stops before publishing outputs
  (they are atomic) and the `rcgrpo` entry point prints one line and exits 2. Its run is ended FAILED
  with the error as the `rcgrpo.error` tag with short timeouts and no retries; if the server is still
  gone, the run is left to the reaper below.
- No run stays RUNNING: SIGTERM/SIGHUP/Ctrl-C end a stage's run KILLED (ops.procs raises Terminated);
  an error ends it FAILED with `rcgrpo.error`; an atexit hook ends a run the process forgot FAILED; and
  every run carries `rcgrpo.owner` = host:pid:start, so `reap_orphans()` (run at each stage start and at
  the end of a flow) ends KILLED any RUNNING run whose process is gone (SIGKILL, OOM, tracking lost).
- Credentials never become params: secret-looking keys and values equal to credential env vars are
  redacted. MLflow is imported lazily (it costs ~1 s).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rcgrpo_tasks.ops import procs
from rcgrpo_tasks.ops.config import check_params_unchanged
from rcgrpo_tasks.ops.io import OutputSet, atomic_outputs, claim_outputs, public_path

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACTS = "./mlartifacts"
DEFAULT_EXPERIMENT = "rcgrpo"
PARENT_ENV = "RCGRPO_PARENT_RUN_ID"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
OWNER_TAG = "rcgrpo.owner"
ERROR_TAG = "rcgrpo.error"
# Bounded HTTP for every MLflow call (env values a user set win); QUICK is for closing a run after a failure.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}
QUICK_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
# Env vars whose values must never appear in params/tags (checked by value, not only by key name).
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                  "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME")
_SECRET_KEY = re.compile(r"(secret|passw|credential|api_?key|access_?key|auth|session_?token)", re.I)
REDACTED = "***"
_EXPERIMENTS: dict[tuple[str, str], str] = {}  # (uri, name) -> id, one lookup per process
_OPEN_RUNS: list[str] = []  # stage runs of this process not yet ended (for the atexit hook)
_HOOKED: list[bool] = []


class TrackingError(RuntimeError):
    """MLflow could not be reached or refused a write; the one-line message says what and where."""


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def experiment_name() -> str:
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def shown_uri() -> str:
    """The tracking URI for messages, without any `user:password@` part."""
    return re.sub(r"//[^/@]*@", "//***@", tracking_uri())


def _is_remote(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def mlflow_module():
    for key, value in HTTP_LIMITS.items():
        os.environ.setdefault(key, value)
    try:
        import mlflow
    except ImportError as exc:  # pragma: no cover - mlflow is a core dependency
        raise TrackingError(f"mlflow is not installed: {exc}") from exc
    if not _HOOKED:  # after MLflow's own atexit hook (it ends runs FINISHED): atexit runs last-in first
        atexit.register(_end_forgotten)
        _HOOKED.append(True)
    mlflow.set_tracking_uri(tracking_uri())
    return mlflow


@contextlib.contextmanager
def _quick() -> Iterator[None]:
    """Short timeout, no retries (MLflow reads these env vars per request): for closing a failed run."""
    saved = {k: os.environ.get(k) for k in QUICK_LIMITS}
    os.environ.update(QUICK_LIMITS)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def reason(exc: BaseException) -> str:
    """One short line for an MLflow/requests error (their texts span screens of chained URLs)."""
    text = " ".join(str(exc).split())
    for pattern, short in (("Connection refused", "connection refused"), ("timed out", "timed out"),
                           ("Name or service not known", "unknown host"), ("Max retries exceeded", "no answer")):
        if pattern in text:
            return short
    return text[:300] or type(exc).__name__


def call(what: str, fn, *args, **kwargs):
    """Run one MLflow call; any failure becomes a one-line TrackingError naming the call and the server."""
    try:
        return fn(*args, **kwargs)
    except TrackingError:
        raise
    except Exception as exc:  # MlflowException, requests/OS errors, sqlite errors...
        raise TrackingError(f"MLflow {what} failed (tracking URI {shown_uri()}): {reason(exc)}") from exc


def preflight(timeout: float = 3.0, attempts: int = 2) -> str:
    """Seconds-fast reachability check of a remote tracking server (`/health`); nothing for a local store.
    Raises TrackingError with one line saying what to do. Returns the URI."""
    uri = tracking_uri()
    if not _is_remote(uri):
        return uri
    error: Exception | None = None
    for _ in range(attempts):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout) as resp:
                if resp.status == 200:
                    return uri
                error = OSError(f"HTTP {resp.status}")
        except Exception as exc:  # URLError, timeouts, resets
            error = exc
    raise TrackingError(
        f"MLflow tracking server {shown_uri()} is unreachable ({reason(error)}); start it (`make stack-up`) "
        "or unset MLFLOW_TRACKING_URI to use the local sqlite store")


def check_tracking(timeout: float = 5.0) -> str:
    """Preflight for the flow: the server answers and the experiment exists. Returns the URI."""
    preflight(timeout=timeout)
    experiment_id()
    return tracking_uri()


def experiment_id() -> str:
    """Id of the experiment (created if missing), tagged with the UI's experiment kind."""
    key = (tracking_uri(), experiment_name())
    if key in _EXPERIMENTS:
        return _EXPERIMENTS[key]
    mlflow, name = mlflow_module(), experiment_name()
    exp = call("get_experiment_by_name", mlflow.get_experiment_by_name, name)
    if exp is None:
        location = None
        if not _is_remote(tracking_uri()):
            root = os.environ.get("MLFLOW_ARTIFACT_ROOT") or DEFAULT_ARTIFACTS
            location = Path(root).resolve().as_uri()
        try:
            exp_id = mlflow.create_experiment(name, artifact_location=location,
                                              tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except Exception as exc:  # a concurrent stage may have created it first
            exp = call("get_experiment_by_name", mlflow.get_experiment_by_name, name)
            if exp is None:
                raise TrackingError(f"MLflow could not create experiment {name!r} at {shown_uri()}: "
                                    f"{reason(exc)}") from exc
    if exp is not None:
        exp_id = exp.experiment_id
        if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:  # experiments made before this tag
            call("set_experiment_tag", mlflow.MlflowClient().set_experiment_tag, exp_id,
                 EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    _EXPERIMENTS[key] = exp_id
    return exp_id


def runs_table_url() -> str | None:
    """The UI link that opens on the experiment's runs table (None for a local sqlite/file store).
    MLflow 3.17's UI keeps a browser-wide GenAI / Model-training mode (default GenAI) that wins over the
    experiment kind on a bare experiment link; `workflowType=machine_learning` selects the runs table."""
    uri = tracking_uri()
    if not _is_remote(uri):
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id()}/runs?workflowType=machine_learning"


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dataclass/mapping -> {'a.b': value}; lists become JSON strings."""
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = dataclasses.asdict(data)
    if not isinstance(data, Mapping):
        return {prefix or "value": data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) or dataclasses.is_dataclass(value):
            out.update(flatten(value, name))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value, default=str)
        else:
            out[name] = value
    return out


def safe_params(config: Any) -> dict[str, str]:
    """Flattened params with secrets redacted (by key name and by credential env values)."""
    secrets = [v for k in CREDENTIAL_ENV if len(v := os.environ.get(k, "")) >= 4]
    out = {}
    for key, value in flatten(config if config is not None else {}).items():
        text = str(value)
        if _SECRET_KEY.search(key) or any(s in text for s in secrets):
            text = REDACTED
        out[key] = text[:6000]  # MLflow's param value limit
    return out


def params_hash(params: Any) -> str:
    """Short sha256 of a params mapping (canonical JSON): equal hashes = identical parameters."""
    blob = json.dumps(params, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def owner() -> str:
    """`host:pid:start` of this process: lets a later process tell whether a RUNNING run's owner died."""
    return f"{socket.gethostname()}:{os.getpid()}:{procs.proc_start_time(os.getpid()) or ''}"


def run_tags(stage: str, tags: Mapping[str, Any] | None = None) -> dict[str, str]:
    base = {"rcgrpo.stage": stage, "git.commit": git_commit(), OWNER_TAG: owner(),
            "dvc.stage": os.environ.get("DVC_STAGE", ""), "dvc.root": os.environ.get("DVC_ROOT", "")}
    base.update({k: str(v) for k, v in (tags or {}).items()})
    return {tag_key(k): v for k, v in base.items() if v}


def run_name(stage: str, variant: str | None = None) -> str:
    """`<stage>@<variant>`; without a variant, the foreach key of `$DVC_STAGE` when that stage is this
    one (`evaluate@sft` -> `evaluate@sft`); `stage` already holding `@` is kept as is."""
    if "@" in stage:
        return stage
    if variant is None:
        dvc_stage = os.environ.get("DVC_STAGE", "").rsplit(":", 1)[-1]
        base, _, key = dvc_stage.partition("@")
        variant = key if base == stage and key else None
    return f"{stage}@{variant}" if variant else stage


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
    with _quick():
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
    handlers = procs.raise_on_terminate()
    try:
        params = safe_params(config)
        if params:
            call("log_params", mlflow.log_params, params)
        yield run
    except BaseException as exc:
        killed = isinstance(exc, (KeyboardInterrupt, procs.Terminated))
        _end(run_id, "KILLED" if killed else "FAILED", describe_error(exc))
        if run_id in _OPEN_RUNS:  # only now: if _end was cut short, the atexit hook ends the run
            _OPEN_RUNS.remove(run_id)
        raise
    else:
        _finish(run_id)
    finally:
        procs.restore(handlers)


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


def reap_orphans(exp_id: str | None = None, parent_run_id: str | None = None) -> list[str]:
    """End KILLED every RUNNING run of the experiment whose owner process (same host) is gone; with
    `parent_run_id`, also every RUNNING child of that parent (the flow calls this when all its stages
    have exited). Best effort and quick: never raises. Returns the ids it ended."""
    ended: list[str] = []
    try:
        client = mlflow_module().MlflowClient()
        with _quick():
            runs = client.search_runs([exp_id or experiment_id()], "attributes.status = 'RUNNING'",
                                      max_results=500)
            host = socket.gethostname()
            for run in runs:
                who = run.data.tags.get(OWNER_TAG, "")
                h, _, rest = who.partition(":")
                pid, _, start = rest.partition(":")
                orphan = h == host and pid.isdigit() and not procs.alive(int(pid), start or None)
                child = parent_run_id and run.data.tags.get("mlflow.parentRunId") == parent_run_id
                if (orphan or child) and run.info.run_id not in _OPEN_RUNS:
                    note = "its process ended without closing it (killed, or tracking lost)"
                    with contextlib.suppress(Exception):
                        client.set_tag(run.info.run_id, ERROR_TAG, run.data.tags.get(ERROR_TAG) or note)
                        client.set_terminated(run.info.run_id, "KILLED")
                        ended.append(run.info.run_id)
    except Exception:  # the reaper must never be the reason a stage fails
        pass
    return ended


def log_metrics(metrics: Mapping[str, Any], step: int | None = None) -> None:
    clean = {}
    for key, value in metrics.items():
        if value is None:
            continue
        try:
            clean[key] = float(value)
        except (TypeError, ValueError) as exc:
            raise TrackingError(f"metric {key!r} is not a number: {value!r}") from exc
    call("log_metrics", mlflow_module().log_metrics, clean, step=step)


def log_artifact(path: str | Path, artifact_path: str | None = None) -> None:
    """Log a file, or a folder's contents, under `artifact_path`. A staged output (`published_run`) is
    logged under the name it will be published as, not its temp name."""
    path, mlflow = Path(path), mlflow_module()
    if not path.exists():
        raise TrackingError(f"artifact {path} does not exist")
    if path.is_dir():
        call("log_artifact", mlflow.log_artifacts, str(path), artifact_path)
        return
    final = public_path(path)
    if final.name == path.name:
        call("log_artifact", mlflow.log_artifact, str(path), artifact_path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        named = Path(tmp) / final.name
        shutil.copyfile(path, named)
        call("log_artifact", mlflow.log_artifact, str(named), artifact_path)


def log_files(paths: list[str | Path], artifact_path: str | None = None, missing_ok: bool = False) -> list[str]:
    """Log several files (e.g. the report's table and plot: `log_files([table_md, plot_png], "report")`);
    a missing one raises TrackingError unless `missing_ok`. Returns the names logged."""
    logged = []
    for path in map(Path, paths):
        if missing_ok and not path.exists():
            continue
        log_artifact(path, artifact_path)
        logged.append(public_path(path).name)
    return logged


def log_table(rows_or_df: Any, name: str) -> None:
    """Log rows (list of dicts), a dict of columns, or a DataFrame as a table artifact `name`."""
    if isinstance(rows_or_df, list):
        import pandas as pd

        rows_or_df = pd.DataFrame(rows_or_df)
    artifact = name if name.endswith(".json") else f"{name}.json"
    call("log_table", mlflow_module().log_table, rows_or_df, artifact)


def log_dict(data: Any, name: str) -> None:
    call("log_dict", mlflow_module().log_dict, data, name)


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


def tag_key(key: str) -> str:
    """MLflow keys allow only [alnum _ - . space : /]: `sft@rctp` -> `sft/rctp`."""
    return re.sub(r"[^\w\-. :/]", "/", key)


def set_tags(tags: Mapping[str, Any]) -> None:
    call("set_tags", mlflow_module().set_tags, {k: str(v) for k, v in tags.items()})
