"""Trained tokens/s of the project's SFT configuration vs TRL `SFTTrainer` defaults, same data and model.

Both sides get the same pre-tokenized rows (assistant-only labels), the same LoRA, batch size, max length,
learning rate and seed, so they see the same batches; they differ only in what the project changes for
CPU speed (see rcgrpo_tasks/train/sft/trainer.py): TRL defaults = gradient checkpointing on, bf16 autocast, the fused
LM head over every position; project = `params.yaml:sft` (no checkpointing, bf16 where the CPU has it,
LM head on assistant positions only). Tokens/s = non-padding tokens of a step / its wall time, the
median over the measured steps (the first step of each run is a warm-up and not counted); tokens per
CPU-second (process time) is printed too, as it is far less sensitive to other processes on the machine.
Runs alternate (project, defaults, project, ...) so load from other processes hits both alike.

Data: `--data` (a label_rewards JSONL) if it exists, else expert chats replayed from BFCL gold calls
(`engine.replay_calls`, the paper protocol, real observations).
Run: `python bench/sft_throughput.py --model-dir models/base` (small defaults: 1 row x <= 1536 tokens, the
pipeline's max_length, 2 measured steps per arm); the pipeline's batch: `--batch-size 2 --steps 3 --rows 24`.
Goal: ratio >= 1.5.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rcgrpo.tokens import add_reward_tokens, expose_head_bias  # noqa: E402
from rcgrpo_tasks.engine.compute import load_compute  # noqa: E402
from rcgrpo_tasks.engine.rollout import replay_calls  # noqa: E402
from rcgrpo_tasks.env.multi_turn import entries as multi_turn  # noqa: E402
from rcgrpo_tasks.env.prompt import PromptConfig  # noqa: E402
from rcgrpo_tasks.ops.config import as_dict, from_dict, load_config  # noqa: E402
from rcgrpo_tasks.ops.inputs import read_jsonl  # noqa: E402
from rcgrpo_tasks.train.sft import config as sft_config  # noqa: E402
from rcgrpo_tasks.train.sft import rows as sft_rows  # noqa: E402
from rcgrpo_tasks.train.sft import run as sft_run  # noqa: E402
from rcgrpo_tasks.train.sft import trainer as sft_trainer  # noqa: E402


def replay_rows(model_dir: Path, n: int, params: Path) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the pipeline's prompt section under the paper protocol (the one the multi-turn replays are written in)
    prompt = load_config(PromptConfig, params, "prompt")
    cfg = PromptConfig("paper", prompt.doc_style, prompt.system_prompt).protocol_config(20)
    rows = []
    for entry in multi_turn.load_entries(["base"])[:n]:
        traj = replay_calls(entry, cfg, entry.ground_truth, tokenizer)
        rows.append({"messages": traj.messages, "reward_token": None})
    return rows


def load_rows(args) -> tuple[list[dict], str]:
    if args.data and Path(args.data).is_file():
        return read_jsonl(args.data)[: args.rows], str(args.data)
    return replay_rows(args.model_dir, args.rows, args.params), f"replayed gold calls of {args.rows} base entries"


def step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.samples: list[tuple[float, int]] = []
            self.trainer = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.t, self.c, self.n = time.perf_counter(), time.process_time(), self.trainer._total_train_tokens

        def on_step_end(self, args, state, control, **kwargs):
            self.samples.append((time.perf_counter() - self.t, self.trainer._total_train_tokens - self.n,
                                 time.process_time() - self.c))

    return StepTimer()


def make_trainer(kind: str, cfg, args, rows: list[dict], tokens: tuple[str, ...], out: Path):
    """`project`: the stage's own trainer; `defaults`: plain SFTTrainer + SFTConfig defaults + same LoRA."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    timer = step_timer()
    if kind == "project":
        trainer = sft_trainer.build_trainer(cfg, args.model_dir, rows, tokens, out, [timer])
        stats = trainer.data_stats
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        model = AutoModelForCausalLM.from_pretrained(args.model_dir)
        ids = add_reward_tokens(model, tokenizer, tokens)
        data, stats = sft_rows.tokenize_rows(rows, tokenizer, cfg.max_length)
        conf = SFTConfig(output_dir=str(out), per_device_train_batch_size=cfg.batch_size, max_steps=cfg.max_steps,
                         learning_rate=cfg.learning_rate, max_length=cfg.max_length, seed=cfg.seed,
                         report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
        trainer = SFTTrainer(model=model, args=conf, train_dataset=Dataset.from_list(data), processing_class=tokenizer,
                             peft_config=sft_trainer.lora_config(cfg, model, ids), callbacks=[timer])
        expose_head_bias(trainer.model)
    timer.trainer = trainer
    return trainer, timer, stats


def measure(kind: str, cfg, args, rows, tokens) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trainer, timer, stats = make_trainer(kind, cfg, args, rows, tokens, Path(tmp))
        trainer.train()
        a = trainer.args
        knobs = {"gradient_checkpointing": a.gradient_checkpointing, "bf16": a.bf16,
                 "padding_free": getattr(a, "padding_free", False),
                 "compact_lm_head": bool(getattr(trainer, "compact_lm_head", False))}
    speeds = [n / t for t, n, _ in timer.samples[1:]]
    per_cpu_s = [n / c for _, n, c in timer.samples[1:]]
    return {"kind": kind, "tok_s": speeds, "tok_per_cpu_s": per_cpu_s, "s_per_step": [t for t, _, _ in timer.samples[1:]],
            "tokens_per_step": statistics.mean(n for _, n, _ in timer.samples), "knobs": knobs, "data": stats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path("models/base"))
    p.add_argument("--data", type=Path, default=Path("data/datasets/sft.jsonl"))
    p.add_argument("--params", type=Path, default=Path("params.yaml"))
    p.add_argument("--variant", default="sft")
    # Defaults answer within minutes on a 2-core CPU without native bf16 (where TRL's default bf16 autocast is
    # emulated and slow): one row per step; max_length stays the pipeline's, since the chats' first assistant
    # token comes after ~1.2k tokens of tool docs (a shorter cut leaves no token to train on).
    p.add_argument("--rows", type=int, default=8, help="rows used (from the file or replayed)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-length", type=int, default=1536)
    p.add_argument("--steps", type=int, default=2, help="measured steps per run (+1 warm-up)")
    p.add_argument("--rounds", type=int, default=1, help="project/defaults alternations")
    p.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                   help="override an sft param on the project side, e.g. --set padding_free=true")
    args = p.parse_args()
    if not (args.model_dir / "config.json").is_file():
        sys.exit(f"{args.model_dir}: no model folder; run `dvc repro prepare_model` (or pass --model-dir)")

    import dataclasses

    import torch
    import yaml

    torch.manual_seed(0)
    cfg, tokens = sft_run.load_sft_config(args.params, args.variant)
    cfg = dataclasses.replace(cfg, batch_size=args.batch_size, grad_accum=1, max_length=args.max_length,
                              max_steps=args.steps + 1, max_examples=None, save_steps=10_000)
    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    project_cfg = from_dict(sft_config.SftConfig, {**as_dict(cfg), **overrides}, where="--set")
    compute = load_compute(args.params)  # THE dtype rule, once, as the sft stage resolves it
    cfg, project_cfg = (c.resolved(c.compute_for(compute, model_dir=args.model_dir)) for c in (cfg, project_cfg))
    rows, source = load_rows(args)
    print(f"model {args.model_dir} | data: {source} | batch {cfg.batch_size} x max_length {cfg.max_length} | "
          f"torch threads {torch.get_num_threads()}", flush=True)
    results: dict[str, list[dict]] = {"project": [], "defaults": []}
    for _ in range(args.rounds):
        for kind in results:
            r = measure(kind, project_cfg if kind == "project" else cfg, args, rows, tokens)
            results[kind].append(r)
            print(f"  {kind:8s} s/step {[round(s, 1) for s in r['s_per_step']]} tok/s "
                  f"{[round(v, 1) for v in r['tok_s']]} tok/CPU-s {[round(v, 1) for v in r['tok_per_cpu_s']]} "
                  f"~{r['tokens_per_step']:.0f} tok/step {r['knobs']}", flush=True)
    med = {k: statistics.median(v for r in rs for v in r["tok_s"]) for k, rs in results.items()}
    cpu = {k: statistics.median(v for r in rs for v in r["tok_per_cpu_s"]) for k, rs in results.items()}
    print(f"\n{'config':10s} {'tokens/s':>9s} {'tokens/CPU-s':>13s}")
    for k in results:
        print(f"{k:10s} {med[k]:9.1f} {cpu[k]:13.1f}")
    print(f"ratio project/defaults = {med['project'] / med['defaults']:.2f}x wall-clock, "
          f"{cpu['project'] / cpu['defaults']:.2f}x per CPU-second (goal >= 1.5x; on a shared machine the CPU-time "
          f"ratio is the steadier one)")


if __name__ == "__main__":
    main()
