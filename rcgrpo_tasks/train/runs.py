"""The training-run helpers the sft and rl stages share (one copy each).

- Resume: `fingerprint(config, **inputs)` hashes params, run arguments, input contents (`file_md5` = the
  hash DVC records for a file, `dir_fingerprint` for a model folder) and the training code;
  `last_checkpoint(folder, fp)` is the newest complete and intact Trainer checkpoint stamped with that
  fingerprint (a folder of another run is emptied first; damaged ones are passed over and named:
  `train.checkpoints`); `clear_checkpoints` keeps only the stamp.
- Placement: `train_device(setting)` (params `compute.device`, checked before anything trains),
  `use_cpu(device)` for TrainingArguments, `record_placement` (one log line, MLflow params, the dict the
  metrics JSON carries); `fit_micro_batch` retries a run that ran out of memory with half the micro-batch
  and twice the gradient accumulation (the effective batch is kept).
- `resolve_bf16`, `LORA_TARGETS` / `lora_targets` (every projection of a Llama/Qwen block).
- Plots: `write_tsv` / `read_tsv`, the `dvc plots` files (an empty cell = no value, NaN when read back).
- `RunSpec`: what both stages' run specs share (output paths; writing and logging the result files).
- `lazy_subclass(mixin, "trl.GRPOTrainer")`: a project subclass of a trainer or callback class that is
  imported on first use (trl / transformers are heavy; stage `--help` must not load them).
- Callbacks: `step_metrics` (per-step metrics to MLflow, replaying the steps logged before a resume) and
  `stop_on_signal` (SIGTERM from dvc / Prefect: checkpoint the current step, stop, exit 143).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rcgrpo_tasks.engine.device import MemorySplitWarning, free_memory, is_memory_error, placement, resolve_device
from rcgrpo_tasks.engine.models import bf16_supported
from rcgrpo_tasks.ops import procs, tracking
from rcgrpo_tasks.ops.config import ConfigError, as_dict
from rcgrpo_tasks.ops.io import OutputError, OutputSet, disk_full, disk_full_error, write_json, write_text
from rcgrpo_tasks.train import checkpoints, processes

T = TypeVar("T")
FINGERPRINT_FILE = "rcgrpo_fingerprint.json"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every attention and MLP projection of a Llama / Qwen / SmolLM2 block."""


# ---------------------------------------------------------------------------------------------- resume


def file_md5(path: Path) -> str:
    """MD5 of a file: equal to the hash DVC records for it."""
    h = hashlib.md5()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_fingerprint(path: Path | None) -> str:
    """Cheap content fingerprint of a folder: names, sizes, first and last MiB of each file; "none" when
    there is no folder."""
    if path is None or not Path(path).exists():
        return "none"
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.relative_to(path)}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(-(1 << 20), 2)
                h.update(fh.read())
    return h.hexdigest()


def content_hash(path: Path | None) -> str:
    """`file_md5` of a file, `dir_fingerprint` of a folder, "none" when the path does not exist."""
    return file_md5(path) if path is not None and Path(path).is_file() else dir_fingerprint(path)


