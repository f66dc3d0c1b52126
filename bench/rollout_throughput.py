"""Rollout throughput: the engine's `hf` backend vs a naive `generate` loop on the same rollouts.

Both arms drive the SAME engine loop (`run_groups`: same entries, protocol, G, sampling settings, same
model object, every group of the batch handed over at once), so they differ only in how a step's
completions are produced:
- `engine`: one `HFBackend` session for the batch — each group's shared prompt prefilled once, each
  rollout's KV cache (preallocated) extended with only the new observation / user turn, all rows decoded
  together (a CUDA graph per decode step on CUDA);
- `naive`: plain `model.generate` on the whole conversation at every step (re-prefilled from scratch):
  while each group's rows still share one prompt, that prompt once per group with
  `num_return_sequences=G`, then the active conversations as one left-padded batch.
Arms alternate per round (naive, engine, naive, ...) so machine load hits both alike. Prints model
tokens/s (wall-clock, and per CPU-second: steadier on a shared machine) and rollouts/s of each arm and
their ratio (goal on CPU with the defaults: engine >= 3x naive). On CUDA it also prints each arm's peak GPU
memory per decoded row (`torch.cuda.max_memory_allocated` less the weights, / rows) beside the KV bytes
the rows' tokens need (goal: within 1.5x).

Run: `python bench/rollout_throughput.py [--model models/base --device auto|cpu|cuda --entries 2 --g 4
--protocol official --max-new-tokens 32 --temperature 1.0 --rounds 1 --threads 0 --batch-rows 0]`
"""

from __future__ import annotations

import argparse
import os
import time

from rcgrpo_tasks.engine.backend import Backend, Completion, SamplingParams, Session, decode_text
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.kvcache import kv_bytes_per_token
from rcgrpo_tasks.engine.rollout import run_groups
from rcgrpo_tasks.env import bfcl
from rcgrpo_tasks.env.protocols import PromptConfig


class NaiveBackend(Backend):
    """`model.generate` over the full conversation at every step; no cache survives between calls."""

    name = "naive"

    def __init__(self, hf: HFBackend):
        self.hf, self.tokenizer, self.max_positions = hf, hf.tokenizer, hf.max_positions

    def session(self) -> Session:
        return _NaiveSession(self.hf)


def repeated_blocks(prompts) -> int:
    """n when the prompts are k distinct prompts each repeated n times in a row (k * n rows), else 1."""
    n = 1
    while n < len(prompts) and list(prompts[n]) == list(prompts[0]):
        n += 1
    if len(prompts) % n or any(list(prompts[i]) != list(prompts[i - i % n]) for i in range(len(prompts))):
        return 1
    return n


class _NaiveSession(Session):
    def __init__(self, hf: HFBackend):
        self.hf = hf

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import torch

        model, stops = self.hf.model, sorted(self.hf.stop_ids)
        n = repeated_blocks(prompts)
        batch = [list(p) for p in prompts[::n]]
        width = max(len(p) for p in batch)
        dev = model.device
        ids = torch.tensor([[self.hf.pad_id] * (width - len(p)) + p for p in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=dev)
        kwargs = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p) \
            if sampling.temperature > 0 else dict(do_sample=False)
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(caps),
                                 num_return_sequences=n, eos_token_id=stops, pad_token_id=self.hf.pad_id,
                                 output_scores=True, return_dict_in_generate=True, **kwargs)
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # (rows, steps, vocab)
        result = []
        for row, seq in enumerate(out.sequences[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(seq) if t in stops), len(seq))
            toks = seq[:min(cut, caps[row])]
            lps = logp[row, torch.arange(len(toks)), torch.tensor(toks)].tolist() if toks else []
            finish = "stop" if toks and toks[-1] in stops else "length"
            result.append(Completion(toks, lps, decode_text(self.hf.tokenizer, toks, set(stops)), finish))
        return result


