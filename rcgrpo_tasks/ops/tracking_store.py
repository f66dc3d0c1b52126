"""The MLflow tracking store the stages talk to (`ops.tracking` opens their runs, `ops.tracking_log` logs into
them): where it is, its experiment, and every call to it bounded and one line on failure.

- Where: `MLFLOW_TRACKING_URI` (default `sqlite:///mlflow.db`; with a local store, artifacts go to
  `MLFLOW_ARTIFACT_ROOT` or `./mlartifacts`; with a server, the server decides, e.g. S3 via its proxy).
- Experiment: `MLFLOW_EXPERIMENT_NAME` (default `rcgrpo`), tagged `mlflow.experimentKind =
  custom_model_development` (the UI's "machine learning" type) so the UI opens on the runs table, not
  on MLflow 3's GenAI traces page.
- `preflight()` checks a remote server's `/health` in seconds; the `rcgrpo` entry point calls it before a
  tracked command does any work: one line, exit 2.
- Every HTTP call is bounded: unless already set, `MLFLOW_HTTP_REQUEST_TIMEOUT`=10 s,
  `..._MAX_RETRIES`=3, `..._BACKOFF_FACTOR`=1, `..._BACKOFF_JITTER`=0 (MLflow's own defaults: 120 s and
  7 retries with a factor 2, i.e. minutes per call; measured: docs/log.md, "Tracking"). `call` turns
  any failure into a one-line TrackingError. MLflow is imported lazily (its import is slow).
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACTS = "./mlartifacts"
DEFAULT_EXPERIMENT = "rcgrpo"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# Bounded HTTP for every MLflow call (env values a user set win); QUICK is for closing a run after a failure.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}
# MLflow's telemetry off unless the user's environment says otherwise: on a host that cannot reach MLflow's
# telemetry service (an offline cluster) the client's config thread fails and unsets
# `_MLFLOW_TELEMETRY_SESSION_ID` in os.environ while the stage's own thread may be copying the environment (a
# KeyError naming that variable, raised from whatever MLflow call was copying it).
TELEMETRY = {"MLFLOW_DISABLE_TELEMETRY": "true"}
QUICK_LIMITS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "3", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
_EXPERIMENTS: dict[tuple[str, str], str] = {}  # (uri, name) -> id, one lookup per process


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
    for key, value in {**HTTP_LIMITS, **TELEMETRY}.items():
        os.environ.setdefault(key, value)
    try:
        import mlflow
    except ImportError as exc:  # pragma: no cover - mlflow is a core dependency
        raise TrackingError(f"mlflow is not installed: {exc}") from exc
    mlflow.set_tracking_uri(tracking_uri())
    return mlflow



@contextlib.contextmanager
def quick() -> Iterator[None]:
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


@contextlib.contextmanager
def _first_touch() -> Iterator[None]:
    """Serialise a process's first use of a local sqlite store with the others': MLflow creates or migrates
    the schema on first use, and stages started side by side (`rcgrpo run-plan --jobs`, parallel flow
    tasks) doing it at once collide (`duplicate column name`). An exclusive lock on `<db>.lock` beside it."""
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def experiment_id() -> str:
    """Id of the experiment (created if missing), tagged with the UI's experiment kind."""
    key = (tracking_uri(), experiment_name())
    if key in _EXPERIMENTS:
        return _EXPERIMENTS[key]
    with _first_touch():
        _EXPERIMENTS[key] = _find_or_create()
    return _EXPERIMENTS[key]


def _find_or_create() -> str:
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
    return exp_id


def runs_table_url() -> str | None:
    """The UI link that opens on the experiment's runs table (None for a local sqlite/file store).
    MLflow 3.17's UI keeps a browser-wide GenAI / Model-training mode (default GenAI) that wins over the
    experiment kind on a bare experiment link; `workflowType=machine_learning` selects the runs table."""
    uri = tracking_uri()
    if not _is_remote(uri):
        return None
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id()}/runs?workflowType=machine_learning"
