"""bf16 against float32 on this CPU, side by side in one run: where a stage should compute in bf16. The decode
and train arms are THE calibration params `compute.cpu_bf16: auto` runs (`engine.dtype.calibrate`: one decode
step of `--rows` rows against a `--tokens` cache, float32 weights vs bf16 weights; a forward + backward of a
4 x 256 micro-batch, float32 vs bf16 autocast), here at the model's full depth instead of the cached run's 4
layers, and the choice `auto` makes from them (bf16 where >= `engine.dtype.AUTO_MIN_SPEEDUP`).
- gemm: one matmul of a training forward's shape (the batch's tokens x hidden -> the MLP's width), float32
  vs bfloat16 operands, timed as the calibration times its arms (`engine.dtype.side_by_side`).
Ratios > 1: bf16 is faster.

Run: `python bench/cpu_bf16.py [--model models/base --rows 16 --tokens 320 --reps 5 --threads 2]`. The
measured runs: docs/log.md, "CPU bf16".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rcgrpo_tasks.engine.dtype import AUTO_MIN_SPEEDUP, calibrate, model_shape, side_by_side


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=320)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = model_shape(args.model)
    hidden, inter = shape[0], shape[1]
    layers = json.loads((Path(args.model) / "config.json").read_text())["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)
    m = args.rows * args.tokens
    ops = {dt: (torch.randn(m, hidden, generator=gen).to(dt), torch.randn(hidden, inter, generator=gen).to(dt))
           for dt in (torch.float32, torch.bfloat16)}
    ratio = side_by_side(lambda: ops[torch.float32][0] @ ops[torch.float32][1],
                         lambda: ops[torch.bfloat16][0] @ ops[torch.bfloat16][1], args.reps * 4)
    print(f"gemm {m}x{hidden}x{inter}: bf16 speed-up {ratio:.2f}x", flush=True)
    got = calibrate(shape, layers=layers, rows=args.rows, tokens=args.tokens, reps=args.reps)
    for arm in ("decode", "train"):
        x = got[f"{arm}_speedup"]
        print(f"{arm}: bf16 speed-up {x:.2f}x -> auto takes {'bf16' if x >= AUTO_MIN_SPEEDUP else 'float32'} "
              f"(bf16 from {AUTO_MIN_SPEEDUP}x)", flush=True)
    print(json.dumps({**got, "layers": layers}), flush=True)


if __name__ == "__main__":
    main()
