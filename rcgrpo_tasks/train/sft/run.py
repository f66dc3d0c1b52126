"""One SFT / RCTP-FT run end to end: the resolved `sft` config of a variant, training (or resuming) on the
chosen device with micro-batch fitting, the trained output, metrics and MLflow records (the sft stage runs
`train_variant`).

- `save_trained` writes the adapter (or full model; `init: sft`: the LoRA merged into a model folder) +
  tokenizer atomically; `curve` / `summarize` the results (`PLOT_COLUMNS`, the `dvc plots` TSV).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

from rcgrpo_tasks.data.labels import load_reward_tokens
from rcgrpo_tasks.engine.compute import ComputeConfig
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops import tracking, tracking_log
from rcgrpo_tasks.ops.config import ConfigError, as_dict, load_config
from rcgrpo_tasks.ops.outputs import write_json
from rcgrpo_tasks.train.common import checkpoints, distributed, placement, runs
from rcgrpo_tasks.train.common.callbacks import step_metrics, stop_on_signal
from rcgrpo_tasks.train.common.model_registry import log_model
from rcgrpo_tasks.train.sft.config import SftConfig, SftRun
from rcgrpo_tasks.train.sft.margin_curve import margin_curve
from rcgrpo_tasks.train.sft.rows import load_rows, ordered
from rcgrpo_tasks.train.sft.trainer import build_trainer, fingerprint

META_FILE = "rcgrpo_sft.json"
"""Written into every output folder: stage, variant, base model, special-token ids, config, input hashes."""
PLOT_COLUMNS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_s", "num_tokens",
                "mean_token_accuracy", "entropy")


def load_sft_config(params: str | Path, variant: str) -> tuple[SftConfig, tuple[str, ...]]:
    """(resolved config, special tokens to add): the reward tokens (`label_rewards.tokens`) + extras."""
    cfg = load_config(SftConfig, params, "sft").resolve(variant)
    try:
        levels = load_reward_tokens(params)
    except ValueError as exc:
        raise ConfigError(f"{params}: {exc}") from exc
    return cfg, tuple(dict.fromkeys(levels + cfg.extra_special_tokens))


def margin_callback(cfg: SftConfig, tokens: tuple[str, ...], spec: SftRun, prompt: PromptConfig | None, track: bool):
    """The margin curve's callback (`train.sft.margin_curve`) when `margin_every` > 0, else None."""
    if not cfg.margin_every:
        return None
    if prompt is None:
        raise ConfigError("sft.margin_every > 0: the margin curve renders its entries as params `prompt` says; "
                          "none was given")
    levels = tuple(t for t in tokens if t not in cfg.extra_special_tokens)
    return margin_curve(spec.entries, spec.split, cfg.margin_entries, prompt,
                        (levels[-1], levels[0]), cfg.margin_every, track, cfg.seed)


def train_variant(cfg: SftConfig, tokens: tuple[str, ...], spec: SftRun, callbacks: list | None = None,
                  track: bool = True, *, compute: ComputeConfig, prompt: PromptConfig | None = None) -> dict:
    """Train (or resume) one variant and write its outputs; returns the summary (also `--metrics`).

    `track`: an MLflow run (main process only). Under `accelerate launch` every rank trains; only the main
    one touches the checkpoint folder's bookkeeping, MLflow and the outputs. `compute`: where it trains
    (params `compute`); a micro-batch that runs out of memory is halved, the gradient
    accumulation doubled (`placement.fit_micro_batch`). `prompt`: how the margin curve renders its entries."""
    spec.check()
    spec.check_against(cfg)
    device = placement.train_device(compute.device)
    resolved = cfg.compute_for(compute, device, spec.model_dir)  # THE dtype rule, once: passed down, recorded
    cfg = cfg.resolved(resolved)
    state = distributed.process_state(device)
    rows = ordered(load_rows(spec.data, tokens, cfg.require_reward_token), cfg.row_order, cfg.seed)
    n_rows = min(len(rows), cfg.max_examples or len(rows))
    if cfg.batch_size > n_rows:  # it would only grow padding until memory runs out
        raise ConfigError(f"sft.batch_size {cfg.batch_size} exceeds the {n_rows} row(s) trained from {spec.data}")
    fp = fingerprint(cfg, tokens, spec)  # the requested micro-batch: a fitted one resumes the same run
    track = track and state.is_main_process  # MLflow, outputs and bookkeeping: main process only
    hashes = {"data_md5": checkpoints.file_md5(spec.data), "model_fingerprint": checkpoints.dir_fingerprint(spec.model_dir)[:16],
              **{f"dvc:{k}": v for k, v in runs.dvc_hashes([spec.data, spec.model_dir]).items()}}
    params = {"sft": as_dict(cfg), "variant": spec.variant, "tokens": list(tokens), "inputs": hashes,
              "compute": as_dict(compute)}
    stage = tracking_log.stage_name("sft", spec.variant, spec.grid_seed)  # its DVC stage: sft, rctp@<seed>
    main = state.is_main_process
    tags = {"sft.variant": spec.variant, **tracking_log.grid_tags(spec.variant, spec.grid_seed)}
    with runs.system_metrics(track), stop_on_signal() as stop, \
            runs.published(main, track, stage, params, tags, spec.outputs) as (_, staged):
        own = [step_metrics("loss")] if track else []
        # one process only: the curve's forwards run on the main process, which under DDP / ZeRO-3 would
        # leave the others waiting in a collective
        alone = state.num_processes == 1 and not cfg.deepspeed
        curve_cb = margin_callback(cfg, tokens, spec, prompt, track) if main and alone else None
        own += [curve_cb] if curve_cb is not None else []

        def attempt(micro: int, accum: int):
            resume = checkpoints.resume_point(spec.checkpoints, fp, variant=spec.variant)
            trainer = build_trainer(replace(cfg, batch_size=micro, grad_accum=accum), spec.model_dir, rows, tokens,
                                    spec.checkpoints, [*own, stop, *(callbacks or [])], device=device,
                                    init_adapter=spec.init_adapter)
            place = placement.record_placement(trainer, stage, device, track)
            t0 = time.perf_counter()
            with runs.disk_errors(spec.checkpoints):
                checkpoints.train_or_restore(trainer, resume)
            return trainer, place, resume, time.perf_counter() - t0

        run, micro, accum = placement.fit_micro_batch(attempt, cfg.batch_size, cfg.grad_accum, stage)
        trainer, place, resume, seconds = run
        tokenizer, token_ids, stats = trainer.processing_class, trainer.token_ids, trainer.data_stats
        stop.check()
        if not main:
            save_trained(trainer, spec.out, None, {}, merged=spec.merged(cfg))
            return {}
        steps = curve(trainer.state.log_history)
        summary = {"variant": spec.variant, **summarize(trainer, stats, steps, seconds),
                   "resumed_from": resume, "bf16": trainer.args.bf16, "placement": place,
                   "dtype": resolved.record(),
                   "micro_batch": micro, "grad_accum": accum,
                   "special_tokens": dict(zip(tokens, token_ids)), "inputs": hashes, "init": cfg.init,
                   "row_order": cfg.row_order}
        if curve_cb is not None:
            summary["margin_curve"] = curve_cb.points
        meta = {"stage": "sft", "variant": spec.variant, "base_model": str(spec.model_dir),
                "init_adapter": str(spec.init_adapter) if spec.init_adapter else None,
                "full_finetune": cfg.full_finetune, "merged": spec.merged(cfg), "special_tokens": summary["special_tokens"],
                "config": as_dict(cfg), "inputs": hashes, "steps": summary["steps"]}
        folder = staged.dir(spec.out)
        with runs.disk_errors(spec.out):
            save_trained(trainer, spec.out, folder, meta, merged=spec.merged(cfg))
        spec.write_results(staged, steps, PLOT_COLUMNS, summary)
        if track:
            _log_outputs(trainer, tokenizer, spec, summary, cfg, staged, folder)
    if not cfg.keep_checkpoints:  # the folder (a DVC persist output) stays, with its fingerprint only
        checkpoints.clear_checkpoints(spec.checkpoints)
    return summary


