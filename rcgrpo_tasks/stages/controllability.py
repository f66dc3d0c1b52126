"""controllability stage: does a reward-conditioned (RCTP) model follow its reward goal, as RL will sample it?

The premise of RC-GRPO is that the RCTP model's behaviour depends on the reward token: conditioned on
`<|high_reward|>` it should succeed more often than on `<|low_reward|>`, so that RL groups that mix tokens
have reward variance. This stage measures it on held-out entries, in one run, two ways:
- `sampled` (what RL sees): `samples_per_token` rollouts per (entry, token) at the RL sampling settings
  (`rl.temperature`, `rl.top_p`), tokens = the highest and the lowest of `label_rewards.tokens`;
- `greedy` (beside it): one rollout per (entry, token) at T = 0, plus how many entries decode to the same
  assistant messages under both tokens (the token then changes nothing);
- `guided` (when `guidance` > 0; beyond the paper): the sampled arm with reward-token guidance of scale w,
  same seeds: does decoding-time guidance widen the gap the fine-tune left?
Per arm: success rate (paper reward R) per token, the gap E[R|high] - E[R|low] and the same for partial
credit (the shared scorer's per-turn credit; under the paper protocol, whose merged turn has no turn
boundaries, it is ~0 for model rollouts), each with a 95 % paired percentile-bootstrap CI over entries
(`ops.stats.paired_bootstrap_ci`: per-entry means, entries resampled).
Zero-variance mechanism: from each entry's sampled success rates p_h, p_l, the probability that a
G-sized group (G = `rl.num_generations`) has all rewards equal (no GRPO signal):
- all-high tokens (GRPO from RCTP): p_h^G + (1 - p_h)^G;
- mixed i.i.d. tokens, P(high) = q = `rl.p_high` (RC-GRPO): sum_k C(G,k) q^k (1-q)^(G-k)
  [p_h^k p_l^(G-k) + (1-p_h)^k (1-p_l)^(G-k)] (k = rollouts drawn high), which the binomial theorem
  collapses to m^G + (1 - m)^G with m = q p_h + (1 - q) p_l;
averaged over entries, with a paired bootstrap CI of mixed - all-high. Plug-in estimate: with few samples
per token the rates are often 0 or 1 and both shares are biased toward 1.

Reads: `--model-dir` + `--adapter-dir` (an sft-stage output, loaded by `HFBackend` as evaluate does),
`--entries` and `--split` (prepare_data; the `test` side), params `controllability`, `prompt`,
`label_rewards.tokens` and `rl.temperature` / `rl.top_p` / `rl.num_generations` / `rl.p_high`.
Writes: `--metrics` (JSON, also to MLflow), `--trajectories` (JSONL of both arms, optional).
Run: `rcgrpo controllability --model-dir models/base --adapter-dir models/sft/rctp --entries
data/entries.jsonl --split data/split.json --metrics metrics/controllability.json`.
Departure from the paper: the paper reports the gap as motivation on its own model and data; the
embedded default rolls a handful of entries on CPU (~15 tokens/s), so its CIs are wide.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import typer

from rcgrpo_tasks.engine.backend import SamplingParams, reward_pair_ids
from rcgrpo_tasks.engine.compute import load_compute
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.rollout import run_rollouts
from rcgrpo_tasks.engine.trajectory import write_trajectories
from rcgrpo_tasks.env.bfcl import numeric_id
from rcgrpo_tasks.env.entries import split_entries
from rcgrpo_tasks.env.protocols import PromptConfig, reward_tokens
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import ConfigError, as_dict, from_dict, load_config, read_params
from rcgrpo_tasks.ops.io import InputError, atomic_outputs, write_json
from rcgrpo_tasks.ops.stats import mean, paired_bootstrap_ci


@dataclass(frozen=True)
class ControllabilityConfig:
    n_entries: int = 4
    """Held-out entries rolled (the first n of `categories` in the test split, by id order)."""
    categories: tuple[str, ...] = ("base",)
    """BFCL categories drawn from."""
    samples_per_token: int = 2
    """Sampled arm: rollouts per (entry, token) at the RL temperature."""
    greedy: bool = True
    """Also roll one greedy rollout per (entry, token) beside the sampled arm."""
    max_outputs: int = 4
    """Model outputs per episode (paper) / per turn (official)."""
    max_new_tokens: int = 48
    """Tokens per model output."""
    batch_rows: int = 8
    """Rollouts decoded together."""
    dtype: Literal["float32", "bfloat16", "auto"] = "auto"
    """Weights dtype for generation; auto = bf16 where the CPU has native bf16."""
    seed: int = 0
    """Sampling and bootstrap seed."""
    n_bootstrap: int = 2000
    """Bootstrap resamples of every CI."""
    guidance: float = 0.0
    """> 0: a third arm, `guided`: the sampled arm again with reward-token guidance of this scale
    (`SamplingParams.guidance`; each token pushed further toward its own goal), same seeds, so its gap
    sits beside the unguided one. 0 = no guided arm."""

    def __post_init__(self) -> None:
        if self.guidance < 0:
            raise ValueError("guidance must be >= 0")
        if self.n_entries < 1 or self.samples_per_token < 1 or self.max_outputs < 1 or self.max_new_tokens < 1:
            raise ValueError("n_entries, samples_per_token, max_outputs and max_new_tokens must be >= 1")
        if self.batch_rows < 2 or self.n_bootstrap < 10:
            raise ValueError("batch_rows must be >= 2 and n_bootstrap >= 10")


@dataclass(frozen=True)
class RLSampling:
    """The `rl` settings the check mirrors (params `rl`: every key required, so nothing drifts silently)."""

    temperature: float
    top_p: float
    num_generations: int
    p_high: float

    def __post_init__(self) -> None:
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError("need temperature > 0 and 0 < top_p <= 1")
        if self.num_generations < 2 or not 0 < self.p_high < 1:
            raise ValueError("need num_generations >= 2 and 0 < p_high < 1")


def rl_sampling(params: dict, where: str) -> RLSampling:
    """`rl.temperature`, `rl.top_p`, `rl.num_generations`, `rl.p_high` of a params mapping."""
    section = params.get("rl") or {}
    names = ("temperature", "top_p", "num_generations", "p_high")
    missing = [n for n in names if n not in section]
    if missing:
        raise ConfigError(f"{where}:rl: missing {missing} (controllability samples as RL does)")
    return from_dict(RLSampling, {n: section[n] for n in names}, f"{where}:rl")


def held_out_entries(entries_path: Path, split_path: Path, cfg: ControllabilityConfig) -> list:
    """The first `n_entries` test entries of `cfg.categories` (category order, then numeric id)."""
    test = split_entries(entries_path, split_path, "test", cfg.categories)
    picked = sorted(test, key=lambda e: (cfg.categories.index(e.category), numeric_id(e.id)))
    if not picked:
        raise InputError(f"{split_path}: no test entries in categories {list(cfg.categories)}")
    return picked[: cfg.n_entries]


# ----------------------------------------------------------------------------------------------------
# Statistics (pure)


def per_entry(scores: list[dict], high: str, low: str, key: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """(all high values, all low values, per-entry mean high, per-entry mean low); the per-entry lists hold
    only entries rolled under both tokens, in first-seen order."""
    by_entry: dict[str, dict[str, list[float]]] = {}
    for s in scores:
        by_entry.setdefault(s["entry_id"], {}).setdefault(s["reward_token"], []).append(float(s[key]))
    highs = [v for per in by_entry.values() for v in per.get(high, [])]
    lows = [v for per in by_entry.values() for v in per.get(low, [])]
    paired = [(sum(p[high]) / len(p[high]), sum(p[low]) / len(p[low])) for p in by_entry.values()
              if p.get(high) and p.get(low)]
    return highs, lows, [h for h, _ in paired], [w for _, w in paired]


def gap_stats(scores: list[dict], high: str, low: str, key: str, n_boot: int = 2000, seed: int = 0) -> dict:
    """Mean of `key` per token, the paired gap over entries with its standard error and 95 % bootstrap CI."""
    highs, lows, eh, el = per_entry(scores, high, low, key)
    gap, lo, hi = paired_bootstrap_ci(eh, el, n_boot=n_boot, seed=seed)
    diffs = [h - w for h, w in zip(eh, el)]
    se = (math.sqrt(sum((d - gap) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
          if len(diffs) > 1 else float("nan"))
    return {"high": mean(highs), "low": mean(lows), "gap": gap, "gap_se": se, "gap_ci": [lo, hi]}


def zero_variance_share(p_h: float, p_l: float, g: int, q: float) -> tuple[float, float]:
    """(all-high, mixed): P(all G rewards of a group are equal) for one entry with success rates p_h under
    the high token and p_l under the low one; mixed = each rollout's token i.i.d. high with P = q."""
    all_high = p_h ** g + (1 - p_h) ** g
    mixed = sum(math.comb(g, k) * q ** k * (1 - q) ** (g - k)
                * (p_h ** k * p_l ** (g - k) + (1 - p_h) ** k * (1 - p_l) ** (g - k)) for k in range(g + 1))
    return all_high, mixed


