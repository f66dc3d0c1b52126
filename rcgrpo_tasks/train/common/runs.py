"""A training run's outputs and record, as the sft and rl stages share them (one copy each).

- `RunSpec`: what both stages' run specs share (output paths; writing and logging the result files).
- `published`: the run's MLflow record and staged outputs on the main process; `disk_errors`: a full disk
  named by the output; `dvc_hashes`: DVC's md5 of the inputs, for the record.
Elsewhere in `train.common`: resume (fingerprints, the checkpoint a run resumes from) in `checkpoints`, the
device, bf16 and micro-batch fitting in `placement`, the Trainer callbacks and lazy subclasses in
`callbacks`, training across processes in `distributed`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import yaml

from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.outputs import OutputError, OutputSet, disk_full, disk_full_error, write_json, write_tsv


@contextlib.contextmanager
def system_metrics(on: bool) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory) sampled for the runs started inside, unless the caller's environment
    says otherwise: MLflow's switch is an environment variable, set for this block only, so no process started
    after it (a later stage, a test's child) inherits it."""
    key = "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"
    before = os.environ.get(key)
    if on and before is None:
        os.environ[key] = "true"
    try:
        yield
    finally:
        if on and before is None:
            os.environ.pop(key, None)


def dvc_hashes(paths: list[Path], lock: Path = Path("dvc.lock")) -> dict[str, str]:
    """DVC's recorded md5 of each path (or of the folder output containing it), from dvc.lock."""
    if not lock.is_file():
        return {}
    outs = {}
    for stage in (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).values():
        for out in stage.get("outs", []) or []:
            outs[out["path"]] = out.get("md5")
    found = {}
    for p in paths:
        parts = Path(p).parts
        for i in range(len(parts), 0, -1):
            key = str(Path(*parts[:i]))
            if outs.get(key):
                found[str(p)] = f"{key}:{outs[key]}"
                break
    return found


class RunSpec:
    """Base of the stages' run specs (frozen dataclasses declaring these fields): the output model folder
    `out`, the checkpoint folder (resume point), the metrics JSON and the plots TSV (both optional)."""

    out: Path
    checkpoints: Path
    metrics: Path | None
    plots: Path | None

    @property
    def outputs(self) -> tuple[Path | None, ...]:
        """What a run publishes (claimed before training, so a second run into them fails at once) and its
        resume state (claimed too: two runs must never train into one checkpoint folder)."""
        return (self.out, self.metrics, self.plots, self.checkpoints)

    def write_results(self, staged: OutputSet, rows: list[dict], columns: tuple[str, ...], summary: dict) -> None:
        """The plots TSV (`rows`) and the metrics JSON (`summary`), where configured, staged in `staged`."""
        if self.plots:
            write_tsv(staged.file(self.plots), rows, columns)
        if self.metrics:
            write_json(staged.file(self.metrics), summary)

    def log_results(self, staged: OutputSet, *extra: Path) -> None:
        """The staged result files (metrics, plots) and `extra`, as artifacts of the active MLflow run."""
        for path in [staged.temp(p) for p in (self.metrics, self.plots) if p] + list(extra):
            if Path(path).is_file():
                tracking_log.log_artifact(path)


@contextlib.contextmanager
def disk_errors(path: Path) -> Iterator[None]:
    """Turn a write that failed for lack of space (an OSError, or torch's / safetensors' own errors:
    `ops.outputs.disk_full`) into an OutputError naming `path` (one line from the `rcgrpo` entry point, exit 2)."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OutputError) or not disk_full(exc):
            raise
        raise disk_full_error(path, exc) from exc


@contextlib.contextmanager
def published(main: bool, track: bool, stage: str, params: dict, tags: dict, outputs: tuple):
    """(run, staged outputs) of a training run (`tracking.published_run`: outputs claimed at once, published
    together with the run record) on the main process; (None, None) on the others, which write nothing."""
    if not main:
        yield None, None
        return
    with tracking.published_run(stage, params, outputs=outputs, tags=tags, track=track) as pair:
        yield pair
