"""The training-run helpers the sft and rl stages share (one copy each).

- Resume (fingerprints, the checkpoint a run resumes from, clearing them) lives in `train.common.checkpoints`,
  the device, bf16 and micro-batch fitting in `placement`; both are re-exported here for the callers that
  still reach them through this module.
- `dvc_hashes`, `lora_targets` (PEFT's `target_modules` of a module list).
- `RunSpec`: what both stages' run specs share (output paths; writing and logging the result files).
- `lazy_subclass(mixin, "trl.GRPOTrainer")`: a project subclass of a trainer or callback class that is
  imported on first use (trl / transformers are heavy; stage `--help` must not load them).
- Callbacks: `step_metrics` (per-step metrics to MLflow, replaying the steps logged before a resume) and
  `stop_on_signal` (SIGTERM from dvc / Prefect: checkpoint the current step, stop, exit 143).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from rcgrpo_tasks.ops import procs, tracking, tracking_log
from rcgrpo_tasks.ops.outputs import OutputError, OutputSet, disk_full, disk_full_error, write_json, write_tsv
from rcgrpo_tasks.train.common import processes
from rcgrpo_tasks.train.common.checkpoints import FINGERPRINT_FILE as FINGERPRINT_FILE
from rcgrpo_tasks.train.common.checkpoints import clear_checkpoints as clear_checkpoints
from rcgrpo_tasks.train.common.checkpoints import dir_fingerprint as dir_fingerprint
from rcgrpo_tasks.train.common.checkpoints import file_md5 as file_md5
from rcgrpo_tasks.train.common.checkpoints import fingerprint as fingerprint
from rcgrpo_tasks.train.common.checkpoints import last_checkpoint as last_checkpoint
from rcgrpo_tasks.train.common.checkpoints import resume_point as resume_point
from rcgrpo_tasks.train.common.checkpoints import train_or_restore as train_or_restore
from rcgrpo_tasks.train.common.placement import fit_micro_batch as fit_micro_batch
from rcgrpo_tasks.train.common.placement import record_placement as record_placement
from rcgrpo_tasks.train.common.placement import resolve_bf16 as resolve_bf16
from rcgrpo_tasks.train.common.placement import train_device as train_device
from rcgrpo_tasks.train.common.placement import use_cpu as use_cpu


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


def lora_targets(modules: tuple[str, ...]) -> str | list[str]:
    """PEFT `target_modules`: the module names, or PEFT's "all-linear" for `("all-linear",)`."""
    return "all-linear" if tuple(modules) == ("all-linear",) else list(modules)


# ---------------------------------------------------------------------------------------------- results


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


# ---------------------------------------------------------------------------------------------- classes


@functools.cache
def lazy_subclass(mixin: type, base: str) -> type:
    """`class Name(mixin, Base)` for `base` = "module.Class", imported here on first use; one class per pair.

    The mixin's methods override the base's and reach it through `super()`; the class is named after the
    mixin without its `Mixin` suffix."""
    module, _, name = base.rpartition(".")
    parent = getattr(importlib.import_module(module), name)
    cls_name = mixin.__name__.removesuffix("Mixin")
    return type(cls_name, (mixin, parent), {"__module__": mixin.__module__, "__qualname__": cls_name,
                                            "__doc__": mixin.__doc__})


def _numbers(logs: dict) -> dict:
    return {k: v for k, v in logs.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class StepMetricsMixin:
    """Per-step metrics to MLflow: at every log whose values include `marker`, each finite number logged
    plus `derived(logs, step)`. A resumed run first replays the steps logged before the interruption (the
    Trainer state's log history), so the MLflow run holds the whole curve under the same names."""

    def __init__(self, marker: str = "loss", derived: Callable[[dict, int], dict] | None = None):
        self.marker, self.derived = marker, derived

    def _log(self, logs: dict, step: int) -> None:
        tracking_log.log_metrics({**_numbers(logs), **(self.derived(logs, step) if self.derived else {})}, step=step)

    def on_train_begin(self, args, state, control, **kwargs):
        for entry in state.log_history:
            if self.marker in entry and "step" in entry:
                self._log(entry, entry["step"])

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.marker in logs:
            self._log(logs, state.global_step)


def step_metrics(marker: str = "loss", derived: Callable[[dict, int], dict] | None = None):
    """A Trainer callback logging step metrics to MLflow (`StepMetricsMixin`); add it on the main process
    of a tracked run only."""
    return lazy_subclass(StepMetricsMixin, "transformers.TrainerCallback")(marker, derived)


# ---------------------------------------------------------------------------------------------- signals


STOP_GRACE_S = 30.0
"""After a stop signal, how long the current optimizer step may run on to end on a checkpoint; past it the run
stops at once and resumes from the last periodic checkpoint (`save_steps`)."""


class Interrupted(procs.Terminated):
    """A stop signal ended the run: exit status `code` = 128 + signal (143 for SIGTERM). A `Terminated`, so
    no `except Exception` swallows it, the MLflow run ends KILLED, nothing is published, and the `rcgrpo`
    entry point prints one line."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.code = 128 + signum


class StopOnSignalMixin:
    """Stop signal during training: finish the optimizer step, save a checkpoint of it, stop; `check()`
    (after `train()`) then raises `Interrupted`. Outside the training loop, or on a second signal,
    `Interrupted` is raised at once. The checkpoint is the resume point of the re-run."""

    def __init__(self):
        self.received: int | None = None
        self.stopped = False
        self.training = False

    def handle(self, signum, frame) -> None:
        if self.received is not None or not self.training:
            raise Interrupted(self.received or signum)
        self.received = signum
        print(f"{signal.Signals(signum).name} received: stopping after the current step (checkpointed), or in "
              f"{STOP_GRACE_S:.0f} s from the last checkpoint", file=sys.stderr, flush=True)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, self.handle)  # the grace ran out: the second-signal path
            signal.setitimer(signal.ITIMER_REAL, STOP_GRACE_S)

    def on_train_begin(self, args, state, control, **kwargs):
        self.training = True

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False

    def on_step_end(self, args, state, control, **kwargs):
        if processes.any_process(self.received is not None):
            self.stopped = control.should_save = control.should_training_stop = True

    def check(self) -> None:
        """Raise `Interrupted` if a signal stopped training (on any process)."""
        if self.stopped:
            signal.setitimer(signal.ITIMER_REAL, 0)
            raise Interrupted(self.received or signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signal(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[Any]:
    """A `StopOnSignalMixin` Trainer callback with its handler installed for `signals` (main thread only;
    elsewhere Python cannot install handlers and the default action stays); the old handlers come back on exit."""
    callback = lazy_subclass(StopOnSignalMixin, "transformers.TrainerCallback")()
    installed = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, callback.handle) for s in signals} if installed else {}
    alarm = signal.getsignal(signal.SIGALRM) if installed else None
    try:
        yield callback
    finally:
        if installed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, alarm)
        for s, handler in previous.items():
            signal.signal(s, handler)