def zero_variance_stats(rates_high: list[float], rates_low: list[float], g: int, q: float, n_boot: int = 2000,
                        seed: int = 0) -> dict:
    """Mean zero-variance share over entries under all-high vs mixed tokens and the paired CI of the change."""
    shares = [zero_variance_share(h, w, g, q) for h, w in zip(rates_high, rates_low)]
    all_high, mixed = [a for a, _ in shares], [m for _, m in shares]
    diff, lo, hi = paired_bootstrap_ci(mixed, all_high, n_boot=n_boot, seed=seed)
    return {"G": g, "p_high": q, "n_entries": len(shares), "all_high": mean(all_high), "mixed": mean(mixed),
            "mixed_minus_all_high": diff, "mixed_minus_all_high_ci": [lo, hi]}


def identical_outputs(trajs: list, high: str, low: str) -> int:
    """Entries whose assistant messages are the same under both tokens (greedy: the token changed nothing)."""
    said: dict[str, dict[str, list[str]]] = {}
    for t in trajs:
        said.setdefault(t.entry_id, {})[t.reward_token] = [m["content"] for m in t.messages if m["role"] == "assistant"]
    return sum(1 for per in said.values() if high in per and low in per and per[high] == per[low])


# ----------------------------------------------------------------------------------------------------
# Rolling


