"""sft stage: SFT (experts only) and RCTP-FT (reward-token-labelled mixed data) with TRL + PEFT LoRA.

One definition, two runs (`dvc.yaml` foreach `sft@sft`, `sft@rctp`): `--variant` picks the overrides in
`params.yaml:sft.variants` (the paper: 2 epochs SFT, 5 epochs RCTP).
Reads: `--model-dir` (base model folder, `prepare_model`), `--data` (a `label_rewards` chat dataset:
rows `{"messages", "trajectory_id", "entry_id", "reward_token", "reward"}`), `params.yaml` sections `sft`
and `label_rewards` (its `tokens` are the reward tokens).
Writes: `--out` (atomically): a standard PEFT adapter folder + the extended tokenizer + `rcgrpo_sft.json`
(or, with `full_finetune`, a full model folder); `--metrics` (JSON summary), `--plots` (per-step TSV for
`dvc plots`); `--checkpoints` (periodic Trainer checkpoints, a DVC `persist` output: a killed run re-run
with the same params and inputs resumes from the last complete one; other params discard them).
MLflow (via `tracking`): params (config, data/model hashes), step metrics (loss, lr, grad norm, tokens/s),
system metrics, the final adapter (`mlflow.transformers`, base = the local model folder).

How it trains: loss on assistant tokens only (`label_rewards.assistant_token_mask`, the ONE mask of the
project; SmolLM2's template has no `{% generation %}` markers, so rows are pre-tokenized and TRL gets
`input_ids` + `assistant_masks`). The reward tokens (`<|low_reward|>`, `<|high_reward|>`, any configured
level) are added as special tokens, the embeddings resized, and their rows trained through PEFT
`trainable_token_indices` (saved in the adapter, ~KBs). CPU speed: bf16 autocast where the CPU has native
bf16, no gradient checkpointing (TRL's default turns it on), the LM head applied to assistant positions
only (TRL's fused head scores every position off-GPU); see bench/sft_throughput.py.

Consumers load a trained model with `load_trained(model_dir, adapter_dir)` (tokenizer from the adapter
folder, base embeddings resized to it, then `PeftModel.from_pretrained`): see docs/training.md.
Run: `rcgrpo sft --variant rctp --model-dir models/base --data data/datasets/rctp.jsonl --out
models/sft/rctp --checkpoints checkpoints/sft/rctp --metrics metrics/sft_rctp.json --plots plots/sft_rctp.tsv`.
Departures from the paper: LoRA (+ trainable reward-token rows) instead of full fine-tuning by default,
tiny step budgets on CPU (`configs/paper.yaml` holds the paper's values).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import typer

from rcgrpo_tasks.adapters import (  # noqa: F401  (load_trained: the loader every consumer uses, via sft)
    add_special_tokens, compact_head_loss, expose_head_bias, load_logged_model, load_trained, log_model,
    small_adapter_saves)
from rcgrpo_tasks.config import ConfigError, as_dict, from_dict, load_config, read_params
from rcgrpo_tasks.io import InputError, atomic_dir, read_jsonl, write_json, write_text

META_FILE = "rcgrpo_sft.json"
FINGERPRINT_FILE = "rcgrpo_sft_fingerprint.json"
ROLES = {"system", "user", "assistant", "tool"}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PLOT_COLUMNS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_s", "num_tokens",
                "mean_token_accuracy", "entropy")


@dataclass(frozen=True)
class SftConfig:
    learning_rate: float = 2e-4
    """Peak learning rate (AdamW). The paper: 1e-5 with full fine-tuning of a 7B model."""
    num_epochs: float = 1.0
    """Passes over the dataset (the paper: 2 for SFT, 5 for RCTP); `max_steps` > 0 caps it."""
    max_steps: int = -1
    """Optimizer steps; > 0 overrides `num_epochs` (the embedded CPU budget)."""
    batch_size: int = 2
    """Sequences per device per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (effective batch = batch_size x grad_accum x devices)."""
    max_length: int = 1024
    """Tokens per sequence; longer chats are cut at the end, rows left without assistant tokens dropped."""
    max_examples: int | None = None
    """Train on this many rows (seeded, round-robin over reward tokens, skipping rows that do not fit
    `max_length`); None = all."""
    warmup_ratio: float = 0.0
    """Fraction of steps of linear warm-up."""
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """Learning-rate schedule after warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    seed: int = 0
    """Seed of the data order, LoRA init and dropout."""
    full_finetune: bool = False
    """Train every weight (GPU, accelerate/DeepSpeed) instead of LoRA; output is a full model folder."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA input."""
    lora_target_modules: tuple[str, ...] = LORA_TARGETS
    """Module names that get LoRA (or ("all-linear",))."""
    extra_special_tokens: tuple[str, ...] = ()
    """Special tokens added besides the reward tokens of `label_rewards.tokens`."""
    require_reward_token: bool = False
    """Every row must carry a reward token (RCTP) — guards against training RCTP on the SFT file."""
    bf16: bool | None = None
    """bf16 autocast; None = where supported (GPU, or a CPU with AVX512-BF16/AMX)."""
    model_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype the base weights are loaded in (bf16 halves memory; LoRA weights stay float32)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, ~1.5x slower; only when memory demands it."""
    padding_free: bool = False
    """Flatten each batch into one sequence (no padding; block-diagonal attention)."""
    compact_lm_head: bool = True
    """On CPU, project only assistant positions through the LM head (TRL scores all of them there)."""
    save_steps: int = 10
    """Checkpoint every this many optimizer steps (resume point)."""
    save_total_limit: int = 2
    """Checkpoints kept (2: a checkpoint being written when killed never leaves zero complete ones)."""
    keep_checkpoints: bool = False
    """Keep the checkpoints after a successful run (default: delete them, the adapter is the output)."""
    logging_steps: int = 1
    """Log loss / lr / grad norm / tokens/s every this many steps."""
    deepspeed: str | None = None
    """DeepSpeed JSON config (e.g. configs/ds_zero3.json) when launched with `accelerate launch`/torchrun."""
    log_model: bool = True
    """Log the final adapter to MLflow with `mlflow.transformers` (base = the local model folder)."""
    variants: dict = field(default_factory=dict)
    """Per-variant overrides, e.g. {rctp: {num_epochs: 5, require_reward_token: true}}."""

    def __post_init__(self) -> None:
        checks = [
            (self.learning_rate > 0 and math.isfinite(self.learning_rate), f"learning_rate must be > 0, got {self.learning_rate}"),
            (self.num_epochs > 0 or self.max_steps > 0, "num_epochs must be > 0 (or set max_steps > 0)"),
            (self.max_steps == -1 or self.max_steps > 0, f"max_steps must be -1 or > 0, got {self.max_steps}"),
            (self.batch_size >= 1 and self.grad_accum >= 1, "batch_size and grad_accum must be >= 1"),
            (self.max_length >= 16, f"max_length must be >= 16, got {self.max_length}"),
            (self.max_examples is None or self.max_examples >= 1, "max_examples must be >= 1 or null"),
            (0 <= self.warmup_ratio < 1, f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}"),
            (self.weight_decay >= 0 and self.max_grad_norm > 0, "weight_decay >= 0 and max_grad_norm > 0 required"),
            (self.lora_r >= 1, f"lora_r (LoRA rank) must be >= 1, got {self.lora_r}"),
            (self.lora_alpha > 0, f"lora_alpha must be > 0, got {self.lora_alpha}"),
            (0 <= self.lora_dropout < 1, f"lora_dropout must be in [0, 1), got {self.lora_dropout}"),
            (bool(self.lora_target_modules), "lora_target_modules must not be empty"),
            (self.save_steps >= 1 and self.save_total_limit >= 1 and self.logging_steps >= 1,
             "save_steps, save_total_limit and logging_steps must be >= 1"),
            (all(isinstance(v, dict) for v in self.variants.values()), "variants: each value must be a mapping"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def resolve(self, variant: str) -> "SftConfig":
        """This config with `variants[variant]` applied (validated like the base section)."""
        if variant not in self.variants:
            raise ConfigError(f"sft: unknown variant {variant!r}; configured: {sorted(self.variants)}")
        merged = {**as_dict(self), **self.variants[variant], "variants": {}}
        return from_dict(SftConfig, merged, where=f"sft.variants.{variant}")


def load_sft_config(params: str | Path, variant: str) -> tuple[SftConfig, tuple[str, ...]]:
    """(resolved config, special tokens to add): reward tokens from `label_rewards.tokens` + extras."""
    cfg = load_config(SftConfig, params, "sft").resolve(variant)
    label = read_params(params).get("label_rewards") or {}
    reward_tokens = tuple(label.get("tokens") or ("<|low_reward|>", "<|high_reward|>"))
    tokens = tuple(dict.fromkeys(reward_tokens + cfg.extra_special_tokens))
    return cfg, tokens


# ---------------------------------------------------------------------------------------------- data


def _row_error(row: Any, tokens: set[str], require_token: bool) -> str | None:
    from rcgrpo_tasks.protocols import format_reward_goal

    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "`messages` must be a non-empty list"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return f"messages[{i}] must be {{role: one of {sorted(ROLES)}, content: str}}"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no assistant message (nothing to learn)"
    token = row.get("reward_token")
    if token is None:
        return "`reward_token` missing (this variant trains on reward-conditioned rows)" if require_token else None
    if token not in tokens:
        return f"reward_token {token!r} is not a configured token {sorted(tokens)} (label_rewards.tokens)"
    first = next((m for m in msgs if m["role"] == "user"), None)
    if first is None or not first["content"].endswith(format_reward_goal(token)):
        return f"first user message does not end with the reward goal for {token}"
    return None


def load_rows(path: str | Path, tokens: tuple[str, ...], require_token: bool) -> list[dict]:
    """Validated rows of a label_rewards dataset; the first bad row raises InputError naming file:line."""
    path = Path(path)
    rows = read_jsonl(path)
    if not rows:
        raise InputError(f"{path}: dataset is empty")
    for lineno, row in enumerate(rows, 1):
        error = _row_error(row, set(tokens), require_token)
        if error:
            raise InputError(f"{path}: row {lineno}: {error}")
    return rows


def balanced_order(rows: list[dict], seed: int) -> list[dict]:
    """All rows, shuffled (seeded) and interleaved round-robin over reward tokens, so any prefix keeps
    RCTP's balance."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row.get("reward_token")), []).append(row)
    rng = random.Random(seed)
    for key in sorted(groups):
        rng.shuffle(groups[key])
    out: list[dict] = []
    while any(groups.values()):
        for key in sorted(groups):
            if groups[key]:
                out.append(groups[key].pop())
    return out


