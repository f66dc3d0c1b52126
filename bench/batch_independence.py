"""Does `evaluate`'s greedy answer depend on how entries are batched? Side by side in one run, on a real model.

Decodes the held-out and dev entries as the evaluate stage does (`evaluation.accuracy.run_eval`, params
`evaluate` and `prompt`, greedy, one answer each) twice from ONE backend: one entry to a session
(`batch_rows: 1`) and at the committed `evaluate.batch_rows`. Prints per side the entries whose answers
differ (0 is the only good answer), the verdicts that differ, the largest log-prob gap between the two runs
over the tokens both share, each run's accuracy and wall seconds. Exit status 1 when any answer differs.
Run: `python bench/batch_independence.py [--model models/base --adapter models/sft/sft --reward-token ''
--sides test dev --threads 2]`; the runs: docs/log.md, "Batch independence".
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from rcgrpo_tasks.data.labels import load_reward_tokens
from rcgrpo_tasks.engine.backend_registry import load_backend
from rcgrpo_tasks.engine.compute import load_compute, resolve_compute
from rcgrpo_tasks.env.entries import read_entries, select_entries, stratified
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig, run_eval
from rcgrpo_tasks.evaluation.agreement import answer
from rcgrpo_tasks.ops.config import load_config


def side_by_side(cfg: EvaluateConfig, prompt: PromptConfig, backend, entries: list, token: str | None,
                 tokens: tuple[str, ...]) -> dict:
    """Both runs of `entries` and how they differ."""
    runs = {}
    for rows in (1, cfg.decode.batch_rows):
        one = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, batch_rows=rows), pass_samples=0)
        t0 = time.perf_counter()
        trajs, results, summary = run_eval(one, prompt, backend, entries, token, f"batch_rows={rows}", tokens)
        runs[rows] = (trajs, results, summary["accuracy"], time.perf_counter() - t0)
    (ta, ra, acc_a, wall_a), (tb, rb, acc_b, wall_b) = runs.values()
    gap = 0.0
    for a, b in zip(ta, tb):
        (xa, la), (xb, lb) = answer(a), answer(b)
        shared = next((i for i, (x, y) in enumerate(zip(xa, xb)) if x != y), min(len(xa), len(xb)))
        gap = max([gap] + [abs(x - y) for x, y in zip(la[:shared], lb[:shared])])
    return {"entries": len(entries), "answers_differ": sum(answer(a)[0] != answer(b)[0] for a, b in zip(ta, tb)),
            "verdicts_differ": sum(x["valid"] != y["valid"] for x, y in zip(ra, rb)), "max_logprob_gap": gap,
            "accuracy": (acc_a, acc_b), "wall_s": (wall_a, wall_b), "batch_rows": tuple(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--adapter", default="models/sft/sft")
    ap.add_argument("--reward-token", default="", help="condition every rollout (RCTP models: '<|high_reward|>')")
    ap.add_argument("--entries", default="data/entries.jsonl")
    ap.add_argument("--split", default="data/split.json")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--sides", nargs="+", default=["test", "dev"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    cfg = load_config(EvaluateConfig, args.params, "evaluate")
    prompt = load_config(PromptConfig, args.params, "prompt")
    compute = resolve_compute(load_compute(args.params), decode=cfg.decode.dtype, model_dir=args.model)
    backend = load_backend(cfg.decode.backend, args.model, args.adapter or None, **compute.backend_kwargs())
    print(f"model {args.model} + {args.adapter or 'no adapter'}, token {args.reward_token or 'none'}, "
          f"{backend.describe()}, threads {args.threads}")
    pool, differ = read_entries(args.entries), 0
    for side in args.sides:
        entries = stratified(select_entries(pool, split=args.split, side=side), cfg.limit)
        r = side_by_side(cfg, prompt, backend, entries, args.reward_token or None, load_reward_tokens(args.params))
        differ += r["answers_differ"]
        print(f"{side}: {r['entries']} entries, batch_rows {r['batch_rows'][0]} vs {r['batch_rows'][1]}: "
              f"answers differ {r['answers_differ']}, verdicts differ {r['verdicts_differ']}, largest log-prob gap "
              f"{r['max_logprob_gap']:.2e}; accuracy {r['accuracy'][0]:.1f} vs {r['accuracy'][1]:.1f} %; "
              f"{r['wall_s'][0]:.1f} s vs {r['wall_s'][1]:.1f} s ({r['wall_s'][0] / r['wall_s'][1]:.2f}x)")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
