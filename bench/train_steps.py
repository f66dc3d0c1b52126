"""Seconds per training step and per evaluation batch on one device, at the `gpu` profile's shapes, through
the stages' own code (the GPU check's `train-steps` step: infra/gpu-host/check.sh, docs/gpu-run.md).

Phases (each prints one line as it ends; `--out` gets them all as JSON):
- `sft-full`: SFT steps of the `sft` variant (`train.sft.run.train_variant`) as configs/gpu.yaml trains it: full
  fine-tuning, micro-batch 8 x grad_accum 2 = 16 chats per optimizer step; the chats are expert replays of
  single-turn train entries round-robin over categories (~300 tokens; the task's median is ~280). Seconds per optimizer step (a trainer
  callback), the first step left out as warm-up.
- `rl`: the rl stage (`train.rl.run.train_rl`, a `train.rl.trainer.RLRun`) RC-GRPO from an RCTP init (the model with the
  reward tokens added: bench/shared_prefix_step.py `prepared_model`), reference model on (beta 0.1), at
  configs/gpu.yaml's `rl` shape (8 groups x G=5, <= 128 new tokens); per step from the run's diagnostics:
  the whole step (TRL's `step_time`), the rollouts (`rollout_s`) and the training part (the difference),
  the first step left out. The fixed probe is off (`probe_entries: 0`): it is not part of a step.
- `evaluate`: the evaluate stage's decode (`accuracy.run_eval`) of one batch of `evaluate.batch_rows`
  held-out entries (configs/gpu.yaml: 80, so all 60 single-turn ones; <= 256 new tokens: a random-init
  model decodes every row to the limit); the batch runs twice, the second is reported (the first: `cold_s`).
- `sft-lora`: the same as `sft-full` with params.yaml's own `sft` section (LoRA r=16) at the same 16 chats.

Entries: the prepare_data stage's code with params.yaml's `prepare_data` (the single-turn task) into a temp
folder (bfcl-eval ships them; no data/ needed). Every stage reads one temp params file: params.yaml (as
written by hand) + configs/gpu.yaml (`ops.profiles.apply_profile`), params.yaml's `prepare_data` and `prompt`
kept, `compute.device` = `--device` (the stages place models from it: CUDA asked for where there is none
fails, never a CPU fallback). `--dtype float32` turns bf16 autocast off and rolls out / decodes in float32;
`bfloat16` keeps the profile's (fp32 master weights, bf16 autocast, bf16 rollouts and decoding).
`--tiny`: the CPU dry run's sizes (4 SFT chats of 2 per step, 2 groups x G=2 with 8 new tokens, 2 RL steps,
4 evaluated rows of 8 tokens).

Run: `python bench/train_steps.py --model DIR --device cuda|cpu --dtype bfloat16|float32 [--tiny]
[--steps N] [--out JSON]` (DIR: e.g. infra/gpu-host/make_model.py's random-init model; `--steps`: measured
steps per training phase after the warm-up one, default 2, `--tiny` 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "bench") not in sys.path:  # run as a script it is sys.path[0]; imported (the test) it is not
    sys.path.append(str(REPO / "bench"))
from shared_prefix_step import prepared_model  # noqa: E402

PROFILE = "gpu"
TINY = {"sft": {"batch_size": 2, "grad_accum": 1},
        "rl": {"num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "max_new_tokens": 8},
        "evaluate": {"batch_rows": 4, "max_new_tokens": 8}}
"""The dry run's sizes over the profile's (a 2-layer, 64-wide model on 2 CPU cores: seconds)."""
DTYPES = {"float32": {"sft": {"bf16": False}, "rl": {"bf16": False, "rollout_dtype": "float32"},
                      "evaluate": {"dtype": "float32"}},
          "bfloat16": {"evaluate": {"dtype": "bfloat16"}}}
"""What `--dtype` changes in the merged params (bfloat16: the gpu profile's own settings)."""


def bench_params(work: Path, device: str, dtype: str, tiny: bool, steps: int) -> tuple[Path, dict]:
    """(the params file every phase reads, params.yaml's own `sft` section): the gpu profile over the
    pristine params.yaml, its `prepare_data` and `prompt` kept, the device, dtype, sizes and step count set."""
    from rcgrpo_tasks.ops.profiles import apply_profile, pristine_params

    pristine = yaml.safe_load(pristine_params(REPO / "params.yaml")[0])
    merged = apply_profile(None, PROFILE, work / "profile.yaml", root=REPO)
    merged.update(prepare_data=pristine["prepare_data"], prompt=pristine["prompt"])
    merged["compute"] = {**merged["compute"], "device": device}
    merged["rl"].update(categories=None, probe_entries=0, max_steps=steps + 1, save_steps=steps + 2)
    for over in (DTYPES[dtype], TINY if tiny else {}):
        for section, values in over.items():
            merged[section] = {**merged[section], **values}
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(merged, sort_keys=False))
    return path, pristine["sft"]


