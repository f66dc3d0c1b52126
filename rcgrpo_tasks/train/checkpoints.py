"""Which Trainer checkpoint a run resumes from: the newest one whose files are all there and load.

A checkpoint is complete once its `trainer_state.json` exists (the Trainer writes it last); one without it was
cut by a kill and is passed over silently, as before. A complete one can still be damaged afterwards (a
truncated copy, a disk that filled, a file emptied by hand): resuming from it would fail the same way on every
rerun. `damage(folder)` checks every file the Trainer loads on resume:
- `trainer_state.json` parses, with an integer `global_step`;
- the weights (`adapter_model.safetensors` / `model.safetensors`, shards named by an index, or `*.bin`) open:
  a safetensors header must cover the whole file, which catches any truncation;
- `optimizer.pt`, `scheduler.pt`, `scaler.pt` and the RNG states load with `torch.load` (memory-mapped: their
  tensors are not read, so this costs little even for a full fine-tune's optimizer); where any of them exists
  (a run that saves more than the model), the optimizer, the scheduler and an RNG state must all exist.
DeepSpeed keeps its states in a `global_step*` folder of its own format: there only the files above that are
present are checked. `newest_intact` falls back past damaged checkpoints, and `report` says which were skipped
(one stderr line, and the active MLflow run's tags).
"""

from __future__ import annotations

import sys
from pathlib import Path

from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.io import InputError, read_json

STATE_FILE = "trainer_state.json"
WEIGHTS = ("adapter_model.safetensors", "model.safetensors", "adapter_model.bin", "pytorch_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TRAINING_STATE = ("optimizer.pt", "scheduler.pt")
DAMAGED_TAG = "rcgrpo.damaged_checkpoints"
RESUME_TAG = "rcgrpo.resumed_from"


def step_of(folder: Path) -> int | None:
    """N of a `checkpoint-N` folder (None for any other name)."""
    tail = folder.name.removeprefix("checkpoint-")
    return int(tail) if folder.name.startswith("checkpoint-") and tail.isdigit() else None


def complete(ckpt_dir: Path) -> list[Path]:
    """The checkpoints of `ckpt_dir` that the Trainer finished writing, newest first."""
    found = [p for p in Path(ckpt_dir).glob("checkpoint-*") if step_of(p) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=step_of, reverse=True)


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text.split(". ")[0][:200]


def _safetensors_error(path: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as fh:
            fh.keys()
    except Exception as exc:  # SafetensorError, OSError: any reason the Trainer's loader would fail too
        return f"{path}: {_short(exc)}"
    return None


def _torch_error(path: Path) -> str | None:
    import torch

    if path.stat().st_size == 0:
        return f"{path}: empty file"
    try:
        # The Trainer unpickles these same files on resume (numpy RNG states need full unpickling).
        torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except RuntimeError as exc:
        if "mmap can only be used" not in str(exc):
            return f"{path}: {_short(exc)}"
        try:  # the legacy (non-zip) format cannot be mapped: read it whole
            torch.load(path, map_location="cpu", weights_only=False)
        except Exception as again:
            return f"{path}: {_short(again)}"
    except Exception as exc:  # EOFError, OSError, UnpicklingError...
        return f"{path}: {_short(exc)}"
    return None


def _weight_files(folder: Path) -> list[Path] | str:
    """The weight files of a checkpoint (shards named by an index included), or why they cannot be listed."""
    files = [folder / name for name in WEIGHTS if (folder / name).is_file()]
    for index in (folder / name for name in INDEXES if (folder / name).is_file()):
        try:
            shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        except InputError as exc:
            return str(exc)
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return f"{folder / missing[0]}: missing (listed in {index.name})"
        files += [folder / s for s in shards]
    return files


def damage(folder: Path) -> str | None:
    """Why checkpoint `folder` cannot be resumed from, naming the file (None: intact)."""
    folder = Path(folder)
    try:
        state = read_json(folder / STATE_FILE)
    except InputError as exc:
        return str(exc)
    if not isinstance(state.get("global_step"), int):
        return f"{folder / STATE_FILE}: no integer global_step"
    deepspeed = any(p.is_dir() and p.name.startswith("global_step") for p in folder.iterdir())
    weights = _weight_files(folder)
    if isinstance(weights, str):
        return weights
    if not weights and not deepspeed:
        return f"{folder}: no model weights ({' / '.join(WEIGHTS[:2])})"
    torch_files = [w for w in weights if w.suffix == ".bin"]
    for w in (w for w in weights if w.suffix == ".safetensors"):
        if reason := _safetensors_error(w):
            return reason
    rng = sorted(folder.glob("rng_state*.pth"))
    saved = [folder / n for n in (*TRAINING_STATE, "scaler.pt") if (folder / n).is_file()]
    if (saved or rng) and not deepspeed:
        missing = [n for n in TRAINING_STATE if not (folder / n).is_file()] + ([] if rng else ["rng_state.pth"])
        if missing:
            return f"{folder / missing[0]}: missing"
    for path in torch_files + saved + rng:
        if reason := _torch_error(path):
            return reason
    return None


def newest_intact(ckpt_dir: Path) -> tuple[str | None, list[str]]:
    """(the newest complete checkpoint that is intact, or None; the `damage` of each newer one, which names
    its file)."""
    damaged = []
    for folder in complete(ckpt_dir):
        reason = damage(folder)
        if reason is None:
            return str(folder), damaged
        damaged.append(reason)
    return None, damaged


def report(ckpt_dir: Path, resume: str | None, damaged: list[str]) -> None:
    """Say which damaged checkpoints a run passed over and where it resumes: one stderr line, and the tags of
    the MLflow run active in this process (if any)."""
    if not damaged:
        return
    where = f"resuming from {resume}" if resume else f"no intact checkpoint in {ckpt_dir}: training starts over"
    print(f"warning: damaged checkpoint skipped ({'; '.join(damaged)}); {where}", file=sys.stderr, flush=True)
    if tracking.mlflow_module().active_run() is not None:  # the main process of a tracked run
        tracking.set_tags({DAMAGED_TAG: "; ".join(damaged)[:5000], RESUME_TAG: Path(resume).name if resume else "start"})
