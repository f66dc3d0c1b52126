"""Rollout throughput: the engine's `hf` backend vs a naive `generate` loop on the same rollouts.

Both arms drive the SAME engine loop (same entries, protocol, G, sampling settings, same model object), so
they differ only in how a step's completions are produced:
- `engine`: `HFBackend` sessions — the group's shared prompt prefilled once, each rollout's KV cache
  extended with only the new observation / user turn, the group decoded as one batch;
- `naive`: plain `model.generate` on the whole conversation at every step (re-prefilled from scratch):
  `num_return_sequences=G` while the group's prompts are identical, then the active conversations as one
  left-padded batch.
Arms alternate per round (naive, engine, naive, ...) so machine load hits both alike. Prints model
tokens/s (wall-clock, and per CPU-second: steadier on a shared machine with --threads 1) and rollouts/s
of each arm and their ratio (goal: engine >= 3x naive).

Run: `python bench/rollout_throughput.py --model models/base [--entries 2 --g 4 --protocol official
--max-new-tokens 32 --temperature 1.0 --rounds 1 --threads 2]`
"""

from __future__ import annotations

import argparse
import os
import time

from rcgrpo_tasks import bfcl
from rcgrpo_tasks.backends import Backend, Completion, HFBackend, SamplingParams, Session, _decode
from rcgrpo_tasks.engine import run_group
from rcgrpo_tasks.rollout import protocol_config


class NaiveBackend(Backend):
    """`model.generate` over the full conversation at every step; no cache survives between calls."""

    name = "naive"

    def __init__(self, hf: HFBackend):
        self.hf, self.tokenizer, self.max_positions = hf, hf.tokenizer, hf.max_positions

    def session(self) -> Session:
        return _NaiveSession(self.hf)


class _NaiveSession(Session):
    def __init__(self, hf: HFBackend):
        self.hf = hf

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import torch

        model, stops = self.hf.model, sorted(self.hf.stop_ids)
        same = all(list(p) == list(prompts[0]) for p in prompts)
        batch = [list(prompts[0])] if same else [list(p) for p in prompts]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[self.hf.pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        kwargs = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p) \
            if sampling.temperature > 0 else dict(do_sample=False)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(max_new_tokens),
                                 num_return_sequences=len(prompts) if same else 1, eos_token_id=stops,
                                 pad_token_id=self.hf.pad_id, output_scores=True, return_dict_in_generate=True,
                                 **kwargs)
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # (rows, steps, vocab)
        result = []
        for row, seq in enumerate(out.sequences[:, width:].tolist()):
            cut = next((i + 1 for i, t in enumerate(seq) if t in stops), len(seq))
            toks = seq[:cut]
            lps = [logp[row, i, t].item() for i, t in enumerate(toks)]
            finish = "stop" if toks and toks[-1] in stops else "length"
            result.append(Completion(toks, lps, _decode(self.hf.tokenizer, toks, set(stops)), finish))
        return result


def run_arm(backend: Backend, entries, g: int, proto, sampling: SamplingParams) -> tuple[float, float, int, int]:
    """(wall seconds, CPU seconds, model tokens, rollouts) of one GRPO group per entry."""
    import torch

    torch.manual_seed(sampling.seed or 0)
    t0, c0 = time.perf_counter(), time.process_time()
    trajs = [t for e in entries for t in run_group(backend, e, g, proto, sampling)]
    return (time.perf_counter() - t0, time.process_time() - c0, sum(t.n_model_tokens for t in trajs), len(trajs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/base")
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
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    all_entries = bfcl.load_entries()
    entries = [all_entries[(i * 200 + i * 7) % len(all_entries)] for i in range(args.entries)]
    proto = protocol_config(args.protocol, "compact", "bfcl", args.max_steps)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, seed=args.seed)
    engine = HFBackend(args.model, dtype=args.dtype)
    arms = {"naive": NaiveBackend(engine), "engine": engine}
    totals = {name: [0.0, 0.0, 0, 0] for name in arms}
    print(f"entries {[e.id for e in entries]}, G={args.g}, protocol={args.protocol}, "
          f"max_new_tokens={args.max_new_tokens}, T={args.temperature}, dtype={args.dtype}, "
          f"threads={torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    for rnd in range(args.rounds):
        for name, backend in arms.items():
            wall, cpu, toks, rolls = run_arm(backend, entries, args.g, proto, sampling)
            for i, v in enumerate((wall, cpu, toks, rolls)):
                totals[name][i] += v
            print(f"round {rnd} {name:>6}: {wall:7.1f} s wall, {cpu:7.1f} s CPU, {toks} model tokens, "
                  f"{toks / wall:6.2f} tok/s, {rolls / wall:.3f} rollouts/s (load {os.getloadavg()[0]:.1f})")
    for name, (wall, cpu, toks, rolls) in totals.items():
        print(f"{name:>6}: {toks / wall:7.2f} tok/s ({toks / cpu:7.2f} per CPU-s), {rolls / wall:.3f} rollouts/s")
    (nw, nc, nt, nr), (ew, ec, et, er) = totals["naive"], totals["engine"]
    print(f"ratio engine/naive: {(et / ew) / (nt / nw):.2f}x tokens/s wall-clock, "
          f"{(et / ec) / (nt / nc):.2f}x tokens per CPU-second, {(er / ew) / (nr / nw):.2f}x rollouts/s")


if __name__ == "__main__":
    main()