def run_arm(backend: Backend, entries, g: int, proto, sampling: SamplingParams, batch_rows: int | None):
    """(wall s, CPU s, model tokens, rollouts, total tokens) of one GRPO group per entry, all groups handed
    to the engine loop at once (packed `batch_rows` rows to a session; None = one session)."""
    import torch

    torch.manual_seed(sampling.seed or 0)
    t0, c0 = time.perf_counter(), time.process_time()
    groups = run_groups(backend, [(e, [None] * g) for e in entries], proto, sampling, batch_rows=batch_rows)
    trajs = [t for group in groups for t in group]
    return (time.perf_counter() - t0, time.process_time() - c0, sum(t.n_model_tokens for t in trajs), len(trajs),
            sum(len(t.token_ids) for t in trajs))


def memory_line(name: str, peak: int, weights: int, rows: int, tokens: int, per_token: int) -> str:
    """Peak GPU memory per decoded row (less the weights) vs the KV bytes of the rows' tokens."""
    per_row, kv_row = (peak - weights) / rows, tokens * per_token / rows
    return (f"{name:>6}: peak {peak / 2**30:6.2f} GiB (weights {weights / 2**30:.2f}), per row "
            f"{per_row / 2**20:7.1f} MiB vs KV of its tokens {kv_row / 2**20:7.1f} MiB = {per_row / kv_row:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--entries", type=int, default=2, help="entries (one GRPO group each), spread over categories")
    ap.add_argument("--g", type=int, default=4)
    ap.add_argument("--protocol", default="official", choices=["official", "paper"])
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--batch-rows", type=int, default=0, help="rows per session (0 = every group at once)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA")
    ap.add_argument("--arms", default="naive,engine", help="which arms to run, comma-separated")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    all_entries = bfcl.load_entries()
    entries = [all_entries[(i * 200 + i * 7) % len(all_entries)] for i in range(args.entries)]
    proto = PromptConfig(protocol=args.protocol).protocol_config(args.max_steps)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, seed=args.seed)
    engine = HFBackend(args.model, dtype=args.dtype, device=args.device,
                       cuda_graphs=False if args.no_cuda_graphs else None)
    cuda = engine.model.device.type == "cuda"
    arms = {name: {"naive": NaiveBackend(engine), "engine": engine}[name] for name in args.arms.split(",")}
    totals = {name: [0.0, 0.0, 0, 0] for name in arms}
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    per_token = kv_bytes_per_token(engine.model.config, next(engine.model.parameters()).element_size())
    where = engine.describe()
    print(f"entries {[e.id for e in entries]}, G={args.g}, protocol={args.protocol}, "
          f"max_new_tokens={args.max_new_tokens}, T={args.temperature}, dtype={where['dtype']}, "
          f"device={where['device']} {where.get('device_name', '')}, threads={torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.1f}")
    for rnd in range(args.rounds):
        for name, backend in arms.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            wall, cpu, toks, rolls, all_toks = run_arm(backend, entries, args.g, proto, sampling, args.batch_rows or None)
            for i, v in enumerate((wall, cpu, toks, rolls)):
                totals[name][i] += v
            print(f"round {rnd} {name:>6}: {wall:7.1f} s wall, {cpu:7.1f} s CPU, {toks} model tokens, "
                  f"{toks / wall:8.2f} tok/s, {rolls / wall:.3f} rollouts/s (load {os.getloadavg()[0]:.1f})")
            if cuda:
                print("  memory " + memory_line(name, torch.cuda.max_memory_allocated(), weights, rolls, all_toks,
                                                per_token))
    for name, (wall, cpu, toks, rolls) in totals.items():
        print(f"{name:>6}: {toks / wall:8.2f} tok/s ({toks / cpu:8.2f} per CPU-s), {rolls / wall:.3f} rollouts/s")
    if set(arms) == {"naive", "engine"}:
        (nw, nc, nt, nr), (ew, ec, et, er) = totals["naive"], totals["engine"]
        print(f"ratio engine/naive: {(et / ew) / (nt / nw):.2f}x tokens/s wall-clock, "
              f"{(et / ec) / (nt / nc):.2f}x tokens per CPU-second, {(er / ew) / (nr / nw):.2f}x rollouts/s")


if __name__ == "__main__":
    main()
