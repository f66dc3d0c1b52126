"""controllability stage: does a reward-conditioned (RCTP) model follow its reward goal?

The premise of RC-GRPO is that the RCTP model's behaviour depends on the reward token: conditioned on
`<|high_reward|>` it should succeed more often than on `<|low_reward|>`, so that RL groups that mix tokens
have reward variance. This stage measures it on held-out entries: every entry is rolled out
`samples_per_token` times conditioned on the highest and on the lowest reward token (`label_rewards.tokens`,
lowest first), in one engine group per entry (the shared prompt prefix is prefilled once), and scored by the
shared scorer. Reports success rate (paper reward R) per token, E[R|high] - E[R|low] with a paired
standard error over entries, and the same for partial credit.

Reads: `--model-dir` + `--adapter-dir` (an sft-stage output, loaded by `HFBackend` as evaluate does), `--entries`
and `--split` (prepare_data; the `test` side), `params.yaml:controllability` and `label_rewards.tokens`.
Writes: `--metrics` (JSON, also to MLflow), `--trajectories` (JSONL, optional).
Run: `rcgrpo controllability --model-dir models/base --adapter-dir models/sft/rctp --entries
data/entries.jsonl --split data/split.json --metrics metrics/controllability.json`.
Departure from the paper: the paper reports this gap as motivation on its own model and data; the
embedded default rolls a handful of entries greedily (CPU decoding ~15 tokens/s), so the gap is noisy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import typer

from rcgrpo_tasks.config import ConfigError, as_dict, load_config, read_params
from rcgrpo_tasks.io import InputError, write_json


@dataclass(frozen=True)
class ControllabilityConfig:
    n_entries: int = 4
    """Held-out entries rolled (the first n of `categories` in the test split, by id order)."""
    categories: tuple[str, ...] = ("base",)
    """BFCL categories drawn from."""
    samples_per_token: int = 1
    """Rollouts per (entry, token); 1 is enough when greedy."""
    protocol: Literal["official", "paper"] = "paper"
    """Prompting protocol (as RL and evaluate use)."""
    doc_style: Literal["compact", "json", "official"] = "compact"
    """Function docs rendering."""
    system_prompt: Literal["bfcl", "short"] = "bfcl"
    """System prompt style."""
    max_steps: int = 4
    """Model outputs per episode (paper) / per turn (official)."""
    temperature: float = 0.0
    """0 = greedy: the token is then the only difference between the two rollouts of an entry."""
    top_p: float = 1.0
    """Nucleus sampling (temperature > 0)."""
    max_new_tokens: int = 48
    """Tokens per model output."""
    batch_rows: int = 8
    """Rollouts decoded together."""
    dtype: Literal["float32", "bfloat16", "auto"] = "auto"
    """Weights dtype for generation; auto = bf16 where the CPU has native bf16."""
    seed: int = 0
    """Sampling seed (temperature > 0)."""

    def __post_init__(self) -> None:
        if self.n_entries < 1 or self.samples_per_token < 1 or self.max_steps < 1 or self.max_new_tokens < 1:
            raise ValueError("n_entries, samples_per_token, max_steps and max_new_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.batch_rows < 2:
            raise ValueError("temperature must be >= 0, top_p in (0, 1], batch_rows >= 2")


def held_out_entries(entries_path: Path, split_path: Path, cfg: ControllabilityConfig) -> list:
    from rcgrpo_tasks.bfcl import Entry, numeric_id
    from rcgrpo_tasks.io import read_jsonl
    from rcgrpo_tasks.prepare_data import load_split

    test = set(load_split(split_path)["test"])
    rows = [Entry.from_json(r) for r in read_jsonl(entries_path)]
    picked = sorted((e for e in rows if e.id in test and e.category in cfg.categories),
                    key=lambda e: (cfg.categories.index(e.category), numeric_id(e.id)))
    if not picked:
        raise InputError(f"{split_path}: no test entries in categories {list(cfg.categories)}")
    return picked[: cfg.n_entries]


def gap_stats(scores: list[dict], high: str, low: str, key: str) -> dict:
    """Mean of `key` per token and the paired gap over entries (mean, standard error)."""
    by_entry: dict[str, dict[str, list[float]]] = {}
    for s in scores:
        by_entry.setdefault(s["entry_id"], {}).setdefault(s["reward_token"], []).append(float(s[key]))
    diffs, highs, lows = [], [], []
    for per in by_entry.values():
        h, l = per.get(high, []), per.get(low, [])
        highs += h
        lows += l
        if h and l:
            diffs.append(sum(h) / len(h) - sum(l) / len(l))
    mean = sum(diffs) / len(diffs) if diffs else float("nan")
    se = (math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
          if len(diffs) > 1 else float("nan"))
    return {"high": sum(highs) / len(highs) if highs else float("nan"),
            "low": sum(lows) / len(lows) if lows else float("nan"), "gap": mean, "gap_se": se}


def load_policy(model_dir: Path, adapter_dir: Path | None, dtype: str, tokens: tuple[str, ...]):
    """HF backend over the trained model, loaded exactly as `evaluate` loads it (`HFBackend`: adapter merged
    in float32, then cast to `dtype`), so the gap is measured on the model that evaluate@rctp scores."""
    from rcgrpo_tasks.backends import HFBackend

    backend = HFBackend(model_dir, adapter_dir, dtype=dtype)
    for t in tokens:
        if len(backend.tokenizer(t, add_special_tokens=False)["input_ids"]) != 1:
            raise InputError(f"{adapter_dir or model_dir}: {t} is not a single token; use an sft-stage output")
    return backend


def measure(cfg: ControllabilityConfig, tokens: tuple[str, ...], backend, entries: list,
            provenance: dict | None = None) -> tuple[dict, list]:
    """(metrics, trajectories) of rolling every entry conditioned on the highest and the lowest token."""
    from rcgrpo_tasks.backends import SamplingParams
    from rcgrpo_tasks.engine import run_rollouts
    from rcgrpo_tasks.protocols import ProtocolConfig

    high, low = tokens[-1], tokens[0]
    steps = {"max_steps": cfg.max_steps} if cfg.protocol == "paper" else {"max_steps_per_turn": cfg.max_steps}
    proto = ProtocolConfig(protocol=cfg.protocol, doc_style=cfg.doc_style, system_prompt=cfg.system_prompt, **steps)
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                              seed=cfg.seed)
    k = cfg.samples_per_token
    t0 = time.perf_counter()
    trajs = run_rollouts(backend, entries, 2 * k, proto, sampling, lambda e, i: high if i < k else low,
                         batch_rows=cfg.batch_rows, provenance={"source": "controllability", **(provenance or {})})
    scores = [{"entry_id": t.entry_id, "reward_token": t.reward_token, **t.score} for t in trajs]
    reward = gap_stats(scores, high, low, "paper_reward")
    partial = gap_stats(scores, high, low, "partial_credit")
    metrics = {"n_entries": len(entries), "samples_per_token": k, "high_token": high, "low_token": low,
               "success_rate_high": reward["high"], "success_rate_low": reward["low"],
               "gap": reward["gap"], "gap_se": reward["gap_se"],
               "partial_credit_high": partial["high"], "partial_credit_low": partial["low"],
               "partial_credit_gap": partial["gap"], "partial_credit_gap_se": partial["gap_se"],
               "model_tokens_high": _mean(t.n_model_tokens for t in trajs if t.reward_token == high),
               "model_tokens_low": _mean(t.n_model_tokens for t in trajs if t.reward_token == low),
               "rollout_s": round(time.perf_counter() - t0, 2), "entries": [e.id for e in entries]}
    return metrics, trajs


def _mean(values) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else float("nan")


app = typer.Typer(add_completion=False)


@app.command()
def main(
    model_dir: Path = typer.Option(Path("models/base"), help="Base model folder (prepare_model)."),
    adapter_dir: Path = typer.Option(None, help="sft-stage output (e.g. models/sft/rctp)."),
    entries: Path = typer.Option(Path("data/entries.jsonl"), help="Entries JSONL (prepare_data)."),
    split: Path = typer.Option(Path("data/split.json"), help="Split JSON (prepare_data); the test side is used."),
    metrics: Path = typer.Option(Path("metrics/controllability.json"), help="Output: metrics JSON."),
    trajectories: Path = typer.Option(None, help="Output: the rollouts as trajectory JSONL."),
    params: Path = typer.Option(Path("params.yaml"), help="Params (sections `controllability`, `label_rewards`)."),
) -> None:
    """E[R|high] - E[R|low] of a reward-conditioned model on held-out entries."""
    try:
        cfg = load_config(ControllabilityConfig, params, "controllability")
        tokens = tuple((read_params(params).get("label_rewards") or {}).get("tokens")
                       or ("<|low_reward|>", "<|high_reward|>"))
        picked = held_out_entries(entries, split, cfg)
        backend = load_policy(model_dir, adapter_dir, cfg.dtype, (tokens[-1], tokens[0]))  # before any MLflow run
    except (ConfigError, InputError, FileNotFoundError, ValueError) as exc:  # ModelLoadError is a ValueError
        typer.echo(f"controllability: {exc}", err=True)
        raise typer.Exit(2) from exc
    from rcgrpo_tasks import tracking
    from rcgrpo_tasks.trajectory import write_trajectories

    with tracking.stage_run("controllability", {"controllability": as_dict(cfg), "adapter": str(adapter_dir),
                                                "tokens": list(tokens)}):
        result, trajs = measure(cfg, tokens, backend, picked, {"model": str(model_dir), "adapter": str(adapter_dir)})
        write_json(metrics, result)
        if trajectories:
            write_trajectories(trajectories, trajs)
        tracking.log_metrics({k: v for k, v in result.items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)})
        tracking.log_dict(result, "controllability.json")
    typer.echo(f"controllability: R|high {result['success_rate_high']:.3f}  R|low {result['success_rate_low']:.3f}  "
               f"gap {result['gap']:+.3f} (se {result['gap_se']:.3f}) over {result['n_entries']} entries "
               f"in {result['rollout_s']} s")


if __name__ == "__main__":
    app()