def fingerprint(config: Any, **inputs: Any) -> str:
    """sha256 of a config dataclass and the run's inputs: a `Path` counts by its content (`content_hash`),
    anything else by value. Pass the training module's own file as `code=Path(__file__)`: checkpoints
    resume only under the same params, inputs and code."""
    blob = {"config": as_dict(config)}
    for key, value in inputs.items():
        blob[key] = content_hash(value) if isinstance(value, Path) else value
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _stamp(fp_file: Path) -> str | None:
    try:
        return json.loads(fp_file.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _claim(ckpt_dir: Path, fp: str, **stamp: Any) -> None:
    """Empty `ckpt_dir` when it belongs to another run (stamped with another fingerprint, or none), then stamp
    it with `fp` (and the `stamp` fields)."""
    fp_file = ckpt_dir / FINGERPRINT_FILE
    if ckpt_dir.exists() and _stamp(fp_file) != fp:
        shutil.rmtree(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_json(fp_file, {"fingerprint": fp, **stamp})


def last_checkpoint(ckpt_dir: Path, fp: str, clean: bool = True, **stamp: Any) -> str | None:
    """Newest complete and intact `checkpoint-N` in `ckpt_dir` (`checkpoints.newest_intact`: its
    trainer_state.json, written last, exists, and every file the Trainer loads on resume loads).

    With `clean` (one process does it): a folder stamped with another fingerprint, or with none, belongs to
    another run and is emptied; the folder is then stamped with `fp` (and the `stamp` fields)."""
    if clean:
        _claim(Path(ckpt_dir), fp, **stamp)
    return checkpoints.newest_intact(Path(ckpt_dir))[0]


def resume_point(ckpt_dir: Path, fp: str, **stamp: Any) -> str | None:
    """`last_checkpoint` of a (possibly distributed) run: the main process alone cleans and stamps the
    folder, the others wait for it, then every process reads the same checkpoint. Damaged checkpoints
    passed over are reported by the main process (stderr, MLflow tags: `checkpoints.report`)."""
    from accelerate import PartialState

    state = PartialState()  # created by `processes.process_state` at the start of the run
    if state.is_main_process:
        _claim(Path(ckpt_dir), fp, **stamp)
    state.wait_for_everyone()
    resume, damaged = checkpoints.newest_intact(Path(ckpt_dir))
    if state.is_main_process:
        checkpoints.report(Path(ckpt_dir), resume, damaged)
    return resume


def train_or_restore(trainer, resume: str | None):
    """`trainer.train(resume_from_checkpoint=resume)`, except for the last checkpoint of a finished run
    (its `global_step` reached its `max_steps`): that one is loaded (weights, state) and not trained, since
    the Trainer resumed there would run one step more. Returns the Trainer's `TrainOutput` (for a restored
    run: its step and mean logged loss). Under DeepSpeed the weights load only inside `train()`, so there it
    trains as asked."""
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import TrainOutput

    state_file = Path(resume) / "trainer_state.json" if resume else None
    if state_file is None or not state_file.is_file() or trainer.is_deepspeed_enabled:
        return trainer.train(resume_from_checkpoint=resume)
    state = TrainerState.load_from_json(str(state_file))
    if not 0 < state.max_steps <= state.global_step:
        return trainer.train(resume_from_checkpoint=resume)
    trainer._load_from_checkpoint(resume)  # the Trainer's own loader: LoRA adapter or full weights
    trainer.state = state
    losses = [e["loss"] for e in state.log_history if isinstance(e.get("loss"), (int, float))]
    return TrainOutput(state.global_step, sum(losses) / len(losses) if losses else float("nan"), {})


def clear_checkpoints(ckpt_dir: Path) -> None:
    """Delete everything in `ckpt_dir` but its fingerprint stamp (the folder is a DVC `persist` output)."""
    for path in Path(ckpt_dir).iterdir():
        if path.name != FINGERPRINT_FILE:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


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


# ---------------------------------------------------------------------------------------------- settings


def resolve_bf16(flag: bool | None, device=None) -> bool:
    """bf16 autocast: `flag`, or (None) where the hardware the run trains on (`device`; None = CUDA when
    available) has native bf16 (GPU, AVX512-BF16/AMX CPU)."""
    import torch

    if flag is not None:
        return flag
    on_cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    return torch.cuda.is_bf16_supported() if on_cuda else bf16_supported()


def train_device(setting: str):
    """The `torch.device` a training stage runs on for a `compute.device` setting; ConfigError (before
    anything is loaded) where it cannot be honoured: CUDA absent (`resolve_device`), or a GPU index the
    Trainer would not use. transformers' Trainer trains a single process on `cuda:0` and each process of a
    launch on its local GPU, so `cuda:N` (N > 0) would silently train elsewhere: pick the GPU with
    `CUDA_VISIBLE_DEVICES=N` and `device: cuda` instead."""
    device = resolve_device(setting)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device.type == "cuda" and device.index is not None and (device.index != 0 or world > 1):
        raise ConfigError(f"compute.device {setting!r}: training runs on cuda:0 (one process) or on each "
                          f"process's local GPU (a launch); use `CUDA_VISIBLE_DEVICES={device.index}` with "
                          "device: cuda")
    return device


def use_cpu(device) -> bool:
    """TrainingArguments `use_cpu` for the resolved device (None: the CPU when CUDA is absent). An explicit
    `cpu` on a CUDA host must say so: accelerate would otherwise pick the GPU by itself."""
    import torch

    return not torch.cuda.is_available() if device is None else device.type == "cpu"


def record_placement(trainer, stage: str, device, track: bool) -> dict:
    """Where the trainer's model runs (`engine.device.placement`): one line on stderr, MLflow params
    `placement.*` when `track`, and the dict (for the metrics JSON).

    A model that is not on the device the setting named is a RuntimeError (never a silent CPU run);
    DeepSpeed places the model only when training starts, so it is not checked there."""
    place = placement(trainer.accelerator.unwrap_model(trainer.model))
    if device is not None and not trainer.is_deepspeed_enabled and place["device"].split(":")[0] != device.type:
        raise RuntimeError(f"{stage}: the model is on {place['device']}, compute.device asked for {device}")
    name = f" ({place['device_name']})" if place.get("device_name") else ""
    print(f"{stage}: training on {place['device']}{name}, {place['dtype']} weights", file=sys.stderr, flush=True)
    if track:
        params = tracking.safe_params({"placement": place})
        tracking.call("log_params", tracking.mlflow_module().log_params, params)
    return place


def smaller_micro_batch(micro: int) -> int | None:
    """The micro-batch to try after a memory error: the largest divisor of `micro` that is at most half of
    it (8 -> 4 -> 2 -> 1, 10 -> 5 -> 1), so the effective batch stays a whole number of micro-batches;
    None at 1."""
    return next((d for d in range(micro // 2, 0, -1) if micro % d == 0), None)


def fit_micro_batch(attempt: Callable[[int, int], T], micro: int, accum: int, what: str) -> tuple[T, int, int]:
    """(result, micro-batch, gradient accumulation) of the first `attempt(micro, accum)` that does not run
    out of memory (`engine.device.is_memory_error`: CUDA OOM, cuDNN / cuBLAS allocation failures).

    After a memory error the micro-batch shrinks (`smaller_micro_batch`) and the accumulation grows by the
    same factor (effective batch = micro x accum, kept), with a `MemorySplitWarning`, and `attempt` runs
    again: it must build a fresh trainer and continue from the run's resume point (the last complete
    checkpoint, or the start). Any other error, or one at micro-batch 1, propagates; so does every error
    inside a multi-process launch (one process retrying alone would leave the others waiting in a
    collective: lower the micro-batch instead)."""
    while True:
        try:
            return attempt(micro, accum), micro, accum
        except Exception as exc:  # re-raised unless a smaller micro-batch may fit
            smaller = smaller_micro_batch(micro)
            if not is_memory_error(exc) or smaller is None or int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise
            message = (f"{what}: out of memory at micro-batch {micro} x {accum} accumulated "
                       f"({type(exc).__name__}); retrying at {smaller} x {accum * micro // smaller} "
                       "(same effective batch)")
        # Outside the except block: the failed attempt's frames (and the tensors they hold) are gone.
        warnings.warn(message, MemorySplitWarning, stacklevel=2)
        free_memory()
        accum, micro = accum * micro // smaller, smaller


def lora_targets(modules: tuple[str, ...]) -> str | list[str]:
    """PEFT `target_modules`: the module names, or PEFT's "all-linear" for `("all-linear",)`."""
    return "all-linear" if tuple(modules) == ("all-linear",) else list(modules)


# ---------------------------------------------------------------------------------------------- results


def format_cell(value: Any) -> str:
    """A TSV cell: "" for no value (None, NaN), integral numbers exactly, other floats to 6 significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.6g}"
    return str(value)


def write_tsv(path: Path, rows: list[dict], columns: tuple[str, ...]) -> None:
    """The per-step plots file (`dvc plots`): a header of `columns`, one line per row (missing = empty)."""
    lines = ["\t".join(columns)] + ["\t".join(format_cell(r.get(c)) for c in columns) for r in rows]
    write_text(path, "\n".join(lines) + "\n")


def read_tsv(path: Path) -> list[dict]:
    """Rows of a `write_tsv` file as floats (empty cell -> NaN); [] when there is no file."""
    if not Path(path).is_file():
        return []
    lines = Path(path).read_text().splitlines()
    header = lines[0].split("\t") if lines else []
    return [{k: (float(v) if v else float("nan")) for k, v in zip(header, ln.split("\t"))} for ln in lines[1:] if ln]


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
                tracking.log_artifact(path)


@contextlib.contextmanager
def disk_errors(path: Path) -> Iterator[None]:
    """Turn a write that failed for lack of space (an OSError, or torch's / safetensors' own errors:
    `ops.io.disk_full`) into an OutputError naming `path` (one line from the `rcgrpo` entry point, exit 2)."""
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
        tracking.log_metrics({**_numbers(logs), **(self.derived(logs, step) if self.derived else {})}, step=step)

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
