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

The `vllm` arm (`--arms engine,vllm`, in the CPU vLLM environment `make vllm-venv`, or with the `[gpu]`
extra) decodes the same rollouts with `VLLMBackend` (one vLLM engine, prefix caching, every row of a call
scheduled together); its engine start-up (process spawn, load, warm-up, compilation unless `--vllm-eager`)
is timed and printed apart from its decode time, with the break-even: the decoded tokens at which start-up
+ decode equals the `engine` arm's decode time. At greedy decoding (`--temperature 0`) it also prints
whether the two backends' trajectories, results and verdicts are equal, or the first divergence.
`--prompts N`: the single-turn shape instead (N entries x G samples of one output each, every prompt cut to
`--prompt-len` tokens: the system prompt with the entry's docs, then its first question), e.g. an
evaluate-sized run `--prompts 48 --g 1 --prompt-len 350 --max-new-tokens 40 --temperature 0`.
`--threads N`: N torch threads for `naive` / `engine`, and vLLM's CPU engine bound to cores 0..N-1
(`VLLM_CPU_OMP_THREADS_BIND`; unset, vLLM keeps one of a 2-core host's cores for its front end).

Run: `python bench/rollout_throughput.py [--model models/base --device auto|cpu|cuda --entries 2 --g 4
--protocol official --max-new-tokens 32 --temperature 1.0 --rounds 1 --threads 0 --batch-rows 0
--arms naive,engine[,vllm] --vllm-batch-rows 0 --vllm-eager --prompts 0 --prompt-len 350]`
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rcgrpo_tasks.engine.backend import Backend, Completion, SamplingParams, Session, decode_text
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.kvcache import kv_bytes_per_token
from rcgrpo_tasks.engine.rollout import run_groups
from rcgrpo_tasks.env.multi_turn import entries as multi_turn
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops.config import load_with

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
"""Every value a config here leaves unset is the params file's (`ops.config.load_with`)."""

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4"}
"""vLLM's CPU KV cache (GiB) unless set: enough for the bench's rows, little of a shared host's memory."""


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
            sum(len(t.token_ids) for t in trajs)), trajs


def single_turn_prompts(tokenizer, entries, length: int) -> list[list[int]]:
    """One chat prompt per entry cut to ~`length` tokens: a system prompt holding the entry's docs (cut to fit),
    then its first question, then the generation prompt."""
    def ids(chat) -> list[int]:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    out = []
    for e in entries:
        question = next((m["content"] for turn in e.turns for m in turn), "")
        docs = "You can call these functions:\n" + multi_turn.render_docs(multi_turn.entry_docs(e)[0], "compact")
        chat = [{"role": "system", "content": ""}, {"role": "user", "content": question}]
        room = length - len(ids(chat))
        chat[0]["content"] = tokenizer.decode(tokenizer(docs, add_special_tokens=False)["input_ids"][:max(room, 0)])
        out.append(ids(chat))
    return out


def run_prompts(backend: Backend, prompts, g: int, sampling: SamplingParams, batch_rows: int | None):
    """`run_arm` for the single-turn shape: G samples of one output per prompt, `batch_rows` rows per session
    (whole groups; None = all at once), rows seeded per (prompt, sample) as the engine loop seeds them."""
    t0, c0 = time.perf_counter(), time.process_time()
    rows = [(i, k) for i in range(len(prompts)) for k in range(g)]
    step = max(g, (batch_rows // g) * g) if batch_rows else len(rows)
    outs = []
    for at in range(0, len(rows), step):
        chunk = rows[at:at + step]
        sess = backend.session()
        if sampling.seed is not None:
            sess.seed_rows({key: sampling.seed * 1_000_003 + key[0] * 1_009 + key[1] for key in chunk})
        outs += sess.generate(chunk, [prompts[i] for i, _ in chunk], sampling)
        sess.close()
    toks = sum(len(o.token_ids) for o in outs)
    return (time.perf_counter() - t0, time.process_time() - c0, toks, len(outs),
            toks + g * sum(len(p) for p in prompts)), outs


def first_divergence(ours, theirs, prompts=None):
    """None when equal, else (row, the shared sequence before the first differing token, our token, theirs);
    trajectories carry their whole sequence, completions need their `prompts`."""
    for row, (a, b) in enumerate(zip(ours, theirs)):
        if a.token_ids == b.token_ids and getattr(a, "score", None) == getattr(b, "score", None):
            continue
        at = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if at is None:  # same tokens, different verdicts: cannot be numerics
            return row, None, None, None
        head = list(prompts[row]) if prompts else []
        return row, head + list(a.token_ids[:at]), a.token_ids[at], b.token_ids[at]
    return None


def divergence_line(model, found, rows: int) -> str:
    """'equal', or the first divergence with the margin the hf model sees between the two tokens there: a
    near-tie (small margin) parts the two backends by rounding, not by a bug."""
    import torch

    if found is None:
        return f"equal ({rows} rows: token ids, and results and verdicts where scored)"
    row, seq, ours, theirs = found
    if seq is None:
        return f"row {row}: same tokens, different results or verdicts"
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([seq], device=model.device)).logits[0, -1].float(), -1)
    return (f"first divergence: row {row} at sequence position {len(seq)}: vllm {ours} vs hf {theirs}; hf's "
            f"log-probs there {float(logp[ours]):.4f} vs {float(logp[theirs]):.4f} (margin "
            f"{abs(float(logp[ours] - logp[theirs])):.4f})")


def start_vllm(args):
    """(VLLMBackend, start-up seconds); the engine binds cores 0..threads-1 when --threads is given."""
    from unittest import mock

    from rcgrpo_tasks.engine.vllm import VLLMBackend

    env = {k: v for k, v in VLLM_ENV.items() if k not in os.environ}
    if args.threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    t0 = time.perf_counter()
    with mock.patch.dict(os.environ, env):
        backend = VLLMBackend(args.model, dtype=args.dtype, device=args.device, enforce_eager=args.vllm_eager)
    return backend, time.perf_counter() - t0


def memory_line(name: str, peak: int, weights: int, rows: int, tokens: int, per_token: int) -> str:
    """Peak GPU memory per decoded row (less the weights) vs the KV bytes of the rows' tokens."""
    per_row, kv_row = (peak - weights) / rows, tokens * per_token / rows
    return (f"{name:>6}: peak {peak / 2**30:6.2f} GiB (weights {weights / 2**30:.2f}), per row "
            f"{per_row / 2**20:7.1f} MiB vs KV of its tokens {kv_row / 2**20:7.1f} MiB = {per_row / kv_row:.2f}x")


def parse_args():
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
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | auto (THE dtype rule with compute.cpu_bf16 off)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; vLLM's CPU cores (0 = defaults)")
    ap.add_argument("--batch-rows", type=int, default=0, help="rows per session (0 = every group at once)")
    ap.add_argument("--vllm-batch-rows", type=int, default=-1, help="the vllm arm's rows per session (-1 = --batch-rows)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start-up)")
    ap.add_argument("--arms", default="naive,engine", help="naive, engine, vllm: which arms, comma-separated")
    ap.add_argument("--prompts", type=int, default=0, help="single-turn shape: this many entries (0 = multi-turn)")
    ap.add_argument("--prompt-len", type=int, default=350, help="single-turn shape: tokens per prompt")
    return ap.parse_args()


def main() -> None:
    args = parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.arms.split(",")
    all_entries = multi_turn.load_entries()
    n = args.prompts or args.entries
    entries = [all_entries[(i * 200 + i * 7) % len(all_entries)] for i in range(n)]
    proto = load_with(PromptConfig, PARAMS, "prompt", protocol=args.protocol, system_prompt="bfcl").protocol_config(args.max_steps)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, seed=args.seed)
    engine = HFBackend(args.model, dtype=args.dtype, device=args.device,
                       cuda_graphs=False if args.no_cuda_graphs else None)
    cuda = engine.model.device.type == "cuda"
    prompts = single_turn_prompts(engine.tokenizer, entries, args.prompt_len) if args.prompts else None
    arms = {name: {"naive": NaiveBackend(engine), "engine": engine}[name] for name in names if name != "vllm"}
    startup = None
    if "vllm" in names:
        arms["vllm"], startup = start_vllm(args)
        print(f"vllm start-up: {startup:.1f} s ({arms['vllm'].describe()})", flush=True)
    rows = {name: (args.vllm_batch_rows if name == "vllm" and args.vllm_batch_rows >= 0 else args.batch_rows) or None
            for name in arms}
    totals = {name: [0.0, 0.0, 0, 0] for name in arms}
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    per_token = kv_bytes_per_token(engine.model.config, next(engine.model.parameters()).element_size())
    where = engine.describe()
    shape = (f"{n} prompts of ~{args.prompt_len} tokens x G={args.g}, one output" if prompts else
             f"entries {[e.id for e in entries]}, G={args.g}, protocol={args.protocol}")
    print(f"{shape}, max_new_tokens={args.max_new_tokens}, T={args.temperature}, dtype={where['dtype']}, "
          f"device={where['device']} {where.get('device_name', '')}, threads={torch.get_num_threads()}, "
          f"rows per session {rows}, load {os.getloadavg()[0]:.1f}")
    outputs = {}
    for rnd in range(args.rounds):
        for name, backend in arms.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if prompts:
                (wall, cpu, toks, rolls, all_toks), outputs[name] = run_prompts(backend, prompts, args.g, sampling,
                                                                                 rows[name])
            else:
                (wall, cpu, toks, rolls, all_toks), outputs[name] = run_arm(backend, entries, args.g, proto, sampling,
                                                                             rows[name])
            for i, v in enumerate((wall, cpu, toks, rolls)):
                totals[name][i] += v
            print(f"round {rnd} {name:>6}: {wall:7.1f} s wall, {cpu:7.1f} s CPU, {toks} model tokens, "
                  f"{toks / wall:8.2f} tok/s, {rolls / wall:.3f} rollouts/s (load {os.getloadavg()[0]:.1f})",
                  flush=True)
            if cuda:
                print("  memory " + memory_line(name, torch.cuda.max_memory_allocated(), weights, rolls, all_toks,
                                                per_token))
    report(totals, startup)
    if "vllm" in outputs and "engine" in outputs and args.temperature == 0:
        rows_prompts = prompts and [p for p in prompts for _ in range(args.g)]
        found = first_divergence(outputs["vllm"], outputs["engine"], rows_prompts)
        print(f"vllm vs engine at greedy: {divergence_line(engine.model, found, len(outputs['vllm']))}")
    if "vllm" in arms:
        arms["vllm"].close()


