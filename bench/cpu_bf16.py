"""bf16 against float32 on this CPU, side by side in one run, at the default's shapes: where a stage should
compute in bf16 (what params `compute.cpu_bf16: auto` measures in short: `engine.dtype.calibrate`).

- gemm: one matmul of a training forward's shape (the batch's tokens x hidden -> the MLP's width), float32
  vs bfloat16 operands: GFLOP/s of each and the ratio.
- train: the model's forward + backward on `--rows` x `--tokens` tokens (full weights, the loss on every
  position), float32 vs bf16 autocast (what `bf16: true` runs): seconds and the ratio.
- decode: one decode step of `--rows` rows against a `--tokens` cache, float32 weights vs bf16 weights (what
  `dtype: auto` decodes in): seconds and the ratio.
Repetitions alternate the arms (A B, B A, ...); medians. Ratios > 1: bf16 is faster.

Run: `python bench/cpu_bf16.py [--model models/base --rows 4 --tokens 256 --reps 5 --threads 2]`. The
measured runs: docs/log.md, "CPU bf16".
"""

from __future__ import annotations

import argparse
import statistics
import time


def _timed(fn, reps: int) -> list[float]:
    fn()  # warm-up: oneDNN picks its kernels on the first call
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _side_by_side(name: str, arms: dict, reps: int, unit=lambda s: f"{s:.4f} s") -> None:
    times: dict[str, list[float]] = {k: [] for k in arms}
    order = list(arms)
    for r in range(reps):
        for k in order if r % 2 == 0 else reversed(order):
            times[k] += _timed(arms[k], 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    cells = ", ".join(f"{k} {unit(v)}" for k, v in med.items())
    print(f"{name}: {cells}; bf16 speed-up {med['float32'] / med['bfloat16']:.2f}x", flush=True)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    cfg = model.config
    m, k, n = args.rows * args.tokens, cfg.hidden_size, cfg.intermediate_size
    ops = {dt: (torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)) for dt in (torch.float32, torch.bfloat16)}
    gemm = {"float32": lambda: ops[torch.float32][0] @ ops[torch.float32][1],
            "bfloat16": lambda: ops[torch.bfloat16][0] @ ops[torch.bfloat16][1]}
    _side_by_side(f"gemm {m}x{k}x{n}", gemm, args.reps * 4, lambda s: f"{2 * m * k * n / s / 1e9:.0f} GFLOP/s")

    ids = torch.randint(0, cfg.vocab_size, (args.rows, args.tokens))

    def step(autocast: bool):
        def run():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return run

    model.train()
    _side_by_side(f"train fwd+bwd {args.rows}x{args.tokens}", {"float32": step(False), "bfloat16": step(True)},
                  args.reps)
    model.zero_grad(set_to_none=True)
    model.eval()
    half = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()

    def decode(net):
        with torch.no_grad():
            cache = net(input_ids=ids, use_cache=True).past_key_values
        nxt = ids[:, -1:]

        def run():
            with torch.no_grad():
                net(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the step's token: the same cache length every repetition
        return run

    _side_by_side(f"decode step {args.rows} rows at {args.tokens}", {"float32": decode(model), "bfloat16": decode(half)},
                  args.reps * 4)


if __name__ == "__main__":
    main()