def prepare_entries(params: Path, work: Path) -> tuple[Path, Path]:
    """(entries, split) written by the prepare_data stage's own code."""
    from rcgrpo_tasks.stages import prepare_data

    entries, split = work / "entries.jsonl", work / "split.json"
    prepare_data.main(params=params, entries=entries, split=split, metrics=None)
    return entries, split


def expert_chats(model: Path, params: Path, entries: Path, split: Path, n: int) -> tuple[Path, int]:
    """(a JSONL of the expert chats of `n` train entries taken round-robin over categories, as the sft
    dataset holds them; their median tokens)."""
    from transformers import AutoTokenizer

    from rcgrpo_tasks.engine.rollout import replay_calls
    from rcgrpo_tasks.env.entries import split_entries, stratified
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.env.tasks import task_of
    from rcgrpo_tasks.ops.config import load_config
    from rcgrpo_tasks.ops.outputs import write_jsonl

    tok = AutoTokenizer.from_pretrained(model)
    proto = load_config(PromptConfig, params, "prompt").protocol_config(1)
    rows = [{"messages": replay_calls(e, proto, [list(t) for t in task_of(e).expert_script(e)], tok).messages,
             "reward_token": None} for e in stratified(split_entries(entries, split, "train"), n)]
    path = entries.parent / "chats.jsonl"
    write_jsonl(path, rows)
    return path, int(statistics.median(len(tok.apply_chat_template(r["messages"])["input_ids"]) for r in rows))


def sync() -> None:
    """Wait for queued CUDA work, so a clock reading covers it."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step_clock():
    """A trainer callback holding the seconds of every optimizer step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, *a, **k):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync()
            self.times.append(time.perf_counter() - self.t0)

    return StepClock()


def sft_phase(cfg, levels: tuple[str, ...], model: Path, data: Path, work: Path, compute, name: str) -> list[float]:
    """Seconds of each optimizer step of one sft run (`train.sft.run.train_variant`) after the first."""
    from rcgrpo_tasks.train.sft import config as sft_config
    from rcgrpo_tasks.train.sft import run as sft_run

    clock = step_clock()
    spec = sft_config.SftRun(variant="sft", model_dir=model, data=data, out=work / name, checkpoints=work / f"ckpt-{name}")
    sft_run.train_variant(cfg, levels, spec, callbacks=[clock], track=False, compute=compute)
    return clock.times[1:]


def sft_config(cfg, steps: int, dtype: str, batch: tuple[int, int] | None = None):
    """A resolved `SftConfig` for `steps` + 1 optimizer steps (at `batch`: micro-batch, grad_accum), no
    saves, nothing logged; bf16 autocast off for float32."""
    cfg = replace(cfg, max_steps=steps + 1, save_steps=steps + 2, log_model=False, margin_every=0,
                  **({"bf16": False} if dtype == "float32" else {}))
    return replace(cfg, batch_size=batch[0], grad_accum=batch[1]) if batch else cfg


