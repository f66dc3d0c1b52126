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
  (a run that saves more than the model), the optimizer, the scheduler and an RNG state must all exist;
- the trainers' own resume state beside the RNG states (`rcgrpo_*.pt`: the GRPO generation in flight,
  `rcgrpo_*.json`: SFT's token count) loads with `torch.load` / parses.
DeepSpeed keeps its states in a `global_step*` folder of its own format: there only the files above that are
present are checked. `newest_intact` falls back past damaged checkpoints, and `report` says which were skipped
(one stderr line, and the active MLflow run's tags).

Resume: `fingerprint(config, **inputs)` hashes params, run arguments, input contents (`file_md5` = the hash DVC
records for a file, `dir_fingerprint` for a model folder) and the training code; `last_checkpoint(folder, fp)` /
`resume_point` (a distributed run) is the newest intact checkpoint stamped with that fingerprint (a folder of
another run is emptied first); `train_or_restore` restores a finished run instead of training it a step
further; `run_loss` is a run's mean loss over every step it logged, before and after a resume;
`clear_checkpoints` keeps only the stamp.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from rcgrpo_tasks.ops import tracking_log, tracking_store
from rcgrpo_tasks.ops.config import as_dict
from rcgrpo_tasks.ops.inputs import InputError, read_json
from rcgrpo_tasks.ops.outputs import write_json
from rcgrpo_tasks.train.common.callbacks import ResumableMixin
from rcgrpo_tasks.train.common.generation_state import GENERATION_STATE

TOKEN_COUNT_STEM = "rcgrpo_token_count"
"""File name stem, in each checkpoint, of TRL's trained-token count (`..._<process>.json` under several processes;
written by `train.sft.trainer_mixin`, checked by `damage`)."""

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
    for path in torch_files + saved + rng + sorted(folder.glob(f"{GENERATION_STATE}*.pt")):
        if reason := _torch_error(path):
            return reason
    for path in sorted(folder.glob(f"{TOKEN_COUNT_STEM}*.json")):
        try:
            read_json(path)
        except InputError as exc:
            return str(exc)
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
    if tracking_store.mlflow_module().active_run() is not None:  # the main process of a tracked run
        tracking_log.set_tags({DAMAGED_TAG: "; ".join(damaged)[:5000], RESUME_TAG: Path(resume).name if resume else "start"})


# ---------------------------------------------------------------------------------------------- resume

FINGERPRINT_FILE = "rcgrpo_fingerprint.json"


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
    """Newest complete and intact `checkpoint-N` in `ckpt_dir` (`newest_intact`: its
    trainer_state.json, written last, exists, and every file the Trainer loads on resume loads).

    With `clean` (one process does it): a folder stamped with another fingerprint, or with none, belongs to
    another run and is emptied; the folder is then stamped with `fp` (and the `stamp` fields)."""
    if clean:
        _claim(Path(ckpt_dir), fp, **stamp)
    return newest_intact(Path(ckpt_dir))[0]


def resume_point(ckpt_dir: Path, fp: str, **stamp: Any) -> str | None:
    """`last_checkpoint` of a (possibly distributed) run: the main process alone cleans and stamps the
    folder, the others wait for it, then every process reads the same checkpoint. Damaged checkpoints
    passed over are reported by the main process (stderr, MLflow tags: `report`)."""
    from accelerate import PartialState

    state = PartialState()  # created by `distributed.process_state` at the start of the run
    if state.is_main_process:
        _claim(Path(ckpt_dir), fp, **stamp)
    state.wait_for_everyone()
    resume, damaged = newest_intact(Path(ckpt_dir))
    if state.is_main_process:
        report(Path(ckpt_dir), resume, damaged)
    return resume


def run_loss(log_history: list[dict]) -> float:
    """The run's mean training loss from the Trainer state's log history (restored on resume), each logged
    loss weighted by the steps it averages; NaN when none was logged. The Trainer's own
    `TrainOutput.training_loss` covers only the steps of its `train()` call, i.e. after the resume point."""
    total, steps, last = 0.0, 0, 0
    for entry in log_history:
        if isinstance(entry.get("loss"), (int, float)) and isinstance(entry.get("step"), int):
            total += entry["loss"] * (entry["step"] - last)
            steps, last = steps + entry["step"] - last, entry["step"]
    return total / steps if steps else float("nan")


def train_or_restore(trainer, resume: str | None) -> None:
    """`trainer.train(resume_from_checkpoint=resume)`, except for the last checkpoint of a finished run
    (its `global_step` reached its `max_steps`): that one is loaded (weights, state) and not trained, since
    the Trainer resumed there would run one step more. Under DeepSpeed the weights load only inside `train()`, so there it
    trains as asked. A restored run's resumable callbacks (`callbacks.ResumableMixin`) get their saved state."""
    from transformers.trainer_callback import TrainerState

    state_file = Path(resume) / "trainer_state.json" if resume else None
    if state_file is None or not state_file.is_file() or trainer.is_deepspeed_enabled:
        trainer.train(resume_from_checkpoint=resume)
        return
    state = TrainerState.load_from_json(str(state_file))
    if not 0 < state.max_steps <= state.global_step:
        trainer.train(resume_from_checkpoint=resume)
        return
    trainer._load_from_checkpoint(resume)  # the Trainer's own loader: LoRA adapter or full weights
    trainer.state = state
    for callback in trainer.callback_handler.callbacks:  # what they gathered, as a resumed run has it
        if isinstance(callback, ResumableMixin):
            callback.restore(state)


def clear_checkpoints(ckpt_dir: Path, keep: tuple[str, ...] = ()) -> None:
    """Delete everything in `ckpt_dir` but its fingerprint stamp and the files named in `keep` (the folder
    is a DVC `persist` output)."""
    for path in Path(ckpt_dir).iterdir():
        if path.name != FINGERPRINT_FILE and path.name not in keep:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
