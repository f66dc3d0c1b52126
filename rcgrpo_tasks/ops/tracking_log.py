"""What a stage logs into its MLflow run (`ops.tracking` opens it): params flattened with secrets redacted,
metrics, artifacts (a staged output under the name it will be published as), tables, dicts and tags. Every
call is bounded and fails as one TrackingError line (`ops.tracking_store.call`); credentials never become
params: secret-looking keys and values equal to credential env vars are redacted."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rcgrpo_tasks.ops.names import stage_name as stage_name  # a training run's name: its DVC stage's
from rcgrpo_tasks.ops.outputs import public_path
from rcgrpo_tasks.ops.tracking_store import TrackingError, call, mlflow_module

# Env vars whose values must never appear in params/tags (checked by value, not only by key name).
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                  "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME")
_SECRET_KEY = re.compile(r"(secret|passw|credential|api_?key|access_?key|auth|session_?token)", re.I)
REDACTED = "***"


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


def tag_key(key: str) -> str:
    """MLflow keys allow only [alnum _ - . space : /]: `sft@rctp` -> `sft/rctp`."""
    return re.sub(r"[^\w\-. :/]", "/", key)


def grid_tags(model: str, seed: int | None) -> dict[str, str]:
    """The tags the MLflow UI groups and compares a grid's runs by: `rcgrpo.cell` (the model or RL cell a run
    trains or measures: sft, rctp, rctp-rc_grpo, ...) and `rcgrpo.seed` (its grid seed; absent for a model
    every seed shares). The run itself is named as its DVC stage (`stage_name`)."""
    return {"rcgrpo.cell": model, **({"rcgrpo.seed": str(seed)} if seed is not None else {})}


def set_tags(tags: Mapping[str, Any]) -> None:
    call("set_tags", mlflow_module().set_tags, {k: str(v) for k, v in tags.items()})