def tokenize_rows(rows: list[dict], tokenizer, max_length: int, limit: int | None = None
                  ) -> tuple[list[dict], dict]:
    """Pre-tokenized TRL rows `{input_ids, assistant_masks}` cut to max_length, and token statistics.

    Rows left without an assistant token by the cut are skipped; with `limit`, stops at that many usable
    rows (so a budget of N examples trains on N, not on N minus the ones that did not fit).
    """
    from rcgrpo_tasks.label_rewards import assistant_token_mask

    out, lengths, dropped, cut = [], [], 0, 0
    for row in rows:
        if limit is not None and len(out) >= limit:
            break
        ids, mask = assistant_token_mask(tokenizer, row["messages"])
        lengths.append(len(ids))
        if len(ids) > max_length:
            cut += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            dropped += 1
            continue
        out.append({"input_ids": ids, "assistant_masks": mask})
    stats = {"rows": len(rows), "rows_seen": len(lengths), "rows_used": len(out), "rows_truncated": cut,
             "rows_dropped_no_assistant": dropped, "tokens": sum(len(r["input_ids"]) for r in out),
             "assistant_tokens": sum(sum(r["assistant_masks"]) for r in out),
             "length_mean": round(sum(lengths) / len(lengths), 1), "length_max": max(lengths)}
    if not out:
        raise InputError(f"no row keeps an assistant token within max_length={max_length} "
                         f"(longest chat {stats['length_max']} tokens): raise sft.max_length")
    return out, stats


