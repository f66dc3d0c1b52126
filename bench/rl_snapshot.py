"""RL rollout phase on CPU: sampling from the live PEFT policy vs from the merged snapshot (`rollout_dtype`).

Both arms drive the SAME engine (`engine.run_group`, hf backend, same entries, G, sampling seed) with the
SAME policy: the RL LoRA on top of the init model, as `train.rl.trainer.build_trainer` sets it up. They differ only in the
model the engine samples from:
- `live`: the PEFT model itself (fp32 base weights + a LoRA matmul per adapted layer per token) —
  `rollout_dtype: live`;
- `snapshot`: `rollout_policy.policy_snapshot` — base + LoRA deltas merged into a plain copy in
  `--snapshot-dtype` (default: bfloat16 on a CPU with AMX, as `rollout_dtype: auto` there; float32
  elsewhere, as `rollout_dtype: float32`), refreshed in place before every rollout phase (the refresh is timed
  inside the arm).
The LoRA B matrices are perturbed so the deltas are non-zero (a fresh LoRA is the identity). Arms alternate
per round (live, snapshot, live, ...) so machine load hits both alike. Prints model tokens/s (wall-clock
and per CPU-second) and seconds per rollout phase of each arm, and their ratios.

Run: `python bench/rl_snapshot.py --model models/base [--adapter models/rctp/0 --entries 2 --g 4
--max-new-tokens 32 --max-outputs 2 --rounds 3]`
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rcgrpo_tasks.engine.backend import SamplingParams
from rcgrpo_tasks.engine.compute import ComputeConfig, resolve_compute
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.rollout import run_group
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops.config import load_with
from rcgrpo_tasks.train.common.adapters import lora_targets
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import pool as rl_pool
from rcgrpo_tasks.train.rl import rollout_policy
from rcgrpo_tasks.train.rl.trainer import load_init_model

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
"""Every value a config here leaves unset is the params file's (`ops.config.load_with`)."""


def lora_policy(model_dir: str, adapter: str | None, cfg: rl_config.RLConfig, seed: int):
    """(PEFT model, tokenizer): the RL policy as the rl stage trains it (the `cfg` LoRA on the merged init), with
    non-zero LoRA deltas."""
    import torch
    from peft import LoraConfig, get_peft_model

    model, tok = load_init_model(Path(model_dir), Path(adapter) if adapter else None, cfg.dtype)
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_targets(cfg.lora_target_modules), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    return peft_model, tok


def run_arm(name: str, policy, tok, state: dict, entries, g: int, proto, sampling, snapshot_dtype):
    """(wall s, CPU s, model tokens, phases): one rollout phase (one group) per entry."""
    import torch

    wall = cpu = 0.0
    toks = 0
    for entry in entries:
        torch.manual_seed(sampling.seed or 0)
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "snapshot":  # refreshed before every phase, as in EngineRollout.backend
            state["snap"] = rollout_policy.policy_snapshot(policy, snapshot_dtype, state.get("snap"))
            backend = HFBackend.from_model(state["snap"], tok)
        else:
            backend = HFBackend.from_model(policy, tok)
        trajs = run_group(backend, entry, g, proto, sampling)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        toks += sum(t.n_model_tokens for t in trajs)
    return wall, cpu, toks, len(entries)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--adapter", default=None, help="init adapter (models/rctp/0); default: the base model")
    ap.add_argument("--entries-file", default="data/entries.jsonl")
    ap.add_argument("--split", default="data/split.json")
    ap.add_argument("--entries", type=int, default=2, help="train entries with the shortest prompts (one group each)")
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-outputs", type=int, default=2, help="model outputs per rollout (paper protocol)")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--snapshot-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 where the CPU has AMX, else float32")
    args = ap.parse_args()

    import torch

    snapshot_dtype = getattr(torch, args.snapshot_dtype if args.snapshot_dtype != "auto" else
                             resolve_compute(load_with(ComputeConfig, PARAMS, "compute", device="cpu", cpu_bf16="auto"),
                                             decode="auto", model_dir=args.model).decode_dtype)
    cfg = load_with(rl_config.RLConfig, PARAMS, "rl", **{"max_new_tokens": args.max_new_tokens, "max_outputs": args.max_outputs,
                                    "max_entries": args.entries, "num_generations": args.g, "batch_size": args.g,
                                    "micro_batch_size": args.g, "lora_r": args.lora_r,
                                    "lora_alpha": 2 * args.lora_r, "pool_band": None})
    policy, tok = lora_policy(args.model, args.adapter, cfg, args.seed)
    # BFCL's classic system prompt (the prompt before params.yaml's `short`), paper protocol, compact docs
    proto = load_with(PromptConfig, PARAMS, "prompt", system_prompt="bfcl").protocol_config(args.max_outputs)
    entries = rl_pool.train_entries(Path(args.entries_file), Path(args.split), cfg, proto, tok)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"entries {[e.id for e in entries]}, G={args.g}, max_new_tokens={args.max_new_tokens}, "
          f"outputs<={args.max_outputs}, LoRA r={args.lora_r}, snapshot {snapshot_dtype}, "
          f"threads={torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.1f}")
    totals = {"live": [0.0, 0.0, 0, 0], "snapshot": [0.0, 0.0, 0, 0]}
    state: dict = {}
    for rnd in range(args.rounds):
        for name in totals:
            res = run_arm(name, policy, tok, state, entries, args.g, proto, sampling, snapshot_dtype)
            totals[name] = [a + b for a, b in zip(totals[name], res)]
            wall, cpu, toks, phases = res
            print(f"round {rnd} {name:>8}: {wall / phases:6.2f} s/phase wall, {cpu / phases:6.2f} s/phase CPU, "
                  f"{toks} tokens, {toks / wall:6.2f} tok/s (load {os.getloadavg()[0]:.1f})")
    (lw, lc, lt, lp), (sw, sc, st, sp) = totals["live"], totals["snapshot"]
    for name, (w, c, t, p) in totals.items():
        print(f"{name:>8}: {t / w:7.2f} tok/s wall ({t / c:6.2f} per CPU-s), {w / p:6.2f} s per rollout phase")
    print(f"ratio snapshot/live: {(st / sw) / (lt / lw):.2f}x tokens/s wall-clock, "
          f"{(st / sc) / (lt / lc):.2f}x tokens per CPU-second, {(lw / lp) / (sw / sp):.2f}x faster per phase")


if __name__ == "__main__":
    main()