def _log_outputs(trainer, tokenizer, spec: SftRun, summary: dict, cfg: SftConfig, staged, folder: Path) -> None:
    flat = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    flat.update({f"data.{k}": v for k, v in summary["data"].items()})
    tracking.log_metrics({f"summary/{k}": v for k, v in flat.items()})
    spec.log_results(staged, folder / META_FILE)
    if cfg.log_model and not cfg.full_finetune and not spec.merged(cfg):  # a merged output: a model folder (DVC's)
        log_model(trainer.accelerator.unwrap_model(trainer.model), tokenizer, spec.model_dir)


def save_merged(trainer, folder: Path) -> None:
    """The trained LoRA and token rows merged into a copy of the model, saved as a plain model folder with
    the tokenizer (`init: sft`: the adapter's base is the merged SFT model, which is no folder of its own)."""
    import copy

    model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).merge_and_unload()
    model.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)


def save_trained(trainer, out: Path, folder: Path | None, meta: dict, merged: bool = False) -> None:
    """Write the adapter (or full model; `merged`: the LoRA merged, `save_merged`) + tokenizer + `meta`
    (META_FILE) into `folder`, the staged output `out` (main process; None on the others). Every process
    calls it: under DeepSpeed it is collective."""
    staging = out.with_name(f".{out.name}.staging")
    main = trainer.accelerator.is_main_process
    if main and staging.exists():
        shutil.rmtree(staging)
    trainer.accelerator.wait_for_everyone()
    if merged:
        if main:
            save_merged(trainer, staging)
    else:
        trainer.save_model(str(staging))  # gathers ZeRO-3 shards; saves the tokenizer; small adapter (_save)
    if main:
        (staging / "training_args.bin").unlink(missing_ok=True)
        write_json(staging / META_FILE, meta)
        folder.rmdir()
        staging.rename(folder)


def curve(log_history: list[dict]) -> list[dict]:
    """Per-step training rows (PLOT_COLUMNS, the `dvc plots` TSV) from the Trainer's log history (it
    survives a resume)."""
    rows = {}
    for entry in log_history:
        if "loss" in entry and "step" in entry:
            rows[entry["step"]] = {c: entry.get(c) for c in PLOT_COLUMNS}
    return [rows[k] for k in sorted(rows)]


def summarize(trainer, stats: dict, rows: list[dict], seconds: float) -> dict:
    """Run summary: steps, epochs, loss (mean of the first / last fifth of the logged steps), tokens/s (the
    first log, which includes warm-up, left out), wall time, trainable parameters, data statistics."""
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    speeds = [r["tokens_per_s"] for r in rows[1:] if r.get("tokens_per_s")]
    k = max(1, len(losses) // 5)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"steps": trainer.state.global_step, "epochs": round(trainer.state.epoch or 0.0, 4),
            "train_loss": checkpoints.run_loss(trainer.state.log_history), "loss_first": sum(losses[:k]) / k if losses else None,
            "loss_last": sum(losses[-k:]) / k if losses else None,
            "tokens_per_s": sum(speeds) / len(speeds) if speeds else None, "train_s": round(seconds, 2),
            "trainable_params": trainable, "data": stats}