# ---------------------------------------------------------------------------------------------- model


def resolve_bf16(cfg: SftConfig) -> bool:
    import torch

    from rcgrpo_tasks.backends import bf16_supported

    if cfg.bf16 is not None:
        return cfg.bf16
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else bf16_supported()


def lora_config(cfg: SftConfig, model, token_ids: list[int]):
    """LoRA on `lora_target_modules` + the special-token rows as PEFT trainable tokens.

    Tied embeddings (SmolLM2): the input rows, tied into the LM head by PEFT. Untied (Qwen): the rows of
    both the input embedding and the LM head, so the saved adapter restores them exactly on load.
    """
    from peft import LoraConfig

    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    if tied:
        indices: list[int] | dict[str, list[int]] = list(token_ids)
    else:
        names = {id(m): n for n, m in model.named_modules()}
        indices = {names[id(model.get_input_embeddings())].split(".")[-1]: list(token_ids),
                   names[id(model.get_output_embeddings())].split(".")[-1]: list(token_ids)}
    targets = "all-linear" if cfg.lora_target_modules == ("all-linear",) else list(cfg.lora_target_modules)
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, trainable_token_indices=indices, task_type="CAUSAL_LM")


def trainer_args(cfg: SftConfig, ckpt_dir: Path, bf16: bool):
    import torch
    from trl import SFTConfig

    return SFTConfig(
        output_dir=str(ckpt_dir), learning_rate=cfg.learning_rate, num_train_epochs=cfg.num_epochs,
        max_steps=cfg.max_steps, per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum, lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed, data_seed=cfg.seed, bf16=bf16, gradient_checkpointing=cfg.gradient_checkpointing,
        max_length=None if cfg.padding_free else cfg.max_length, padding_free=cfg.padding_free,
        logging_steps=cfg.logging_steps, save_strategy="steps", save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit, report_to=[], use_cpu=not torch.cuda.is_available(),
        deepspeed=cfg.deepspeed, disable_tqdm=True, dataloader_num_workers=0,
    )


