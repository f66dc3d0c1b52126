"""RL rollout phase on CPU: two ways of decoding the same step side by side in one run (`--arms A,B`).

The rollout function of the rl stage hands the engine one process's share of a step. Both arms decode the
SAME groups, drawn as `rl_rollout.EngineRollout.group_specs` draws them (per group: its reward tokens and
its own sampling seed), from the SAME policy: the RL LoRA on the init model (non-zero deltas), sampled from
the merged rollout snapshot (`rollout_policy.policy_snapshot`, `--dtype`, as `rl.rollout_dtype: auto` picks
it) refreshed before every phase, or from the live PEFT model. The arms (`ARMS`):
- `per-group`: one `engine.run_group` after another (one session per group);
- `session`: `engine.run_seeded_groups` (`EngineRollout.groups`): one session for every group, ended rows
  leaving the batch (what the rl stage runs on a CPU);
- `session-full`: the same with every row in the batch until the longest answer ends;
- `live-full`: one session from the live PEFT model, every row to the end (`rollout_dtype: live`; what the
  float32 CPU default ran before the snapshot was taken there too).
Entries are real BFCL entries of `--task` (multi-turn by default; `--entries`: the shortest prompts of
`--categories`, as `rl.max_entries` picks them); the prompt is params `prompt`'s default (paper protocol).
The `gpu` profile's shape: `--groups 8 --g 5`; the CPU default's: `--task single_turn --groups 4 --g 4
--entries 64 --max-new-tokens 64 --max-outputs 1`. Without reward tokens in the model's tokenizer, `--mode rc`
adds them (mean init) in memory. Arms alternate per repetition (A B, B A, ...), each repetition a new step
(new tokens and seeds, the same in both arms). Prints per repetition and in total: model tokens, wall and
CPU seconds, model tokens/s of each arm (per wall and per CPU second: on a shared host the CPU-second figure
moves less with the other jobs) and the ratios, and how many rollouts are token-identical in both arms
(fp32: all but a rare rounding tie; bf16: batched matmuls may round differently).

What it measures: docs/engine.md, "One session per RL step" and "Ended rows leave the batch"; the runs:
docs/log.md, "Engine".
Run: `python bench/rl_rollout.py [--arms per-group,session --model models/base --adapter ... --groups 8 --g 5
--max-new-tokens 32 --max-outputs 2 --reps 3 --dtype auto --threads N]`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rcgrpo.goal import DEFAULT_LEVELS
from rcgrpo.tokens import add_reward_tokens
from rcgrpo_tasks.engine.compute import ComputeConfig, resolve_compute
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.rollout import run_group, run_seeded_groups
from rcgrpo_tasks.env import tasks
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops.config import load_with
from rcgrpo_tasks.train.common.adapters import lora_targets
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import pool as rl_pool
from rcgrpo_tasks.train.rl import rollout as rl_rollout
from rcgrpo_tasks.train.rl import rollout_policy
from rcgrpo_tasks.train.rl.trainer import load_init_model

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
"""Every value a config here leaves unset is the params file's (`ops.config.load_with`)."""


def lora_policy(model_dir: str, adapter: str | None, cfg: rl_config.RLConfig, mode: str, seed: int):
    """(PEFT model, tokenizer): the RL LoRA on the merged init with non-zero deltas; with `mode` rc/fixed and a
    tokenizer without the reward tokens, they are added (mean init) first."""
    import torch
    from peft import LoraConfig, get_peft_model

    model, tok = load_init_model(Path(model_dir), Path(adapter) if adapter else None, cfg.dtype)
    if mode != "none" and DEFAULT_LEVELS[-1] not in tok.get_vocab():
        add_reward_tokens(model, tok, DEFAULT_LEVELS, seed=seed, levels=DEFAULT_LEVELS)
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=lora_targets(cfg.lora_target_modules),
                      task_type="CAUSAL_LM")
    policy = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    return policy, tok


ARMS = {
    "per-group": "one `engine.run_group` per group, from the merged snapshot",
    "session": "every group in one session (`engine.run_seeded_groups`), from the merged snapshot, ended rows "
               "leave the batch (what the rl stage runs)",
    "session-full": "the same, every row in the batch to the last step (`HFBackend.narrow_rows` False)",
    "live-full": "one session, every row to the last step, from the live PEFT model (`rl.rollout_dtype: live`)",
}


