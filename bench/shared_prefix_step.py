"""RL and RCTP steps with and without the shared-prefix forward (`engine.shared_prefix`), side by side in one
run, at the CPU default's shapes.

- RL: the rl stage itself (`rl_run.train_rl`, RC-GRPO from `--model`, + `--adapter` merged when given) at the
  default's shape, params.yaml's `rl` section with `max_steps` = `--steps`, `pool_band` off (no
  sample_policy needed) and `shared_prefix_min_tokens` null (plain) or the default (shared). Per step from
  the run's diagnostics: the whole step (TRL's `step_time`, rollouts included), the rollouts (`rollout_s`)
  and the training part (the difference: policy forward/backward, reference forward, the trainer's
  log-probs for the mismatch, the rollout snapshot). The first step of each run (warm-up) is left out.
  `--rl-plain before`: the plain arm also samples as the rl stage did before its rollouts were sped up (the
  live PEFT model, `rollout_dtype: live`, every row decoded to the last step): the whole change, one ratio.
- margin: the teacher-forced margin's forwards (`data.margin.sequence_logprobs`) on `--margin` held-out
  entries' contrast sets (expert + near misses under both tokens), shared vs the padded forward of the same
  chunks, with the largest log-prob difference between the arms. `--margin-plain before`: the plain arm is
  the prefix tree of the chunks the margin cut before whole entries (2,048 tokens counted before sharing).
- RCTP: `sft_run.train_variant` with the default's `rctp` variant on `--pairs` pairs built from real entries
  (one prompt under both tokens, an expert answer and a near miss), the same micro-batch of one pair, plain
  vs shared; per-step seconds from the run's log (Trainer `train_runtime` / steps, warm-up step excluded).
Each arm runs in its own process (peak RSS per arm, `ru_maxrss` of the child), arms alternate per repetition
(A B, B A, ...). Prints every arm's seconds, the medians and the ratios plain / shared.

Run: `python bench/shared_prefix_step.py [--model models/base --adapter models/sft/sft --steps 5 --reps 2
--threads 2 --pairs data/datasets/rctp.jsonl --margin 16 --kinds rl,rctp,margin]` (float32: `RCGRPO_CPU_BF16=0`). The measured runs: docs/log.md, "Shared prefix".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "params.yaml"


def rl_arm(args, shared: bool, work: Path) -> dict:
    """One RL run; per-step seconds (whole, rollouts, training) after the first step."""
    from rcgrpo_tasks.engine.compute import ComputeConfig
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.ops.config import from_dict, load_with, read_sections
    from rcgrpo_tasks.ops.inputs import read_tsv
    from rcgrpo_tasks.train.rl import config as rl_config
    from rcgrpo_tasks.train.rl import run as rl_run
    from rcgrpo_tasks.train.rl import trainer as rl_trainer

    params = read_sections(PARAMS, "rl", "prompt", "label_rewards")
    raw = {**params["rl"], "max_steps": args.steps, "pool_band": None, "save_steps": args.steps}
    if not shared:
        raw["shared_prefix_min_tokens"] = None
        if args.rl_plain == "before":  # rollouts as before: the live PEFT model, every row to the last step
            from rcgrpo_tasks.engine.hf import HFBackend

            raw["rollout_dtype"] = "live"
            init = HFBackend._init

            def full_batch(self, *a, **k):
                init(self, *a, **k)
                self.narrow_rows = False

            HFBackend._init = full_batch
    cfg = from_dict(rl_config.RLConfig, raw)
    prompt = from_dict(PromptConfig, params["prompt"])
    levels = tuple(params["label_rewards"]["tokens"])
    model_dir = Path(args.model) if args.adapter else prepared_model(Path(args.model), levels, work)
    name = "shared" if shared else "plain"
    spec = rl_trainer.RLRun(init="rctp", algo="rc_grpo", model_dir=model_dir,
                              adapter_dir=Path(args.adapter) if args.adapter else None,
                              entries=REPO / "data/entries.jsonl", split=REPO / "data/split.json", out=work / name,
                              checkpoints=work / f"ckpt-{name}", plots=work / f"{name}.tsv")
    rl_run.train_rl(cfg, prompt.protocol_config(cfg.decode.max_outputs), levels, spec, track=False,
                compute=load_with(ComputeConfig, PARAMS, "compute", device="cpu"))
    rows = read_tsv(spec.plots)[1:]
    return {"step": [r["step_time"] for r in rows], "rollout": [r["rollout_s"] for r in rows],
            "train": [r["step_time"] - r["rollout_s"] for r in rows],
            "tokens": [r["model_tokens"] for r in rows]}


def prepared_model(model: Path, levels: tuple[str, ...], work: Path) -> Path:
    """`model` itself when its tokenizer has the reward tokens, else a copy with them added (mean init), as
    the RCTP model has them (with `--adapter`, the adapter's tokenizer brings them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rcgrpo.tokens import add_reward_tokens

    tok = AutoTokenizer.from_pretrained(model)
    if levels[-1] in tok.get_vocab():
        return model
    out = work / "model_with_tokens"
    m = AutoModelForCausalLM.from_pretrained(model)
    add_reward_tokens(m, tok, levels, seed=0, levels=levels)
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def rctp_arm(args, shared: bool, work: Path) -> dict:
    """RCTP steps on pairs of real prompts (expert vs near miss under both tokens); seconds per step after
    the first."""
    import time

    from transformers import TrainerCallback

    from rcgrpo_tasks.engine.compute import ComputeConfig
    from rcgrpo_tasks.ops.config import from_dict, load_with, read_sections
    from rcgrpo_tasks.train.sft import config as sft_config
    from rcgrpo_tasks.train.sft import run as sft_run

    params = read_sections(PARAMS, "sft", "label_rewards")
    cfg = from_dict(sft_config.SftConfig, params["sft"]).resolve("rctp")
    cfg = replace(cfg, max_steps=args.steps + 1, save_steps=args.steps + 1, margin_every=0, log_model=False,
                  init="base", shared_prefix_min_tokens=cfg.shared_prefix_min_tokens if shared else None)
    levels = tuple(params["label_rewards"]["tokens"])

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    name = "shared" if shared else "plain"
    spec = sft_config.SftRun("rctp", Path(args.model), Path(args.pairs), work / name, work / f"ckpt-{name}",
                           work / f"{name}.json", work / f"{name}.tsv")
    sft_run.train_variant(cfg, levels, spec, callbacks=[clock], track=False, compute=load_with(ComputeConfig, PARAMS, "compute", device="cpu"))
    return {"rctp_step": clock.times[1:]}


def margin_arm(args, shared: bool, work: Path) -> dict:
    """The teacher-forced margin's forwards (`data.margin.sequence_logprobs`) on `--margin` held-out entries'
    contrast sets: shared prefix tree vs the padded forward of the same chunks; seconds per call (the first
    of `--steps + 1` calls left out) and the log-probs (compared across the arms by the parent)."""
    import time

    from rcgrpo_tasks.data import margin as mg
    from rcgrpo_tasks.engine.models import load_trained
    from rcgrpo_tasks.env.entries import split_entries
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.ops.config import from_dict, read_sections

    params = read_sections(PARAMS, "prompt", "label_rewards")
    levels = tuple(params["label_rewards"]["tokens"])
    model, tok = load_trained(Path(args.model), Path(args.adapter) if args.adapter else None, dtype="float32")
    proto = from_dict(PromptConfig, params["prompt"]).protocol_config(1)
    entries = split_entries(REPO / "data/entries.jsonl", REPO / "data/split.json", "test")[: args.margin]
    items, _ = mg.contrast_set(entries, proto, tok, (levels[-1], levels[0]))
    if not shared and args.margin_plain == "before":  # the tree per chunk of 2,048 tokens before sharing
        mg.margin_chunks, shared = _raw_chunks, True
    times, lps = [], []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        lps = mg.sequence_logprobs(model, items, shared=shared)
        times.append(time.perf_counter() - t0)
    return {"margin_s": times[1:], "logprobs": lps, "sequences": len(items)}


def _raw_chunks(items: list) -> list[list]:
    """The margin's chunks before `data.margin.margin_chunks`: consecutive sequences up to 2,048 tokens counted
    before sharing, cut anywhere (an entry's prompt in two forwards)."""
    chunks, chunk = [], []
    for c in items:
        if chunk and sum(len(x.token_ids) for x in chunk) + len(c.token_ids) > 2048:
            chunks.append(chunk)
            chunk = []
        chunk.append(c)
    return chunks + [chunk] if chunk else chunks


def child(args) -> None:
    import shutil

    import torch

    global PARAMS
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        PARAMS = Path(tmp) / "params.yaml"  # a copy: edits to params.yaml while the bench runs do not matter
        shutil.copy(REPO / "params.yaml", PARAMS)
        arm = {"rl": rl_arm, "rctp": rctp_arm, "margin": margin_arm}[args.kind]
        out = arm(args, args.arm == "shared", Path(tmp))
    out["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print("RESULT " + json.dumps(out), flush=True)


def run_arm(args, kind: str, arm: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--kind", kind, "--arm", arm, "--model", args.model,
           "--steps", str(args.steps), "--threads", str(args.threads), "--pairs", args.pairs or "",
           "--margin", str(args.margin), "--rl-plain", args.rl_plain, "--margin-plain", args.margin_plain]
    if args.adapter:
        cmd += ["--adapter", args.adapter]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MLFLOW_TRACKING_URI": "file:///tmp/bench-mlruns"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"{kind} {arm} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--pairs", default="", help="RCTP rows (label_rewards@rctp output); empty: RL only")
    ap.add_argument("--margin", type=int, default=0, help="held-out entries of the margin arm; 0: no margin arm")
    ap.add_argument("--kinds", default="rl,rctp,margin", help="which of rl, rctp, margin to run")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rl-plain", default="padded", choices=["padded", "before"],
                    help="the RL plain arm: padded = the padded forward only; before = also the rollouts before the "
                    "merged float32 copy and narrowing (live PEFT model, every row to the last step)")
    ap.add_argument("--margin-plain", default="padded", choices=["padded", "before"],
                    help="the margin's plain arm: padded = the padded forward of each chunk; before = the prefix tree "
                    "of chunks of 2,048 tokens counted before sharing (before whole entries per chunk)")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--kind", default="rl")
    ap.add_argument("--arm", default="plain")
    args = ap.parse_args()
    if args.child:
        return child(args)
    kinds = [k for k in args.kinds.split(",") if (k != "rctp" or args.pairs) and (k != "margin" or args.margin)]
    for kind in kinds:
        got: dict[str, list[dict]] = {"plain": [], "shared": []}
        for rep in range(args.reps):
            for arm in (("plain", "shared") if rep % 2 == 0 else ("shared", "plain")):
                res = run_arm(args, kind, arm)
                got[arm].append(res)
                print(f"{kind} rep {rep} {arm}: " + ", ".join(
                    f"{k} {statistics.median(v):.2f}" for k, v in res.items()
                    if isinstance(v, list) and v and k != "logprobs")
                      + f", peak RSS {res['rss_gib']:.2f} GiB", flush=True)
        if kind == "margin":
            a, b = got["plain"][0]["logprobs"], got["shared"][0]["logprobs"]
            print(f"margin: {len(a)} sequences, max |log-prob difference| {max(abs(x - y) for x, y in zip(a, b)):.2e}")
        keys = [k for k, v in got["plain"][0].items() if isinstance(v, list) and k not in ("tokens", "logprobs")]
        for k in keys:
            a = statistics.median([x for r in got["plain"] for x in r[k]])
            b = statistics.median([x for r in got["shared"] for x in r[k]])
            print(f"{kind} {k}: plain {a:.2f} s, shared {b:.2f} s, ratio {a / b:.2f}x")
        rss = [max(r["rss_gib"] for r in got[arm]) for arm in ("plain", "shared")]
        print(f"{kind} peak RSS: plain {rss[0]:.2f} GiB, shared {rss[1]:.2f} GiB")


if __name__ == "__main__":
    main()