def _trainer_class():
    from trl import SFTTrainer

    class RcgrpoSFTTrainer(SFTTrainer):
        """SFTTrainer that also logs trained tokens/s (tokens of the batches since the last log / wall time)."""

        def log(self, logs: dict, start_time: float | None = None) -> None:
            now = time.perf_counter()
            if "loss" in logs and self.model.training:
                last_t, last_n = getattr(self, "_rcgrpo_tick", (self._rcgrpo_t0, 0))
                tokens = self._total_train_tokens
                logs["tokens_per_s"] = (tokens - last_n) / max(now - last_t, 1e-9)
                self._rcgrpo_tick = (now, tokens)
            super().log(logs, start_time)

        def train(self, *args, **kwargs):
            self._rcgrpo_t0 = time.perf_counter()
            return super().train(*args, **kwargs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if return_outputs or not self.model.training or not self._rcgrpo_compact_head():
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return compact_head_loss(self, model, inputs, num_items_in_batch)

        def _rcgrpo_compact_head(self) -> bool:
            # Off-CPU TRL's Triton kernel already scores only the labelled positions; under DDP/DeepSpeed the
            # forward must go through the wrapped module.
            return (self._rcgrpo_compact and self.accelerator.num_processes == 1 and not self.is_deepspeed_enabled
                    and self.accelerator.device.type == "cpu")

        def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
            with small_adapter_saves(self.accelerator.unwrap_model(self.model)):
                super()._save(output_dir, state_dict)

    return RcgrpoSFTTrainer


def build_trainer(cfg: SftConfig, model_dir: Path, rows: list[dict], tokens: tuple[str, ...], ckpt_dir: Path,
                  callbacks: list | None = None):
    """(trainer, tokenizer, special-token ids, data stats): base + added tokens + LoRA, ready to train."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = trainer_args(cfg, ckpt_dir, resolve_bf16(cfg))  # first: under ZeRO-3 the model loads sharded
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg.model_dtype))
    token_ids = add_special_tokens(tokenizer, model, tokens, cfg.seed)
    train_rows, stats = tokenize_rows(rows, tokenizer, cfg.max_length, cfg.max_examples)
    peft_config = None if cfg.full_finetune else lora_config(cfg, model, token_ids)
    trainer = _trainer_class()(
        model=model, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_list(train_rows), peft_config=peft_config, callbacks=callbacks or [])
    expose_head_bias(trainer.model)
    trainer._rcgrpo_compact = cfg.compact_lm_head
    return trainer, tokenizer, token_ids, stats


# ---------------------------------------------------------------------------------------------- run


@dataclass(frozen=True)
class RunSpec:
    variant: str
    model_dir: Path
    data: Path
    out: Path
    checkpoints: Path
    metrics: Path | None = None
    plots: Path | None = None

    def check(self) -> None:
        """Inputs exist — checked before anything heavy is imported or trained."""
        if not (Path(self.model_dir) / "config.json").is_file():
            raise InputError(f"--model-dir {self.model_dir}: no config.json (run `dvc repro prepare_model`)")
        if not Path(self.data).is_file():
            raise InputError(f"--data {self.data}: dataset not found (run `dvc repro label_rewards`)")


def file_md5(path: Path) -> str:
    """MD5 of a file: equal to the hash DVC records for it."""
    h = hashlib.md5()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dir_fingerprint(path: Path) -> str:
    """Cheap content fingerprint of a model folder: names, sizes, first and last MiB of each file."""
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


def dvc_hashes(paths: list[Path], lock: Path = Path("dvc.lock")) -> dict[str, str]:
    """DVC's recorded md5 of each path (or of the folder output containing it), from dvc.lock."""
    import yaml

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


def fingerprint(cfg: SftConfig, tokens: tuple[str, ...], spec: RunSpec) -> str:
    """Params + tokens + input contents + this code: checkpoints resume only under the same fingerprint."""
    code = hashlib.md5(Path(__file__).read_bytes()).hexdigest()
    blob = json.dumps({"cfg": as_dict(cfg), "tokens": tokens, "variant": spec.variant, "code": code,
                       "data": file_md5(spec.data), "model": dir_fingerprint(spec.model_dir)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def last_checkpoint(ckpt_dir: Path, fp: str, clean: bool = True) -> str | None:
    """Newest complete `checkpoint-N` (trainer_state.json written last) under a matching fingerprint.

    With `clean`, a folder with another fingerprint (other params or inputs) is emptied and stamped.
    """
    fp_file = ckpt_dir / FINGERPRINT_FILE
    if clean:
        if ckpt_dir.exists() and (not fp_file.is_file() or json.loads(fp_file.read_text()).get("fingerprint") != fp):
            shutil.rmtree(ckpt_dir)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        write_json(fp_file, {"fingerprint": fp})
    done = [p for p in ckpt_dir.glob("checkpoint-*") if (p / "trainer_state.json").is_file()
            and p.name.split("-")[-1].isdigit()]
    return str(max(done, key=lambda p: int(p.name.split("-")[-1]))) if done else None


def curve(log_history: list[dict]) -> list[dict]:
    """Per-step training rows (the `dvc plots` TSV) from the Trainer's log history (survives resume)."""
    rows = {}
    for entry in log_history:
        if "loss" in entry and "step" in entry:
            rows[entry["step"]] = {c: entry.get(c) for c in PLOT_COLUMNS}
    return [rows[k] for k in sorted(rows)]


def write_tsv(path: Path, rows: list[dict]) -> None:
    def fmt(v: Any) -> str:
        return "" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)

    lines = ["\t".join(PLOT_COLUMNS)] + ["\t".join(fmt(r.get(c)) for c in PLOT_COLUMNS) for r in rows]
    write_text(path, "\n".join(lines) + "\n")


def _mlflow_callback(enabled: bool):
    from transformers import TrainerCallback

    from rcgrpo_tasks import tracking

    class StepMetrics(TrainerCallback):
        """Step metrics to MLflow; on resume, first replays the steps logged before the interruption."""

        def on_train_begin(self, args, state, control, **kwargs):
            if enabled:
                for row in curve(state.log_history):
                    tracking.log_metrics({k: v for k, v in row.items() if k != "step"}, step=row["step"])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if enabled and logs and "loss" in logs:
                tracking.log_metrics({k: v for k, v in logs.items() if isinstance(v, (int, float))},
                                     step=state.global_step)

    return StepMetrics()


def save_trained(trainer, out: Path, meta: dict) -> None:
    """Atomically write the adapter (or full model) + tokenizer + metadata. Collective under DeepSpeed."""
    staging = out.with_name(f".{out.name}.staging")
    main = trainer.accelerator.is_main_process
    if main and staging.exists():
        shutil.rmtree(staging)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))  # gathers ZeRO-3 shards; saves the tokenizer; small adapter (_save)
    if main:
        (staging / "training_args.bin").unlink(missing_ok=True)
        write_json(staging / META_FILE, meta)
        with atomic_dir(out) as tmp:
            tmp.rmdir()
            staging.rename(tmp)


