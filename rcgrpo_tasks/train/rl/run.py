"""One GRPO / RC-GRPO run end to end: the `rl` config, training (or resuming) on the chosen device with
micro-batch fitting, the merged policy (`save_policy`), per-step diagnostics and the summary (the rl stage runs
`train_rl`)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from rcgrpo_tasks.data.labels import load_reward_tokens
from rcgrpo_tasks.data.onpolicy import sampled_success_rates
from rcgrpo_tasks.engine.compute import ComputeConfig
from rcgrpo_tasks.env.prompt import PromptConfig, ProtocolConfig
from rcgrpo_tasks.ops import tracking_log
from rcgrpo_tasks.ops.config import ConfigError, as_dict, load_config
from rcgrpo_tasks.ops.inputs import read_jsonl, read_tsv
from rcgrpo_tasks.ops.outputs import write_json
from rcgrpo_tasks.train.common import checkpoints, distributed, placement, runs
from rcgrpo_tasks.train.common.callbacks import stop_on_signal
from rcgrpo_tasks.train.rl import advantages as adv
from rcgrpo_tasks.train.rl.config import RLConfig
from rcgrpo_tasks.train.rl.diagnostics import (
    PLOT_COLUMNS,
    failure_counts,
    group_flags,
    nonzero_advantages,
    pool_learning,
    summarize,
)
from rcgrpo_tasks.train.rl.grpo import ROLLOUTS_FILE
from rcgrpo_tasks.train.rl.probe import PROBE_FILE, probe_summary, read_points
from rcgrpo_tasks.train.rl.trainer import DIAGNOSTICS_FILE, MODEL_META_FILE, RLRun, build_trainer, fingerprint


def equal_per_visit(cfg: RLConfig) -> int:
    """Samples per visit `pool_learning_equal` reads in every cell: RC-GRPO draws G x p_high high-token
    rollouts a visit on average (2 of G = 4), GRPO all G, so cells compare on equal samples
    (`diagnostics.pool_learning`)."""
    return max(1, round(cfg.num_generations * cfg.p_high))


def load_rl_config(params: str | Path) -> tuple[RLConfig, ProtocolConfig, tuple[str, ...]]:
    """(config, episode settings = params `prompt` with `rl.max_outputs`, reward tokens lowest first)."""
    cfg = load_config(RLConfig, params, "rl")
    protocol = load_config(PromptConfig, params, "prompt").protocol_config(cfg.decode.max_outputs)
    try:
        levels = load_reward_tokens(params)
    except ValueError as exc:
        raise ConfigError(f"{params}: {exc}") from exc
    return cfg, protocol, levels


def pool_record(ids: list[str], pool: Path | None) -> dict:
    """What RL trained on: its pool's prompt ids, their number and the init's sampled success on them (the
    step-0 success of the pool; NaN without the init's samples)."""
    success = sampled_success_rates(read_jsonl(pool)) if pool is not None else {}
    rates = [success[i] for i in ids if i in success]
    return {"ids": sorted(ids), "size": len(ids),
            "step0_success": sum(rates) / len(rates) if rates else float("nan"), "samples": str(pool) if pool else None}


def train_rl(cfg: RLConfig, protocol: ProtocolConfig, levels: tuple[str, ...], spec: RLRun,
             callbacks: list | None = None, track: bool = True, *, compute: ComputeConfig) -> dict:
    """Run (or resume) one RL run; returns the summary written to `spec.metrics` (main process).

    `track`: an MLflow run on the main process (under `accelerate launch`, rank 0). `compute`: where it
    trains (params `compute`); a micro-batch that runs out of memory is halved, the
    gradient accumulation doubled (`placement.fit_micro_batch`)."""
    mode = spec.mode
    cfg.decode.check_context(spec.model_dir, "rl.max_new_tokens")
    device = placement.train_device(compute.device)
    resolved = cfg.compute_for(compute, device, spec.model_dir)  # THE dtype rule, once: passed down, recorded
    cfg = cfg.resolved(resolved)
    main_proc = distributed.process_state(device).is_main_process
    track = track and main_proc
    tags = {"rl.init": spec.init, "rl.algo": spec.algo, "rl.conditioning": mode,
            **tracking_log.grid_tags(spec.name, spec.grid_seed)}
    params = {"rl": as_dict(cfg), "prompt": as_dict(protocol), "tokens": list(levels),
              "run": {**tags, "adapter": str(spec.adapter_dir)}, "compute": as_dict(compute)}
    stage = tracking_log.stage_name("rl", spec.name, spec.grid_seed)  # its DVC stage: rl_<init>@<seed>-<algo>
    fp = fingerprint(cfg, protocol, levels, spec)  # the requested micro-batch: a fitted one resumes the same run
    with stop_on_signal() as stop, runs.published(main_proc, track, stage, params, tags,
                                                        spec.outputs) as (_, staged):

        def attempt(micro: int, accum: int):
            resume = checkpoints.resume_point(spec.checkpoints, fp, run=spec.name)
            trainer = build_trainer(cfg, protocol, levels, spec, [stop, *(callbacks or [])], track=track,
                                    device=device, micro_batch=micro)
            place = placement.record_placement(trainer, stage, device, track)
            t0 = time.perf_counter()
            with runs.disk_errors(spec.checkpoints):
                checkpoints.train_or_restore(trainer, resume)
                return trainer, resume, place, t0

        grad_accum = cfg.batch_size // cfg.micro_batch_size  # fit_micro_batch's bookkeeping; TRL's comes from check_world
        run, micro, _ = placement.fit_micro_batch(attempt, cfg.micro_batch_size, grad_accum, stage)
        trainer, resume, place, t0 = run
        stop.check()
        folder = staged.dir(spec.out) if main_proc else None
        provenance = {
            "stage": "rl", "init": spec.init, "algo": spec.algo, "conditioning": mode,
            "base_model": str(spec.model_dir), "init_adapter": str(spec.adapter_dir) if spec.adapter_dir else None,
            "steps": trainer.state.global_step, "config": as_dict(cfg), "protocol": protocol.record(),
            "reward_tokens": list(levels)}
        with runs.disk_errors(spec.out):
            save_policy(trainer, cfg, spec, folder, provenance)
        if not main_proc:
            return {}
        rows = [r for r in read_tsv(spec.checkpoints / DIAGNOSTICS_FILE) if r["step"] <= trainer.state.global_step]
        diverged = trainer.rc_guard.event if trainer.rc_guard is not None else None
        if diverged:
            print(f"{stage}: DIVERGED at {diverged['reason']}; stopped, policy rolled back to step "
                  f"{diverged['restored_step']}", file=sys.stderr, flush=True)
        points = read_points(spec.checkpoints)
        log = spec.checkpoints / ROLLOUTS_FILE
        records = [r for r in read_jsonl(log) if r["step"] < trainer.state.global_step] if log.is_file() else []
        groups = group_flags(records, cfg.reward, levels)
        high = adv.reward_levels(levels)[1] if mode == "rc" else None  # RC-GRPO: the half it is evaluated on
        summary = {**summarize(rows), "init": spec.init, "algo": spec.algo, "conditioning": mode,
                   "diverged": diverged, "probe": probe_summary(points), "groups": groups,
                   "failures": failure_counts(records, levels), "nonzero_adv": nonzero_advantages(records, levels),
                   "pool": pool_record(list(trainer.rollout_func.entries), spec.pool),
                   "pool_learning": pool_learning(records, cfg.reward, high),
                   "pool_learning_equal": pool_learning(records, cfg.reward, high, equal_per_visit(cfg)),
                   "resumed_from": resume, "train_s": time.perf_counter() - t0,
                   "train_loss": checkpoints.run_loss(trainer.state.log_history), "placement": place, "micro_batch": micro,
                   "grad_accum": trainer.args.gradient_accumulation_steps,
                   "dtype": resolved.record()}
        if trainer.rc_guard is not None and trainer.rc_guard.nonfinite_steps:  # the key only when it happened
            summary["nonfinite_grad_steps"] = trainer.rc_guard.nonfinite_steps
        spec.write_results(staged, rows, PLOT_COLUMNS, summary)
        if track:
            tracking_log.log_metrics({f"summary/{k}": v for k, v in summary.items()
                                  if isinstance(v, (int, float)) and not isinstance(v, bool)})
            tracking_log.log_metrics({f"summary/{col}_{k}": v for col, stats in summary["mechanism"].items()
                                  for k, v in stats.items() if v is not None})
            spec.log_results(staged, folder / MODEL_META_FILE)
            for point in points:
                tracking_log.log_metrics({"probe/reward": sum(point["rewards"]) / len(point["rewards"])},
                                         step=point["step"])
            if diverged:
                tracking_log.set_tags({"rl.diverged": diverged["reason"],
                                       "rl.restored_step": str(diverged["restored_step"])})
    if not cfg.keep_checkpoints:  # as sft: the folder (a DVC persist output) keeps its fingerprint, and the
        checkpoints.clear_checkpoints(spec.checkpoints, keep=(ROLLOUTS_FILE, PROBE_FILE))  # run's rollout log
    return summary


def save_policy(trainer, cfg: RLConfig, spec: RLRun, folder: Path | None, provenance: dict) -> None:
    """Write the policy into `folder`, the staged `spec.out` (main process; None on the others): init + RL
    LoRA merged (+ `rl_adapter/`), or the full model, with the tokenizer and `provenance` (MODEL_META_FILE).
    Every process must call it: under DeepSpeed ZeRO-3 `save_model` gathers the sharded weights."""
    final = spec.checkpoints / "final"
    if cfg.full_finetune:
        trainer.save_model(str(final))
    if not trainer.accelerator.is_main_process:
        return
    if cfg.full_finetune:
        for f in final.iterdir():
            shutil.move(str(f), folder / f.name)
    else:
        model = trainer.accelerator.unwrap_model(trainer.model)
        model.save_pretrained(folder / "rl_adapter")
        model.merge_and_unload().save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)
    write_json(folder / MODEL_META_FILE, provenance)