def report(totals: dict, startup: float | None) -> None:
    """Each arm's rates, the ratios, and (with a vllm arm) start-up apart from decode and the break-even."""
    for name, (wall, cpu, toks, rolls) in totals.items():
        per_cpu = f"{toks / cpu:8.2f} per CPU-s" if name != "vllm" else "its engine process's CPU not counted"
        print(f"{name:>6}: {toks / wall:8.2f} tok/s ({per_cpu}), {rolls / wall:.3f} rollouts/s")
    if {"naive", "engine"} <= set(totals):
        (nw, nc, nt, nr), (ew, ec, et, er) = totals["naive"], totals["engine"]
        print(f"ratio engine/naive: {(et / ew) / (nt / nw):.2f}x tokens/s wall-clock, "
              f"{(et / ec) / (nt / nc):.2f}x tokens per CPU-second, {(er / ew) / (nr / nw):.2f}x rollouts/s")
    if {"engine", "vllm"} <= set(totals):
        (ew, _, et, _), (vw, _, vt, _) = totals["engine"], totals["vllm"]
        speed = (vt / vw) / (et / ew)
        print(f"ratio vllm/engine: {speed:.2f}x tokens/s decode only; start-up included: "
              f"{(startup + vw) / ew:.2f}x the engine's time (vllm {startup:.1f} s start-up + {vw:.1f} s decode vs "
              f"engine {ew:.1f} s)")
        if speed > 1:  # t / r_e = startup + t / r_v  ->  t = startup / (1 / r_e - 1 / r_v)
            print(f"break-even: vllm pays for its start-up past {startup / (ew / et - vw / vt):.0f} decoded tokens")
        else:
            print("break-even: none (vllm decodes slower here)")


if __name__ == "__main__":
    main()