def _summary(trainer, result, stats: dict, rows: list[dict], seconds: float) -> dict:
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    speeds = [r["tokens_per_s"] for r in rows[1:] if r.get("tokens_per_s")]  # first log includes warm-up
    k = max(1, len(losses) // 5)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"steps": trainer.state.global_step, "epochs": round(trainer.state.epoch or 0.0, 4),
            "train_loss": result.training_loss, "loss_first": sum(losses[:k]) / k if losses else None,
            "loss_last": sum(losses[-k:]) / k if losses else None,
            "tokens_per_s": sum(speeds) / len(speeds) if speeds else None, "train_s": round(seconds, 2),
            "trainable_params": trainable, "data": stats}


def train_variant(cfg: SftConfig, tokens: tuple[str, ...], spec: RunSpec, callbacks: list | None = None,
                  log_mlflow: bool = True) -> dict:
    """Train (or resume) one variant and write its outputs; returns the summary (also `--metrics`).

    Under `accelerate launch` every rank trains; only the main one touches the checkpoint folder's
    bookkeeping, MLflow and the outputs."""
    from accelerate import PartialState

    from rcgrpo_tasks import tracking

    spec.check()
    state = PartialState()
    rows = balanced_order(load_rows(spec.data, tokens, cfg.require_reward_token), cfg.seed)
    fp = fingerprint(cfg, tokens, spec)
    if state.is_main_process:
        last_checkpoint(spec.checkpoints, fp)  # discards another run's checkpoints
    state.wait_for_everyone()
    resume = last_checkpoint(spec.checkpoints, fp, clean=False)
    log_mlflow = log_mlflow and state.is_main_process
    hashes = {"data_md5": file_md5(spec.data), "model_fingerprint": dir_fingerprint(spec.model_dir)[:16],
              **{f"dvc:{k}": v for k, v in dvc_hashes([spec.data, spec.model_dir]).items()}}
    params = {"sft": as_dict(cfg), "variant": spec.variant, "tokens": list(tokens), "inputs": hashes}
    if log_mlflow:
        import os

        os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")
        run = tracking.stage_run(f"sft@{spec.variant}", params, tags={"sft.variant": spec.variant})
    else:
        run = contextlib.nullcontext()
    with run:
        trainer, tokenizer, token_ids, stats = build_trainer(
            cfg, spec.model_dir, rows, tokens, spec.checkpoints, [_mlflow_callback(log_mlflow), *(callbacks or [])])
        t0 = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=resume)
        seconds = time.perf_counter() - t0
        if not trainer.accelerator.is_main_process:
            save_trained(trainer, spec.out, {})
            return {}
        steps = curve(trainer.state.log_history)
        summary = {"variant": spec.variant, **_summary(trainer, result, stats, steps, seconds),
                   "resumed_from": resume, "bf16": trainer.args.bf16,
                   "special_tokens": dict(zip(tokens, token_ids)), "inputs": hashes}
        meta = {"stage": "sft", "variant": spec.variant, "base_model": str(spec.model_dir),
                "full_finetune": cfg.full_finetune, "special_tokens": summary["special_tokens"],
                "config": as_dict(cfg), "inputs": hashes, "steps": summary["steps"]}
        save_trained(trainer, spec.out, meta)
        if spec.plots:
            write_tsv(spec.plots, steps)
        if spec.metrics:
            write_json(spec.metrics, summary)
        if log_mlflow:
            _log_outputs(trainer, tokenizer, spec, summary, cfg)
    if not cfg.keep_checkpoints:  # the folder (a DVC persist output) stays, with its fingerprint only
        for path in spec.checkpoints.iterdir():
            if path.name != FINGERPRINT_FILE:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    return summary


