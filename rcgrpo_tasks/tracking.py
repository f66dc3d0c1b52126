"""MLflow tracking for every stage: one small wrapper, so stages never talk to MLflow directly.

- Where: `MLFLOW_TRACKING_URI` (default `sqlite:///mlflow.db`; with a local store, artifacts go to
  `MLFLOW_ARTIFACT_ROOT` or `./mlartifacts`; with a server, the server decides, e.g. S3 via its proxy).
- Experiment: `MLFLOW_EXPERIMENT_NAME` (default `rcgrpo`).
- `stage_run(stage, config)` opens a run named after the stage, nested under the flow's parent run when
  `RCGRPO_PARENT_RUN_ID` is set, and logs the config as flattened params plus git/DVC tags.
- Every tracking failure raises `TrackingError` (never swallowed): a run whose numbers were not recorded
  must not look like a success. `check_tracking()` fails fast on an unreachable server, before training.
- Credentials never become params: secret-looking keys and values equal to credential env vars are
  redacted. MLflow is imported lazily (it costs ~1 s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

DEFAULT_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACTS = "./mlartifacts"
DEFAULT_EXPERIMENT = "rcgrpo"
PARENT_ENV = "RCGRPO_PARENT_RUN_ID"
# Env vars whose values must never appear in params/tags (checked by value, not only by key name).
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                  "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME")
_SECRET_KEY = re.compile(r"(secret|passw|credential|api_?key|access_?key|auth|session_?token)", re.I)
REDACTED = "***"


class TrackingError(RuntimeError):
    """MLflow could not be reached or refused a write; the message says what and where."""


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
    try:
        import mlflow
    except ImportError as exc:  # pragma: no cover - mlflow is a core dependency
        raise TrackingError(f"mlflow is not installed: {exc}") from exc
    mlflow.set_tracking_uri(tracking_uri())
    return mlflow


def call(what: str, fn, *args, **kwargs):
    """Run one MLflow call; any failure becomes a TrackingError naming the call and the server."""
    try:
        return fn(*args, **kwargs)
    except TrackingError:
        raise
    except Exception as exc:  # MlflowException, requests/OS errors, sqlite errors...
        raise TrackingError(f"MLflow {what} failed (tracking URI {shown_uri()}): {exc}") from exc


def check_tracking(timeout: float = 5.0) -> str:
    """Preflight: fail fast with a clear message if the tracking store is unusable. Returns the URI."""
    uri = tracking_uri()
    if _is_remote(uri):
        import urllib.request

        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout) as resp:
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
        except Exception as exc:
            raise TrackingError(
                f"MLflow tracking server {shown_uri()} is unreachable ({exc}); start it (`make stack-up`) "
                "or unset MLFLOW_TRACKING_URI to use the local sqlite store") from exc
    _experiment_id()
    return uri


def _experiment_id() -> str:
    mlflow = mlflow_module()
    name = experiment_name()
    exp = call("get_experiment_by_name", mlflow.get_experiment_by_name, name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if not _is_remote(tracking_uri()):
        root = os.environ.get("MLFLOW_ARTIFACT_ROOT") or DEFAULT_ARTIFACTS
        location = Path(root).resolve().as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception as exc:  # a concurrent stage may have created it first
        exp = call("get_experiment_by_name", mlflow.get_experiment_by_name, name)
        if exp is None:
            raise TrackingError(f"MLflow could not create experiment {name!r} at {shown_uri()}: {exc}")
        return exp.experiment_id


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


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_tags(stage: str, tags: Mapping[str, Any] | None = None) -> dict[str, str]:
    base = {"rcgrpo.stage": stage, "git.commit": git_commit(),
            "dvc.stage": os.environ.get("DVC_STAGE", ""), "dvc.root": os.environ.get("DVC_ROOT", "")}
    base.update({k: str(v) for k, v in (tags or {}).items()})
    return {tag_key(k): v for k, v in base.items() if v}


@contextlib.contextmanager
def stage_run(stage: str, config: Any = None, tags: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """Open a run named `stage` (nested under the flow's parent run if any); yields the MLflow Run.

    The body's own exception ends the run FAILED and propagates unchanged.
    """
    mlflow = mlflow_module()
    exp_id = _experiment_id()
    active = mlflow.active_run()
    parent = None if active else os.environ.get(PARENT_ENV) or None
    run = call("start_run", mlflow.start_run, experiment_id=exp_id, run_name=stage,
                nested=active is not None, parent_run_id=parent, tags=run_tags(stage, tags))
    try:
        params = safe_params(config)
        if params:
            call("log_params", mlflow.log_params, params)
        yield run
    except BaseException:
        with contextlib.suppress(Exception):
            mlflow.end_run(status="FAILED")
        raise
    call("end_run", mlflow.end_run, status="FINISHED")


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
    """Log a file, or a folder's contents, under `artifact_path`."""
    path, mlflow = Path(path), mlflow_module()
    if not path.exists():
        raise TrackingError(f"artifact {path} does not exist")
    fn = mlflow.log_artifacts if path.is_dir() else mlflow.log_artifact
    call("log_artifact", fn, str(path), artifact_path)


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
    run = call("create_run", client.create_run, _experiment_id(), run_name=name, tags=run_tags(name, tags))
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
