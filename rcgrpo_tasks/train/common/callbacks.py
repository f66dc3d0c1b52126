"""Trainer callbacks and lazily built subclasses, as the sft and rl stages share them (one copy each).

- `lazy_subclass(mixin, "trl.GRPOTrainer")`: a project subclass of a trainer or callback class that is
  imported on first use (trl / transformers are heavy; stage `--help` must not load them).
- `ResumableMixin` / `resumable_callback`: a callback whose state travels with every checkpoint (the
  Trainer's `ExportableState` protocol) and comes back on resume.
- `step_metrics` (per-step metrics to MLflow, replaying the steps logged before a resume) and
  `stop_on_signal` (SIGTERM from dvc / Prefect: checkpoint the current step, stop, exit 143).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import math
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from rcgrpo_tasks.ops import stops, tracking_log
from rcgrpo_tasks.train.common import distributed


def _import(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@functools.cache
def lazy_subclass(mixin: type, base: str, *more: str) -> type:
    """`class Name(mixin, Base, *More)` for `base` (and `more`) = "module.Class", imported here on first use;
    one class per combination.

    The mixin's methods override the bases' and reach them through `super()`; the class is named after the
    mixin without its `Mixin` suffix."""
    parents = tuple(_import(path) for path in (base, *more))
    cls_name = mixin.__name__.removesuffix("Mixin")
    return type(cls_name, (mixin, *parents), {"__module__": mixin.__module__, "__qualname__": cls_name,
                                              "__doc__": mixin.__doc__})


class ResumableMixin:
    """A Trainer callback whose attributes named in `exported` (JSON values) are saved in every checkpoint and
    restored on resume, so a resumed run goes on with what the cut one had gathered up to its checkpoint.

    Saved through the Trainer's `ExportableState` protocol (`state()`: the Trainer writes it into the
    checkpoint's trainer_state.json, `stateful_callbacks`); restored by `restore(state)` from the TrainerState
    the run resumed with, at train begin (and by `checkpoints.train_or_restore` for a finished run). Not
    through `restore_callback_states_from_checkpoint`, which rebuilds each callback from saved constructor
    arguments: these callbacks hold paths, configs and models. Build one with `resumable_callback`."""

    exported: tuple[str, ...] = ()

    def state(self) -> dict:
        return {"args": {}, "attributes": {name: getattr(self, name) for name in self.exported}}

    def restore(self, state) -> None:
        """Take the exported attributes from `state` (a TrainerState) where it holds this callback's; else
        register this callback's current state there (the Trainer's save expects an entry per callback)."""
        key = type(self).__name__
        saved = state.stateful_callbacks.get(key)
        if not isinstance(saved, dict):
            state.stateful_callbacks[key] = self.state()
            return
        for name, value in saved.get("attributes", {}).items():
            if name in self.exported:
                setattr(self, name, copy.deepcopy(value))

    def on_train_begin(self, args, state, control, **kwargs):
        self.restore(state)


def resumable_callback(mixin: type) -> type:
    """The Trainer callback class of a `ResumableMixin` subclass (a `TrainerCallback` and an `ExportableState`)."""
    return lazy_subclass(mixin, "transformers.TrainerCallback", "transformers.trainer_callback.ExportableState")


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


class Interrupted(stops.Terminated):
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
        if distributed.any_process(self.received is not None):
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