def load_policy(model_dir: Path, adapter_dir: Path | None, dtype: str, tokens: tuple[str, ...], device: str = "auto"):
    """HF backend over the trained model on `device`, loaded exactly as `evaluate` loads it (`HFBackend`:
    adapter merged in float32, then cast to `dtype`), so the gap is measured on the model evaluate@rctp scores."""
    backend = HFBackend(model_dir, adapter_dir, dtype=dtype, device=device)
    for t in tokens:
        if len(backend.tokenizer(t, add_special_tokens=False)["input_ids"]) != 1:
            raise InputError(f"{adapter_dir or model_dir}: {t} is not a single token; use an sft-stage output")
    return backend


def arm(cfg: ControllabilityConfig, backend, entries: list, proto, sampling: SamplingParams, k: int,
        tokens: tuple[str, str], provenance: dict) -> tuple[dict, list]:
    """(stats, trajectories) of k rollouts per (entry, token): high first, then low, per entry."""
    high, low = tokens
    trajs = run_rollouts(backend, entries, 2 * k, proto, sampling, lambda e, i: high if i < k else low,
                         batch_rows=cfg.batch_rows, provenance=provenance)
    scores = [{"entry_id": t.entry_id, "reward_token": t.reward_token, **t.score} for t in trajs]
    reward = gap_stats(scores, high, low, "paper_reward", cfg.n_bootstrap, cfg.seed)
    partial = gap_stats(scores, high, low, "partial_credit", cfg.n_bootstrap, cfg.seed)
    stats = {"temperature": sampling.temperature, "top_p": sampling.top_p, "samples_per_token": k,
             "success_rate_high": reward["high"], "success_rate_low": reward["low"], "gap": reward["gap"],
             "gap_se": reward["gap_se"], "gap_ci": reward["gap_ci"],
             "partial_credit_high": partial["high"], "partial_credit_low": partial["low"],
             "partial_credit_gap": partial["gap"], "partial_credit_gap_ci": partial["gap_ci"],
             "model_tokens_high": mean([t.n_model_tokens for t in trajs if t.reward_token == high]),
             "model_tokens_low": mean([t.n_model_tokens for t in trajs if t.reward_token == low])}
    return stats, trajs