def rl_phase(params: Path, model: Path, entries: Path, split: Path, work: Path, compute) -> dict:
    """The rl stage's run (RC-GRPO from an RCTP init); per step after the first: whole, rollouts, training."""
    from rcgrpo_tasks.ops.inputs import read_tsv
    from rcgrpo_tasks.train.rl import run as rl_run
    from rcgrpo_tasks.train.rl import trainer as rl_trainer

    cfg, protocol, levels = rl_run.load_rl_config(params)
    spec = rl_trainer.RLRun(init="rctp", algo="rc_grpo", model_dir=prepared_model(model, levels, work),
                              adapter_dir=None, entries=entries, split=split, out=work / "rl",
                              checkpoints=work / "ckpt-rl", plots=work / "rl.tsv")
    rl_run.train_rl(cfg, protocol, levels, spec, track=False, compute=compute)
    rows = read_tsv(spec.plots)[1:]
    return {"step": [r["step_time"] for r in rows], "rollout": [r["rollout_s"] for r in rows],
            "train": [r["step_time"] - r["rollout_s"] for r in rows],
            "groups": cfg.batch_size // cfg.num_generations, "G": cfg.num_generations, "beta": cfg.beta}


def evaluate_phase(params: Path, model: Path, entries: Path, split: Path, compute) -> dict:
    """The evaluate stage's decode of one batch of `evaluate.batch_rows` held-out entries, twice."""
    from rcgrpo_tasks.engine.backend_registry import load_backend
    from rcgrpo_tasks.engine.compute import resolve_compute
    from rcgrpo_tasks.env.entries import read_entries, select_entries, stratified
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig, run_eval
    from rcgrpo_tasks.ops.config import load_config

    cfg = load_config(EvaluateConfig, params, "evaluate")
    prompt = load_config(PromptConfig, params, "prompt")
    held_out = stratified(select_entries(read_entries(entries), split=split, side="test"), cfg.limit)
    batch = held_out[: cfg.decode.batch_rows]
    resolved = resolve_compute(compute, decode=cfg.decode.dtype, model_dir=model)  # THE dtype rule, as evaluate's
    backend = load_backend(cfg.decode.backend, model, None, **resolved.backend_kwargs())
    times, tokens = [], 0
    for _ in range(2):
        t0 = time.perf_counter()
        _, _, summary = run_eval(cfg, prompt, backend, batch, None, "train-steps")
        sync()
        times.append(time.perf_counter() - t0)
        tokens = summary["n_model_tokens"]
    return {"batch_s": times[1], "cold_s": times[0], "rows": len(batch), "max_new_tokens": cfg.decode.max_new_tokens,
            "model_tokens": tokens, "device": backend.describe().get("device")}


def mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def run(args) -> dict:
    """Every phase in order (sft-full, rl, evaluate, sft-lora), one line each as it ends; the JSON record."""
    from rcgrpo_tasks.engine.compute import load_compute
    from rcgrpo_tasks.ops.config import from_dict
    from rcgrpo_tasks.train.sft.config import SftConfig
    from rcgrpo_tasks.train.sft.run import load_sft_config

    steps = args.steps or (1 if args.tiny else 2)
    out = {"device": args.device, "dtype": args.dtype, "tiny": args.tiny, "model": str(args.model), "steps": steps}
    with tempfile.TemporaryDirectory(prefix="train-steps-") as tmp:
        work = Path(tmp)
        params, own_sft = bench_params(work, args.device, args.dtype, args.tiny, steps)
        compute = load_compute(params)
        out["placement"] = str(compute.resolve())  # CUDA asked for where there is none: ConfigError here
        t0 = time.perf_counter()
        entries, split = prepare_entries(params, work)
        full, levels = load_sft_config(params, "sft")
        full = sft_config(full, steps, args.dtype)
        chats = full.batch_size * full.grad_accum
        data, tok_median = expert_chats(args.model, params, entries, split, chats * (steps + 1))
        out["setup_s"] = time.perf_counter() - t0
        shape = f"{chats} chats x ~{tok_median} tok"

        t0 = time.perf_counter()
        s = sft_phase(full, levels, args.model, data, work, compute, "sft-full")
        out["sft_full"] = {"step_s": mean(s), "steps_s": s, "chats": chats, "tokens_median": tok_median,
                           "wall_s": time.perf_counter() - t0}
        print(f"sft-full step: {mean(s):.2f} s ({shape}, full fine-tuning)", flush=True)

        t0 = time.perf_counter()
        r = rl_phase(params, args.model, entries, split, work, compute)
        out["rl"] = {"step_s": mean(r["step"]), "rollout_s": mean(r["rollout"]), "train_s": mean(r["train"]),
                     **{f"{k}_steps_s": r[k] for k in ("step", "rollout", "train")},
                     **{k: r[k] for k in ("groups", "G", "beta")}, "wall_s": time.perf_counter() - t0}
        print(f"rl step: {mean(r['step']):.2f} s (rollouts {mean(r['rollout']):.2f} s, training "
              f"{mean(r['train']):.2f} s; {r['groups']} groups x G={r['G']}, RC-GRPO, beta {r['beta']})", flush=True)

        t0 = time.perf_counter()
        e = evaluate_phase(params, args.model, entries, split, compute)
        out["evaluate"] = {**e, "wall_s": time.perf_counter() - t0}
        print(f"evaluate batch: {e['batch_s']:.2f} s ({e['rows']} rows x <= {e['max_new_tokens']} new tokens; "
              f"first batch {e['cold_s']:.2f} s)", flush=True)

        t0 = time.perf_counter()
        lora = sft_config(from_dict(SftConfig, own_sft).resolve("sft"), steps, args.dtype,
                          (full.batch_size, full.grad_accum))
        s = sft_phase(lora, levels, args.model, data, work, compute, "sft-lora")
        out["sft_lora"] = {"step_s": mean(s), "steps_s": s, "chats": chats, "tokens_median": tok_median,
                           "lora_r": lora.lora_r, "wall_s": time.perf_counter() - t0}
        print(f"sft-lora step: {mean(s):.2f} s ({shape}, LoRA r={lora.lora_r})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="model folder (e.g. make_model.py build's)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run's sizes")
    ap.add_argument("--steps", type=int, default=0, help="measured steps per training phase (0: 2, --tiny 1)")
    ap.add_argument("--out", type=Path, default=None, help="the numbers as JSON")
    args = ap.parse_args()
    out = run(args)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