def _log_outputs(trainer, tokenizer, spec: RunSpec, summary: dict, cfg: SftConfig) -> None:
    from rcgrpo_tasks import tracking

    flat = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    flat.update({f"data.{k}": v for k, v in summary["data"].items()})
    tracking.log_metrics({f"summary/{k}": v for k, v in flat.items()})
    for path in (spec.metrics, spec.plots, spec.out / META_FILE):
        if path and Path(path).is_file():
            tracking.log_artifact(path)
    if cfg.log_model and not cfg.full_finetune:
        log_model(trainer.accelerator.unwrap_model(trainer.model), tokenizer, spec.model_dir)


# ---------------------------------------------------------------------------------------------- CLI

app = typer.Typer(add_completion=False)


@app.command()
def main(
    variant: str = typer.Option(..., help="Variant in params.yaml:sft.variants (sft | rctp)."),
    params: Path = typer.Option(Path("params.yaml"), help="Params file (sections `sft`, `label_rewards`)."),
    model_dir: Path = typer.Option(Path("models/base"), help="Base model folder (prepare_model)."),
    data: Path = typer.Option(..., help="Chat dataset JSONL (label_rewards: sft.jsonl or rctp.jsonl)."),
    out: Path = typer.Option(..., help="Output: PEFT adapter folder (+ tokenizer), replaced atomically."),
    checkpoints: Path = typer.Option(..., help="Checkpoint folder (resume point; emptied on other params)."),
    metrics: Path = typer.Option(None, help="Output: summary metrics JSON."),
    plots: Path = typer.Option(None, help="Output: per-step TSV (dvc plots)."),
) -> None:
    """SFT / RCTP fine-tuning with TRL SFTTrainer + PEFT LoRA."""
    import signal
    import sys

    # A killed stage (SIGTERM: dvc/Prefect cancel) unwinds normally: its MLflow run ends FAILED, and the
    # checkpoints already written stay for the resume.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = RunSpec(variant, model_dir, data, out, checkpoints, metrics, plots)
    try:
        cfg, tokens = load_sft_config(params, variant)
        spec.check()
    except (ConfigError, InputError) as exc:
        typer.echo(f"sft: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        summary = train_variant(cfg, tokens, spec)
    except InputError as exc:
        typer.echo(f"sft: {exc}", err=True)
        raise typer.Exit(1) from exc
    if summary:
        typer.echo(json.dumps({k: summary.get(k) for k in ("variant", "steps", "loss_first", "loss_last",
                                                           "tokens_per_s", "train_s", "resumed_from")}))


if __name__ == "__main__":
    app()