def measure(cfg: ControllabilityConfig, prompt: PromptConfig, tokens: tuple[str, ...], backend, entries: list,
            rl: RLSampling, provenance: dict | None = None) -> tuple[dict, list]:
    """(metrics, trajectories): the sampled arm at the RL settings, the greedy arm, the zero-variance shares."""
    high, low = tokens[-1], tokens[0]
    proto = prompt.protocol_config(cfg.max_outputs)
    prov = {"source": "controllability", **(provenance or {})}
    t0 = time.perf_counter()
    metrics: dict = {"n_entries": len(entries), "high_token": high, "low_token": low, "entries": [e.id for e in entries]}
    trajs: list = []
    if cfg.greedy:
        greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
        metrics["greedy"], g_trajs = arm(cfg, backend, entries, proto, greedy, 1, (high, low), {**prov, "arm": "greedy"})
        metrics["greedy"]["identical_outputs"] = identical_outputs(g_trajs, high, low)
        trajs += g_trajs
    sampling = SamplingParams(temperature=rl.temperature, top_p=rl.top_p, max_new_tokens=cfg.max_new_tokens,
                              seed=cfg.seed)
    metrics["sampled"], s_trajs = arm(cfg, backend, entries, proto, sampling, cfg.samples_per_token, (high, low),
                                      {**prov, "arm": "sampled"})
    trajs += s_trajs
    if cfg.guidance:
        guided = dataclasses.replace(sampling, guidance=cfg.guidance,
                                     guidance_pair=reward_pair_ids(backend.tokenizer, (high, low)))
        metrics["guided"], g_trajs = arm(cfg, backend, entries, proto, guided, cfg.samples_per_token, (high, low),
                                         {**prov, "arm": "guided", "guidance": cfg.guidance})
        metrics["guided"]["guidance"] = cfg.guidance
        trajs += g_trajs
    scores = [{"entry_id": t.entry_id, "reward_token": t.reward_token, **t.score} for t in s_trajs]
    _, _, rates_high, rates_low = per_entry(scores, high, low, "paper_reward")
    metrics["zero_variance"] = zero_variance_stats(rates_high, rates_low, rl.num_generations, rl.p_high,
                                                   cfg.n_bootstrap, cfg.seed)
    metrics["rollout_s"] = round(time.perf_counter() - t0, 2)
    return metrics, trajs


def _numbers(record: dict) -> dict:
    flat = tracking.flatten(record)
    return {k: v for k, v in flat.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)}


def _ci(stats: dict, key: str) -> str:
    lo, hi = stats[f"{key}_ci"]
    return f"{stats[key]:+.3f} [{lo:+.3f}, {hi:+.3f}]"


app = typer.Typer(add_completion=False)


@app.command()
def main(
    model_dir: Path = typer.Option(Path("models/base"), help="Base model folder (prepare_model)."),
    adapter_dir: Path = typer.Option(None, help="sft-stage output (e.g. models/sft/rctp)."),
    entries: Path = typer.Option(Path("data/entries.jsonl"), help="Entries JSONL (prepare_data)."),
    split: Path = typer.Option(Path("data/split.json"), help="Split JSON (prepare_data); the test side is used."),
    metrics: Path = typer.Option(Path("metrics/controllability.json"), help="Output: metrics JSON."),
    trajectories: Path = typer.Option(None, help="Output: the rollouts of both arms as trajectory JSONL."),
    params: Path = typer.Option(Path("params.yaml"), help="Params (sections `controllability`, `label_rewards`, `rl`)."),
) -> None:
    """Sampled (RL settings) and greedy E[R|high] - E[R|low] of a reward-conditioned model, with CIs."""
    with cli_errors(FileNotFoundError):
        cfg = load_config(ControllabilityConfig, params, "controllability")
        prompt = load_config(PromptConfig, params, "prompt")
        raw = read_params(params)
        tokens = reward_tokens(raw)
        rl = rl_sampling(raw, str(params))
        picked = held_out_entries(entries, split, cfg)
        backend = load_policy(model_dir, adapter_dir, cfg.dtype, (tokens[-1], tokens[0]),
                              load_compute(params).device)  # before any MLflow run
    typer.echo(f"controllability: decoding on {backend.describe().get('device')}")
    with tracking.stage_run("controllability", {"controllability": as_dict(cfg), "prompt": as_dict(prompt),
                                                "rl": as_dict(rl), "adapter": str(adapter_dir), "tokens": list(tokens)}):
        result, trajs = measure(cfg, prompt, tokens, backend, picked, rl,
                                {"model": str(model_dir), "adapter": str(adapter_dir)})
        with atomic_outputs() as staged:
            write_json(staged.file(metrics), result)
            if trajectories:
                write_trajectories(staged.file(trajectories), trajs)
        tracking.log_metrics(_numbers(result))
        tracking.log_dict(result, "controllability.json")
    s, z = result["sampled"], result["zero_variance"]
    greedy = f"; greedy gap {_ci(result['greedy'], 'gap')}" if "greedy" in result else ""
    greedy += f"; guided (w={cfg.guidance}) gap {_ci(result['guided'], 'gap')}" if "guided" in result else ""
    typer.echo(f"controllability over {result['n_entries']} entries: sampled (T={s['temperature']}, "
               f"{s['samples_per_token']}/token) R|high {s['success_rate_high']:.3f} R|low {s['success_rate_low']:.3f} "
               f"gap {_ci(s, 'gap')}{greedy}; zero-variance share (G={z['G']}) all-high {z['all_high']:.3f} "
               f"mixed {z['mixed']:.3f}; {result['rollout_s']} s")


if __name__ == "__main__":
    app()
