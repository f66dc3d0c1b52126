"""One SFT / RCTP-FT run end to end: the resolved `sft` config of a variant, training (or resuming) on the
chosen device with micro-batch fitting, the trained output, metrics and MLflow records (the sft stage runs
`train_variant`)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from rcgrpo_tasks.engine.compute import ComputeConfig
from rcgrpo_tasks.env.protocols import reward_tokens
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.config import ConfigError, as_dict, load_config, read_sections
from rcgrpo_tasks.train import processes, runs
from rcgrpo_tasks.train.adapters import log_model
from rcgrpo_tasks.train.finetune import (
    META_FILE,
    PLOT_COLUMNS,
    SftConfig,
    SftRun,
    balanced_order,
    build_trainer,
    curve,
    fingerprint,
    load_rows,
    save_trained,
    summarize,
)


def load_sft_config(params: str | Path, variant: str) -> tuple[SftConfig, tuple[str, ...]]:
    """(resolved config, special tokens to add): the reward tokens (`label_rewards.tokens`) + extras."""
    cfg = load_config(SftConfig, params, "sft").resolve(variant)
    try:
        levels = reward_tokens(read_sections(params, "label_rewards"))
    except ValueError as exc:
        raise ConfigError(f"{params}: {exc}") from exc
    return cfg, tuple(dict.fromkeys(levels + cfg.extra_special_tokens))


def train_variant(cfg: SftConfig, tokens: tuple[str, ...], spec: SftRun, callbacks: list | None = None,
                  track: bool = True, compute: ComputeConfig | None = None) -> dict:
    """Train (or resume) one variant and write its outputs; returns the summary (also `--metrics`).

    `track`: an MLflow run (main process only). Under `accelerate launch` every rank trains; only the main
    one touches the checkpoint folder's bookkeeping, MLflow and the outputs. `compute`: where it trains
    (params `compute`; default `auto`); a micro-batch that runs out of memory is halved, the gradient
    accumulation doubled (`runs.fit_micro_batch`)."""
    spec.check()
    compute = compute or ComputeConfig()
    device = runs.train_device(compute.device)
    state = processes.process_state(device)
    rows = balanced_order(load_rows(spec.data, tokens, cfg.require_reward_token), cfg.seed)
    n_rows = min(len(rows), cfg.max_examples or len(rows))
    if cfg.batch_size > n_rows:  # it would only grow padding until memory runs out
        raise ConfigError(f"sft.batch_size {cfg.batch_size} exceeds the {n_rows} row(s) trained from {spec.data}")
    fp = fingerprint(cfg, tokens, spec)  # the requested micro-batch: a fitted one resumes the same run
    track = track and state.is_main_process  # MLflow, outputs and bookkeeping: main process only
    hashes = {"data_md5": runs.file_md5(spec.data), "model_fingerprint": runs.dir_fingerprint(spec.model_dir)[:16],
              **{f"dvc:{k}": v for k, v in runs.dvc_hashes([spec.data, spec.model_dir]).items()}}
    params = {"sft": as_dict(cfg), "variant": spec.variant, "tokens": list(tokens), "inputs": hashes,
              "compute": as_dict(compute)}
    if track:
        os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")
    stage = f"sft@{spec.variant}"
    main = state.is_main_process
    with runs.stop_on_signal() as stop, runs.published(main, track, stage, params, {"sft.variant": spec.variant},
                                                        spec.outputs) as (_, staged):
        own = [runs.step_metrics("loss")] if track else []

        def attempt(micro: int, accum: int):
            resume = runs.resume_point(spec.checkpoints, fp, variant=spec.variant)
            built = build_trainer(replace(cfg, batch_size=micro, grad_accum=accum), spec.model_dir, rows, tokens,
                                  spec.checkpoints, [*own, stop, *(callbacks or [])], device=device)
            place = runs.record_placement(built[0], stage, device, track)
            t0 = time.perf_counter()
            with runs.disk_errors(spec.checkpoints):
                result = runs.train_or_restore(built[0], resume)
            return built, place, resume, result, time.perf_counter() - t0

        run, micro, accum = runs.fit_micro_batch(attempt, cfg.batch_size, cfg.grad_accum, stage)
        (trainer, tokenizer, token_ids, stats), place, resume, result, seconds = run
        stop.check()
        if not main:
            save_trained(trainer, spec.out, None, {})
            return {}
        steps = curve(trainer.state.log_history)
        summary = {"variant": spec.variant, **summarize(trainer, result, stats, steps, seconds),
                   "resumed_from": resume, "bf16": trainer.args.bf16, "placement": place,
                   "micro_batch": micro, "grad_accum": accum,
                   "special_tokens": dict(zip(tokens, token_ids)), "inputs": hashes}
        meta = {"stage": "sft", "variant": spec.variant, "base_model": str(spec.model_dir),
                "full_finetune": cfg.full_finetune, "special_tokens": summary["special_tokens"],
                "config": as_dict(cfg), "inputs": hashes, "steps": summary["steps"]}
        folder = staged.dir(spec.out)
        with runs.disk_errors(spec.out):
            save_trained(trainer, spec.out, folder, meta)
        spec.write_results(staged, steps, PLOT_COLUMNS, summary)
        if track:
            _log_outputs(trainer, tokenizer, spec, summary, cfg, staged, folder)
    if not cfg.keep_checkpoints:  # the folder (a DVC persist output) stays, with its fingerprint only
        runs.clear_checkpoints(spec.checkpoints)
    return summary


def _log_outputs(trainer, tokenizer, spec: SftRun, summary: dict, cfg: SftConfig, staged, folder: Path) -> None:
    flat = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    flat.update({f"data.{k}": v for k, v in summary["data"].items()})
    tracking.log_metrics({f"summary/{k}": v for k, v in flat.items()})
    spec.log_results(staged, folder / META_FILE)
    if cfg.log_model and not cfg.full_finetune:
        log_model(trainer.accelerator.unwrap_model(trainer.model), tokenizer, spec.model_dir)
