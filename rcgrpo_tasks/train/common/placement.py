"""Where a training run trains and with what batch: `train_device(setting)` (params `compute.device`, checked
before anything trains), `use_cpu(device)` for TrainingArguments, `resolved_bf16`, `record_placement` (one log
line, MLflow params, the dict the metrics JSON carries); `fit_micro_batch` retries a run that ran out of memory
with half the micro-batch and twice the gradient accumulation (the effective batch is kept)."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import TypeVar

from rcgrpo_tasks.engine.compute import check_resolved
from rcgrpo_tasks.engine.device import MemorySplitWarning, free_memory, is_memory_error, placement, resolve_device
from rcgrpo_tasks.ops import tracking_log, tracking_store
from rcgrpo_tasks.ops.config import ConfigError

T = TypeVar("T")


def resolved_bf16(flag: bool | None) -> bool:
    """bf16 autocast of a training run as its config was resolved (`RLConfig.resolved` / `SftConfig.resolved`:
    THE dtype rule, once per stage, `engine.compute.resolve_compute`); `null` is refused, never silently off."""
    return check_resolved(flag, "bf16")


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
        params = tracking_log.safe_params({"placement": place})
        tracking_store.call("log_params", tracking_store.mlflow_module().log_params, params)
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