def run_arm(name: str, rollout: rl_rollout.EngineRollout, policy, state: dict, dtype, ids: list[str],
            step: int):
    """(wall s, CPU s, model tokens, trajectories) of one rollout phase of arm `name` (`ARMS`), snapshot
    refresh included."""
    t0, c0 = time.perf_counter(), time.process_time()
    if name.startswith("live"):
        backend = HFBackend.from_model(policy, rollout.tokenizer)
    else:
        state["snap"] = rollout_policy.policy_snapshot(policy, dtype, state.get("snap"))
        backend = HFBackend.from_model(state["snap"], rollout.tokenizer)
    backend.narrow_rows = not name.endswith("-full")
    specs = rollout.group_specs(ids, step, list(range(len(ids))), call=0)
    if name == "per-group":
        groups = [run_group(backend, e, len(t), rollout.protocol, sp, t) for e, t, sp in specs]
    else:
        groups = run_seeded_groups(backend, specs, rollout.protocol)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    trajs = [t for g in groups for t in g]
    return wall, cpu, sum(t.n_model_tokens for t in trajs), trajs


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--adapter", default=None, help="init adapter (models/rctp/0); default: the base model")
    ap.add_argument("--task", default="multi_turn", choices=list(tasks.TASK_NAMES))
    ap.add_argument("--categories", nargs="+", default=None, help="default: the task's default categories")
    ap.add_argument("--groups", type=int, default=8, help="groups per step and process (gpu profile: 40 / 5 = 8)")
    ap.add_argument("--g", type=int, default=5, help="rollouts per group (gpu profile: 5)")
    ap.add_argument("--entries", type=int, default=None, help="draw the groups from this many shortest-prompt "
                    "entries (default: --groups)")
    ap.add_argument("--mode", default="rc", choices=["rc", "fixed", "none"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-outputs", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--arms", default="per-group,session", help="two arms, A,B (B's ratio over A): "
                    + "; ".join(f"{k}: {v}" for k, v in ARMS.items()))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own); 1 keeps a "
                    "host shared with other jobs from stalling the threads of a step on each other")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="rollout snapshot dtype; auto: bfloat16 where the CPU has AMX, else float32")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, resolve_compute(load_with(ComputeConfig, PARAMS, "compute", device="cpu", cpu_bf16="auto"),
                                           decode=args.dtype, model_dir=args.model).decode_dtype)
    cfg = load_with(rl_config.RLConfig, PARAMS, "rl", **{"max_new_tokens": args.max_new_tokens, "max_outputs": args.max_outputs,
                                    "temperature": args.temperature, "num_generations": args.g,
                                    "batch_size": args.g * args.groups, "micro_batch_size": args.g,
                                    "seed": args.seed, "max_entries": None, "pool_band": None})
    policy, tok = lora_policy(args.model, args.adapter, cfg, args.mode, args.seed)
    proto = load_with(PromptConfig, PARAMS, "prompt", system_prompt="bfcl").protocol_config(args.max_outputs)
    task = tasks.get_task(args.task)
    pool = task.load_entries(tuple(args.categories or task.default_categories))
    pool.sort(key=lambda e: (rl_pool.prompt_length(e, proto, tok), e.id))
    entries = pool[: args.entries or args.groups]
    by_id = {e.id: e for e in entries}
    rollout = rl_rollout.EngineRollout(cfg, proto, args.mode, DEFAULT_LEVELS, by_id, tok)
    lengths = [rl_pool.prompt_length(e, proto, tok) for e in entries]
    print(f"{args.task}: {args.groups} groups x G={args.g} from {len(entries)} entries (prompt tokens {min(lengths)}-{max(lengths)}), "
          f"mode {args.mode}, <= {args.max_outputs} outputs of <= {args.max_new_tokens} tokens, T={args.temperature}, "
          f"snapshot {dtype}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    names = tuple(args.arms.split(","))
    if len(names) != 2 or not set(names) <= set(ARMS):
        raise SystemExit(f"--arms: two of {', '.join(ARMS)}, comma-separated; got {args.arms!r}")
    totals = {n: [0.0, 0.0, 0] for n in names}
    state: dict = {}
    same = total = 0
    for rep in range(args.reps):
        ids = [entries[(rep * args.groups + k) % len(entries)].id for k in range(args.groups)]
        out = {}
        for name in (names if rep % 2 == 0 else names[::-1]):
            wall, cpu, toks, trajs = run_arm(name, rollout, policy, state, dtype, ids, step=rep)
            out[name] = trajs
            totals[name] = [a + b for a, b in zip(totals[name], (wall, cpu, toks))]
            print(f"rep {rep} {name:>12}: {wall:7.2f} s ({cpu:7.2f} CPU-s), {toks:5d} model tokens, "
                  f"{toks / wall:7.2f} tok/s (load {os.getloadavg()[0]:.1f})", flush=True)
        same += sum(a.token_ids == b.token_ids for a, b in zip(*out.values()))
        total += len(out[names[0]])
    for name, (wall, cpu, toks) in totals.items():
        print(f"{name:>12}: {toks / wall:7.2f} model tokens/s ({toks / cpu:6.2f} per CPU-s), "
              f"{wall / args.reps:7.2f} s per rollout phase")
    (aw, ac, at), (bw, bc, bt) = totals[names[0]], totals[names[1]]
    print(f"ratio {names[1]} / {names[0]}: {(bt / bw) / (at / aw):.2f}x model tokens/s wall-clock, "
          f"{(bt / bc) / (at / ac):.2f}x per CPU-second, {aw / bw:.2f}x faster per phase; "
          f"{same}/{total} rollouts token-identical")


if __name__ == "__main__":
    main()
