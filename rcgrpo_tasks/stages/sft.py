"""sft stage: SFT (experts only) and RCTP-FT (reward-token-labelled mixed data) with TRL + PEFT LoRA.

One definition, two runs (`dvc.yaml` foreach `sft@sft`, `sft@rctp`): `--variant` picks the overrides in
`params.yaml:sft.variants` (the paper: 2 epochs SFT, 5 epochs RCTP).
Reads: `--model-dir` (base model folder, `prepare_model`), `--data` (a `label_rewards` chat dataset:
rows `{"messages", "trajectory_id", "entry_id", "reward_token", "reward"}`), `params.yaml` sections `sft`,
`label_rewards` (its `tokens` are the reward tokens) and `compute` (`device`: auto | cpu | cuda; it logs
one line saying where it trains and records `placement` in the metrics JSON and MLflow params; a
micro-batch that runs out of memory is halved and the gradient accumulation doubled, with a warning).
Writes: `--out` (atomically): a standard PEFT adapter folder + the extended tokenizer + `rcgrpo_sft.json`
(or, with `full_finetune`, a full model folder); `--metrics` (JSON summary), `--plots` (per-step TSV for
`dvc plots`); `--checkpoints` (periodic Trainer checkpoints, a DVC `persist` output: a killed run re-run
with the same params, inputs and training code resumes from the last complete one; others discard them).
SIGTERM (dvc / Prefect cancel): the current step is checkpointed, the MLflow run ends FAILED, exit 143.
MLflow (via `tracking`): params (config, data/model hashes), step metrics (loss, lr, grad norm, tokens/s),
system metrics, the final adapter (`mlflow.transformers`, base = the local model folder).

How it trains (`rcgrpo_tasks.train.finetune`): loss on assistant tokens only (`data.chat.assistant_token_mask`,
the ONE mask of the project); the reward tokens (`<|low_reward|>`, `<|high_reward|>`, any configured level)
added as special tokens, the embeddings resized, their rows trained through PEFT `trainable_token_indices`
(saved in the adapter, ~KBs); CPU speed knobs measured by bench/sft_throughput.py.
Consumers load a trained model with `rcgrpo_tasks.engine.models.load_trained(model_dir, adapter_dir)`
(tokenizer from the adapter folder, base embeddings resized to it, then `PeftModel.from_pretrained`).
Run: `rcgrpo sft --variant rctp --model-dir models/base --data data/datasets/rctp.jsonl --out
models/sft/rctp --checkpoints checkpoints/sft/rctp --metrics metrics/sft_rctp.json --plots plots/sft_rctp.tsv`.
Departures from the paper: LoRA (+ trainable reward-token rows) instead of full fine-tuning by default,
tiny step budgets on CPU (`configs/paper.yaml` holds the paper's values).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import typer

from rcgrpo_tasks.engine.compute import ComputeConfig, load_compute
from rcgrpo_tasks.env.protocols import reward_tokens
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import ConfigError, as_dict, load_config, read_params
from rcgrpo_tasks.train import runs
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
        levels = reward_tokens(read_params(params))
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
    from accelerate import PartialState

    spec.check()
    compute = compute or ComputeConfig()
    device = runs.train_device(compute.device)
    rows = balanced_order(load_rows(spec.data, tokens, cfg.require_reward_token), cfg.seed)
    fp = fingerprint(cfg, tokens, spec)  # the requested micro-batch: a fitted one resumes the same run
    track = track and PartialState().is_main_process
    hashes = {"data_md5": runs.file_md5(spec.data), "model_fingerprint": runs.dir_fingerprint(spec.model_dir)[:16],
              **{f"dvc:{k}": v for k, v in runs.dvc_hashes([spec.data, spec.model_dir]).items()}}
    params = {"sft": as_dict(cfg), "variant": spec.variant, "tokens": list(tokens), "inputs": hashes,
              "compute": as_dict(compute)}
    if track:
        os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true")
    stage = f"sft@{spec.variant}"
    with runs.stop_on_signal() as stop, runs.tracked_run(track, stage, params, {"sft.variant": spec.variant}):
        own = [runs.step_metrics("loss")] if track else []

        def attempt(micro: int, accum: int):
            resume = runs.resume_point(spec.checkpoints, fp, variant=spec.variant)
            built = build_trainer(replace(cfg, batch_size=micro, grad_accum=accum), spec.model_dir, rows, tokens,
                                  spec.checkpoints, [*own, stop, *(callbacks or [])], device=device)
            place = runs.record_placement(built[0], stage, device, track)
            t0 = time.perf_counter()
            result = built[0].train(resume_from_checkpoint=resume)
            return built, place, resume, result, time.perf_counter() - t0

        run, micro, accum = runs.fit_micro_batch(attempt, cfg.batch_size, cfg.grad_accum, stage)
        (trainer, tokenizer, token_ids, stats), place, resume, result, seconds = run
        stop.check()
        if not trainer.accelerator.is_main_process:
            save_trained(trainer, spec.out, {})
            return {}
        steps = curve(trainer.state.log_history)
        summary = {"variant": spec.variant, **summarize(trainer, result, stats, steps, seconds),
                   "resumed_from": resume, "bf16": trainer.args.bf16, "placement": place,
                   "micro_batch": micro, "grad_accum": accum,
                   "special_tokens": dict(zip(tokens, token_ids)), "inputs": hashes}
        meta = {"stage": "sft", "variant": spec.variant, "base_model": str(spec.model_dir),
                "full_finetune": cfg.full_finetune, "special_tokens": summary["special_tokens"],
                "config": as_dict(cfg), "inputs": hashes, "steps": summary["steps"]}
        save_trained(trainer, spec.out, meta)
        spec.write_results(steps, PLOT_COLUMNS, summary)
        if track:
            _log_outputs(trainer, tokenizer, spec, summary, cfg)
    if not cfg.keep_checkpoints:  # the folder (a DVC persist output) stays, with its fingerprint only
        runs.clear_checkpoints(spec.checkpoints)
    return summary


def _log_outputs(trainer, tokenizer, spec: SftRun, summary: dict, cfg: SftConfig) -> None:
    flat = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    flat.update({f"data.{k}": v for k, v in summary["data"].items()})
    tracking.log_metrics({f"summary/{k}": v for k, v in flat.items()})
    spec.log_results(spec.out / META_FILE)
    if cfg.log_model and not cfg.full_finetune:
        log_model(trainer.accelerator.unwrap_model(trainer.model), tokenizer, spec.model_dir)


# ---------------------------------------------------------------------------------------------- CLI

app = typer.Typer(add_completion=False)


@app.command()
def main(
    variant: str = typer.Option(..., help="Variant in params.yaml:sft.variants (sft | rctp)."),
    params: Path = typer.Option(Path("params.yaml"), help="Params file (sections `sft`, `label_rewards`, `compute`)."),
    model_dir: Path = typer.Option(Path("models/base"), help="Base model folder (prepare_model)."),
    data: Path = typer.Option(..., help="Chat dataset JSONL (label_rewards: sft.jsonl or rctp.jsonl)."),
    out: Path = typer.Option(..., help="Output: PEFT adapter folder (+ tokenizer), replaced atomically."),
    checkpoints: Path = typer.Option(..., help="Checkpoint folder (resume point; emptied on other params)."),
    metrics: Path = typer.Option(None, help="Output: summary metrics JSON."),
    plots: Path = typer.Option(None, help="Output: per-step TSV (dvc plots)."),
) -> None:
    """SFT / RCTP fine-tuning with TRL SFTTrainer + PEFT LoRA."""
    spec = SftRun(variant, model_dir, data, out, checkpoints, metrics, plots)
    with cli_errors():
        cfg, tokens = load_sft_config(params, variant)
        compute = load_compute(params)
        runs.train_device(compute.device)  # a device this machine lacks fails here, before anything loads
        spec.check()
        summary = train_variant(cfg, tokens, spec, compute=compute)
    if summary:
        typer.echo(json.dumps({k: summary.get(k) for k in ("variant", "steps", "loss_first", "loss_last",
                                                           "tokens_per_s", "train_s", "resumed_from")}))


if __name__ == "__main__":
    app()
