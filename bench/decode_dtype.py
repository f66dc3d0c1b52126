"""Decoding on a CPU in bf16 vs float32 at the stages' own shapes, side by side in one run.

THE dtype rule (`engine.dtype`, params `compute.cpu_bf16`) decides what `dtype: auto` decodes in on a CPU (evaluate, controllability,
sample_policy, generate_trajectories' policy rows, RL's rollout snapshot). A decode step alone can be faster
in bf16 (`bench/cpu_bf16.py`) while a stage is not: a stage's decoding is prefill plus short answers in
batches. This bench decodes what two stages decode, from two backends of the same model and adapter, one
float32 and one bfloat16, loaded once each; arms alternate per repetition (A B, B A, ...):
- `greedy`: evaluate's shape (`evaluation.accuracy.run_eval`, params `evaluate`): the first `--greedy`
  held-out entries, stratified as evaluate takes them, greedy, one answer each;
- `sampled`: sample_policy's shape (`data.onpolicy.sample_policy`, params `sample_policy`): `--sampled`
  train entries x `samples_per_entry` at T=0.7, the same seeds in both arms (RL's rollouts are the same
  shape: groups of 4 sampled answers of <= 64 tokens to ~250-token prompts).
Prints per repetition the wall seconds of each arm, the bf16 / float32 speed ratio (> 1: bf16 is faster),
and how many greedy verdicts agree. The runs: docs/log.md, "CPU bf16".
Run: `python bench/decode_dtype.py [--model models/base --adapter models/sft/sft --greedy 30 --sampled 16
--reps 2 --threads 2]` (the dtype of each arm is set here: `compute.cpu_bf16` plays no part).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from rcgrpo_tasks.data.dataset import GenerateConfig
from rcgrpo_tasks.data.labels import load_reward_tokens
from rcgrpo_tasks.data.onpolicy import SampleConfig, pick_entries, sample_policy
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.env.entries import read_entries, select_entries, split_entries, stratified
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig, run_eval
from rcgrpo_tasks.ops.config import load_config

DTYPES = ("float32", "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--adapter", default="models/sft/sft")
    ap.add_argument("--entries", default="data/entries.jsonl")
    ap.add_argument("--split", default="data/split.json")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--greedy", type=int, default=30, help="held-out entries decoded greedily (0: skip)")
    ap.add_argument("--sampled", type=int, default=16, help="train entries sampled as sample_policy does (0: skip)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    params = Path(args.params)
    ecfg = load_config(EvaluateConfig, params, "evaluate")
    scfg = load_config(SampleConfig, params, "sample_policy")
    scfg = dataclasses.replace(scfg, n_entries=args.sampled, max_samples_per_entry=scfg.samples_per_entry)  # one round
    reward = load_config(GenerateConfig, params, "generate_trajectories").reward
    prompt = load_config(PromptConfig, params, "prompt")
    tokens = load_reward_tokens(params)
    pool = read_entries(Path(args.entries))
    held_out = stratified(select_entries(pool, split=Path(args.split), side="test"), args.greedy)
    chosen = pick_entries(split_entries(args.entries, args.split, "train"), scfg)
    backends = {d: HFBackend(args.model, args.adapter or None, dtype=d, device="cpu") for d in DTYPES}

    def greedy(dtype: str) -> list:
        _, rows, _ = run_eval(ecfg, prompt, backends[dtype], held_out, None, dtype, tokens)
        return [r["valid"] for r in rows]

    def sampled(dtype: str) -> list:
        rows, _ = sample_policy(backends[dtype], chosen, scfg, prompt.protocol_config(scfg.decode.max_outputs), reward)
        return [t.reward for t in rows]

    shapes = {"greedy": greedy if args.greedy else None, "sampled": sampled if args.sampled else None}
    totals = {(s, d): 0.0 for s in shapes for d in DTYPES}
    print(f"threads {args.threads}; greedy: {len(held_out)} held-out entries; sampled: {len(chosen)} train entries "
          f"x {scfg.samples_per_entry}")
    for rep in range(args.reps):
        order = DTYPES if rep % 2 == 0 else DTYPES[::-1]
        for shape, fn in shapes.items():
            if fn is None:
                continue
            secs, outs = {}, {}
            for d in order:
                t0 = time.perf_counter()
                outs[d] = fn(d)
                secs[d] = time.perf_counter() - t0
                totals[(shape, d)] += secs[d]
            agree = sum(a == b for a, b in zip(outs["float32"], outs["bfloat16"]))
            print(f"rep {rep} {shape:8s} float32 {secs['float32']:7.2f} s  bfloat16 {secs['bfloat16']:7.2f} s  "
                  f"bf16 speed x{secs['float32'] / secs['bfloat16']:.2f}  same outcome {agree}/{len(outs['float32'])}")
    for shape, fn in shapes.items():
        if fn is not None:
            f, b = totals[(shape, "float32")], totals[(shape, "bfloat16")]
            print(f"total {shape:8s} float32 {f:7.2f} s  bfloat16 {b:7.2f} s  bf16 speed x{f / b:.2f}")


if __name__ == "__main__":
    main()
