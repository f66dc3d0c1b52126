"""generate_trajectories stage: the mixed-quality trajectory set RCTP fine-tuning learns from.

Reads `--entries` (`data/entries.jsonl`, `Entry.to_json` rows), `--split` (`data/split.json`; only the
`train` ids are used), `--model-dir` (`models/base`: its tokenizer renders every trajectory; its weights
are the default policy) and `params.yaml:generate_trajectories`. Writes `--out` (trajectory JSONL, one
`rcgrpo_tasks.trajectory.Trajectory.to_json()` row each) and `--metrics` (counts, balance, acceptance
rates, timings), both atomically.

Three sources (`provenance.source` / `provenance.kind`):
- `expert` / `expert`: each entry's ground-truth calls replayed through the rollout engine
  (`engine.replay_calls`), so the chat is exactly what a policy sees and the observations are the REAL
  environment outputs. Departure from the paper, whose expert observations were `{"status":"success"}`.
  An expert replay that does not score 1 is dropped and counted (`experts_dropped`), never kept.
- `policy` / `policy`: rollouts sampled from a model (`policy_model`, default `--model-dir`, optional
  LoRA `policy_adapter`) with the configured temperature / top-p / max_new_tokens, `policy_samples` per
  entry on `policy_entries` entries (`engine.run_group`).
- `near_miss` / `<kind>`: gold scripts perturbed (`rcgrpo_tasks.perturb`: wrong argument value, wrong
  function, dropped call, extra call, stopping early, wrong turn), re-executed and re-scored. A candidate
  is kept only if the replayed trajectory really scores 0 under the configured reward; harmless
  perturbations (an extra `ls`) are rejected, and the acceptance rate per kind goes to the metrics.
  Without them a 135M model's own samples (mostly prose) would teach only "low reward = prose".

Every row's `provenance` holds: source, kind, generator, model/adapter/sampling (policy), the
perturbation detail, `reward_fn` and `reward` (the configured reward: `paper_reward` by default, or the
official verdict), and for scripted rows `script_score`, the scorer run on the per-turn script (the paper
protocol merges all turns into one, so its own `score.valid` is always the official checker's
`force_terminated`; `script_score.valid` is what the official scorer says about the same calls made turn
by turn). `score` holds the engine's scorer output (official verdict, paper reward, partial credit).

Balance: successes = experts (+ policy successes); failures are drawn to `success_fraction` (paper 1:1 =
0.5) with the `failure_mix` shares per source; a source that runs short hands its quota to the others;
if all fall short the successes are subsampled so the ratio holds. Everything is seeded: the same params
and inputs give the same rows (only `wall_time_s` differs).

Run: `rcgrpo generate-trajectories --params params.yaml --entries data/entries.jsonl --split
data/split.json --model-dir models/base --out data/trajectories.jsonl --metrics metrics/generate_trajectories.json`
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import typer

from rcgrpo_tasks.bfcl import Entry
from rcgrpo_tasks.config import ConfigError, as_dict, load_config
from rcgrpo_tasks.io import InputError, read_jsonl, write_json, write_jsonl
from rcgrpo_tasks.perturb import PERTURBATIONS, Script, perturb

SOURCES: tuple[str, ...] = ("expert", "policy", "near_miss")
KINDS: tuple[str, ...] = ("expert", "policy", *PERTURBATIONS)
FAILURE_SOURCES: tuple[str, ...] = ("policy", *PERTURBATIONS)
REWARD_FNS: tuple[str, ...] = ("paper_reward", "official")


def _default_mix() -> dict[str, float]:
    return {"policy": 0.1, **{k: 0.15 for k in PERTURBATIONS}}


@dataclass(frozen=True)
class GenerateConfig:
    protocol: Literal["paper", "official"] = "paper"
    """Rollout protocol of every trajectory: `paper` (merged steps + done(), what RL and evaluate use) or `official`."""
    doc_style: Literal["compact", "json", "official"] = "compact"
    """Function docs in the system prompt (compact fits the 8k-context SmolLM2)."""
    system_prompt: Literal["bfcl", "short"] = "bfcl"
    """System prompt variant (`rcgrpo_tasks.protocols.ProtocolConfig.system_prompt`)."""
    max_steps: int = 20
    """paper protocol: model outputs per episode before `step_limit`."""
    reward: Literal["paper_reward", "official"] = "paper_reward"
    """Which score defines success (R=1): the paper's binary reward or the official BFCL verdict."""
    success_fraction: float = 0.5
    """Successes / all rows. The paper's 1:1 mix is 0.5."""
    failure_mix: dict = field(default_factory=_default_mix)
    """Share of failures per source: `policy` and each perturbation kind; normalised to sum 1."""
    max_tokens: int | None = None
    """Longest trajectory kept, in tokens; null = the model's context (max_position_embeddings) minus 32,
    the room label_rewards' reward goal needs. Longer replays (long_context tool outputs) are cut by the
    engine (`context_limit`) and left out, counted in the metrics."""
    max_entries: int | None = None
    """Use at most this many train entries (seeded sample); null = the whole train split."""
    near_miss_attempts: int = 8
    """Perturbation draws per (entry, kind) before giving up on that pair (harmless ones are rejected)."""
    policy_model: str | None = None
    """Model folder of the policy; null = `--model-dir` (the base model)."""
    policy_adapter: str | None = None
    """Optional PEFT adapter folder on top of the policy model."""
    policy_backend: Literal["hf", "vllm"] = "hf"
    """Inference backend of the policy (`vllm` on GPU hosts only)."""
    policy_dtype: Literal["float32", "bfloat16", "auto"] = "auto"
    """hf backend weights dtype; `auto` = bf16 where the CPU supports it (prefill ~2x faster than fp32)."""
    policy_reward_token: str | None = None
    """Reward token to condition the policy on (for an RCTP policy); null = no reward goal."""
    policy_entries: int = 4
    """Train entries the policy is sampled on (seeded sample); 0 disables policy samples."""
    policy_samples: int = 2
    """Samples per policy entry (one shared-prefix group)."""
    temperature: float = 1.0
    """Policy sampling temperature."""
    top_p: float = 1.0
    """Policy nucleus sampling."""
    max_new_tokens: int = 64
    """Tokens per policy output (one step)."""
    seed: int = 0
    """Seeds every choice: entry samples, perturbations, policy sampling, balancing."""

    def __post_init__(self) -> None:
        if not 0.0 < self.success_fraction < 1.0:
            raise ValueError(f"success_fraction must be in (0, 1), got {self.success_fraction}")
        unknown = sorted(set(self.failure_mix) - set(FAILURE_SOURCES))
        if unknown:
            raise ValueError(f"failure_mix: unknown source(s) {unknown}; allowed: {list(FAILURE_SOURCES)}")
        weights = list(self.failure_mix.values())
        if any(not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0 for w in weights) or not sum(weights):
            raise ValueError("failure_mix: shares must be numbers >= 0 with a positive sum")
        if self.protocol == "paper" and self.reward == "official":
            raise ValueError("reward 'official' needs protocol 'official': the paper protocol merges all turns "
                             "into one, which the official checker always rejects (force_terminated)")
        for name in ("max_steps", "near_miss_attempts", "max_new_tokens", "policy_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.policy_entries < 0 or (self.max_entries is not None and self.max_entries < 1):
            raise ValueError("policy_entries must be >= 0 and max_entries >= 1 (or null)")
        if self.max_tokens is not None and self.max_tokens < 64:
            raise ValueError("max_tokens must be >= 64 or null")
        if not 0.0 < self.top_p <= 1.0 or self.temperature < 0:
            raise ValueError("top_p must be in (0, 1] and temperature >= 0")


GOAL_RESERVE = 32
"""Tokens kept free for the `[Reward Goal: <token>]` suffix (about 12 tokens with SmolLM2's tokenizer)."""


def model_context(model_dir: str | Path) -> int:
    """max_position_embeddings from the model folder's config.json."""
    path = Path(model_dir) / "config.json"
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read the model config ({exc})") from exc
    if not isinstance(value, int):
        raise InputError(f"{path}: no integer max_position_embeddings")
    return value


def reward_of(score: dict | None, reward_fn: str) -> float | None:
    """The configured reward of a scorer output: `paper_reward`, or 1/0 from the official verdict."""
    if score is None:
        return None
    if reward_fn == "official":
        return 1.0 if score.get("valid") else 0.0
    return float(score["paper_reward"])


# ----------------------------------------------------------------------------------------------------
# Inputs


def load_train_entries(entries_path: str | Path, split_path: str | Path) -> tuple[list[Entry], list[str]]:
    """(train entries in file order, test ids); bad rows / ids raise InputError naming file and line."""
    rows = read_jsonl(entries_path)
    by_id: dict[str, Entry] = {}
    for lineno, row in enumerate(rows, 1):
        try:
            entry = Entry.from_json(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{entries_path}: row {lineno}: not an Entry ({type(exc).__name__}: {exc})") from exc
        by_id[entry.id] = entry
    split = read_split(split_path)
    missing = [i for i in split["train"] if i not in by_id]
    if missing:
        raise InputError(f"{split_path}: {len(missing)} train id(s) not in {entries_path}, e.g. {missing[:3]}")
    train = set(split["train"])
    return [e for e in by_id.values() if e.id in train], list(split["test"])


def read_split(split_path: str | Path) -> dict[str, list[str]]:
    path = Path(split_path)
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    try:
        split = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from exc
    for key in ("train", "test"):
        if not isinstance(split, dict) or not isinstance(split.get(key), list):
            raise InputError(f"{path}: expected {{'train': [ids], 'test': [ids]}}, field {key!r} missing")
    overlap = sorted(set(split["train"]) & set(split["test"]))
    if overlap:
        raise InputError(f"{path}: {len(overlap)} id(s) in both train and test, e.g. {overlap[:3]}")
    return split


def _sample(items: list, n: int | None, seed: str) -> list:
    """A seeded subset of `n` items, kept in their original order (None/too many: all)."""
    if n is None or n >= len(items):
        return list(items)
    chosen = set(random.Random(seed).sample(range(len(items)), n))
    return [x for i, x in enumerate(items) if i in chosen]


# ----------------------------------------------------------------------------------------------------
# Scripted trajectories: experts and near-misses


def _script_turns(turns: Script) -> list[list[list[str]]]:
    """A per-turn call script as BFCL result format (one step per non-empty turn)."""
    return [[list(calls)] if calls else [] for calls in turns]


@dataclass
class _Context:
    cfg: GenerateConfig
    protocol_cfg: Any
    tokenizer: Any
    max_tokens: int
    stats: Counter = field(default_factory=Counter)


def _finish(traj, ctx: _Context, tid: str, provenance: dict):
    """Give a trajectory its deterministic id and full provenance."""
    reward = reward_of(traj.score, ctx.cfg.reward)
    prov = {**(traj.provenance or {}), **provenance, "reward_fn": ctx.cfg.reward, "reward": reward,
            "seed": ctx.cfg.seed}
    return dataclasses.replace(traj, trajectory_id=tid, provenance=prov)


def _replay(entry: Entry, turns: Script, ctx: _Context):
    from rcgrpo_tasks.engine import replay_calls

    return replay_calls(entry, ctx.protocol_cfg, [list(t) for t in turns], ctx.tokenizer,
                        max_positions=ctx.max_tokens)


def expert_trajectories(entries: list[Entry], ctx: _Context) -> list:
    """Gold replays scoring 1; the others are counted in `experts_dropped` and left out."""
    from rcgrpo_tasks.scoring import score_entry

    out = []
    for entry in entries:
        traj = _replay(entry, entry.ground_truth, ctx)
        if traj.termination == "context_limit":
            ctx.stats["experts_too_long"] += 1
            continue
        script = score_entry(entry, _script_turns(entry.ground_truth)).to_json()
        traj = _finish(traj, ctx, f"{entry.id}.expert", {
            "source": "expert", "kind": "expert", "generator": "gold_replay", "model": None,
            "adapter": None, "sampling": None, "perturbation": None, "script_score": script})
        if traj.provenance["reward"] == 1.0:
            out.append(traj)
        else:
            ctx.stats["experts_dropped"] += 1
    return out


def near_miss_stream(entries: list[Entry], kind: str, ctx: _Context):
    """Yield verified near-miss failures of one kind: at most one per entry, entries in a seeded order."""
    from rcgrpo_tasks.scoring import score_entry

    order = list(entries)
    random.Random(f"{ctx.cfg.seed}:order:{kind}").shuffle(order)
    for entry in order:
        seen: set[Script] = set()
        for attempt in range(ctx.cfg.near_miss_attempts):
            p = perturb(entry, kind, random.Random(f"{ctx.cfg.seed}:{entry.id}:{kind}:{attempt}"))
            if p is None or p.turns in seen:
                continue
            seen.add(p.turns)
            ctx.stats[f"tried.{kind}"] += 1
            script = score_entry(entry, _script_turns(p.turns)).to_json()
            # Cheap pre-screen on the script (the paper reward ignores turn grouping; the official
            # protocol keeps it), so harmless candidates skip the replay; the replay's score decides below.
            if reward_of(script, ctx.cfg.reward) != 0.0:
                continue
            traj = _replay(entry, p.turns, ctx)
            if traj.termination == "context_limit":
                ctx.stats[f"too_long.{kind}"] += 1
                break  # every perturbation of this entry would be as long: next entry
            traj = _finish(traj, ctx, f"{entry.id}.{kind}.{attempt}", {
                "source": "near_miss", "kind": kind, "generator": "perturbed_gold_replay", "model": None,
                "adapter": None, "sampling": None, "perturbation": p.detail, "script_score": script})
            if traj.provenance["reward"] != 0.0:
                continue
            ctx.stats[f"accepted.{kind}"] += 1
            yield traj
            break


# ----------------------------------------------------------------------------------------------------
# Policy samples


def policy_trajectories(entries: list[Entry], ctx: _Context, model_dir: str | Path) -> list:
    """`policy_samples` rollouts on each of `policy_entries` seeded train entries."""
    cfg = ctx.cfg
    chosen = _sample(entries, cfg.policy_entries, f"{cfg.seed}:policy")
    if not chosen:
        return []
    from rcgrpo_tasks.backends import SamplingParams, load_backend
    from rcgrpo_tasks.engine import run_group

    model = cfg.policy_model or str(model_dir)
    kwargs = {"dtype": cfg.policy_dtype} if cfg.policy_backend == "hf" else {}
    backend = load_backend(cfg.policy_backend, model, cfg.policy_adapter, **kwargs)
    # Cut rollouts where the dataset's length limit is (the model's own context minus the goal reserve).
    backend.max_positions = min(backend.max_positions, ctx.max_tokens)
    out = []
    for j, entry in enumerate(chosen):
        sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                  max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + j)
        group = run_group(backend, entry, cfg.policy_samples, ctx.protocol_cfg, sampling,
                          [cfg.policy_reward_token] * cfg.policy_samples)
        for i, traj in enumerate(group):
            out.append(_finish(traj, ctx, f"{entry.id}.policy.{i}", {
                "source": "policy", "kind": "policy", "generator": "policy", "model": model,
                "adapter": cfg.policy_adapter, "policy_backend": cfg.policy_backend,
                "policy_reward_token": cfg.policy_reward_token, "perturbation": None, "script_score": None}))
    return out


# ----------------------------------------------------------------------------------------------------
# Balancing


def allocate(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Split `total` over `weights` by largest remainder (ties: name order); sums exactly to `total`."""
    norm = sum(weights.values())
    exact = {k: total * w / norm for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    rest = total - sum(out.values())
    for k in sorted(exact, key=lambda k: (-(exact[k] - out[k]), k))[:rest]:
        out[k] += 1
    return out


def draw_failures(n_fail: int, weights: dict[str, float], sources: dict[str, Any]) -> dict[str, list]:
    """Take `n_fail` items from the per-source iterators in `weights` proportions; a source that runs
    dry hands its unfilled quota to the remaining sources (by weight)."""
    iters = {k: iter(sources[k]) for k, w in weights.items() if w > 0}
    taken: dict[str, list] = {k: [] for k in iters}
    dry: set[str] = set()
    need = n_fail
    while need > 0 and len(dry) < len(iters):
        quotas = allocate(need, {k: weights[k] for k in iters if k not in dry})
        for k, q in sorted(quotas.items()):
            for _ in range(q):
                item = next(iters[k], None)
                if item is None:
                    dry.add(k)
                    break
                taken[k].append(item)
                need -= 1
    return taken


def balance(successes: list, cfg: GenerateConfig, sources: dict) -> tuple[list, list]:
    """(successes, failures) at `cfg.success_fraction`; successes are subsampled if failures ran short."""
    f = cfg.success_fraction
    n_fail = round(len(successes) * (1 - f) / f)
    taken = draw_failures(n_fail, {k: float(w) for k, w in cfg.failure_mix.items()}, sources)
    failures = [t for k in sorted(taken) for t in taken[k]]
    if len(failures) < n_fail:
        keep = round(len(failures) * f / (1 - f))
        successes = _sample(successes, keep, f"{cfg.seed}:successes")
    return successes, failures


# ----------------------------------------------------------------------------------------------------
# The stage


def _row_order(entries: list[Entry]):
    index = {e.id: i for i, e in enumerate(entries)}
    kind_rank = {k: i for i, k in enumerate(KINDS)}
    return lambda t: (index[t.entry_id], kind_rank[t.provenance["kind"]], t.trajectory_id)


def generate(cfg: GenerateConfig, entries_path: str | Path, split_path: str | Path,
             model_dir: str | Path) -> tuple[list, dict]:
    """(trajectories, metrics) for the train split; pure apart from reading the inputs."""
    from transformers import AutoTokenizer

    from rcgrpo_tasks.protocols import ProtocolConfig

    t0 = time.perf_counter()
    train, _ = load_train_entries(entries_path, split_path)
    entries = _sample(train, cfg.max_entries, f"{cfg.seed}:entries")
    ctx = _Context(cfg, ProtocolConfig(protocol=cfg.protocol, doc_style=cfg.doc_style, max_steps=cfg.max_steps,
                                       system_prompt=cfg.system_prompt),
                   AutoTokenizer.from_pretrained(model_dir), cfg.max_tokens or model_context(model_dir) - GOAL_RESERVE)
    timings = {}
    experts = expert_trajectories(entries, ctx)
    timings["experts"] = time.perf_counter() - t0
    policy = policy_trajectories(entries, ctx, model_dir)
    timings["policy"] = time.perf_counter() - t0 - sum(timings.values())
    policy_fail = [t for t in policy if t.provenance["reward"] == 0.0]
    random.Random(f"{cfg.seed}:policy_failures").shuffle(policy_fail)
    sources: dict[str, Any] = {"policy": policy_fail}
    sources.update({k: near_miss_stream(entries, k, ctx) for k in PERTURBATIONS})
    successes = experts + [t for t in policy if t.provenance["reward"] == 1.0]
    successes, failures = balance(successes, cfg, sources)
    timings["near_miss"] = time.perf_counter() - t0 - sum(timings.values())
    rows = sorted(successes + failures, key=_row_order(entries))
    metrics = _metrics(rows, policy, ctx, len(train), len(entries))
    metrics["seconds"] = {k: round(v, 2) for k, v in timings.items()} | {"total": round(time.perf_counter() - t0, 2)}
    return rows, metrics


def _metrics(rows: list, policy: list, ctx: _Context, n_train: int, n_used: int) -> dict:
    n_success = sum(1 for t in rows if t.provenance["reward"] == 1.0)
    tokens = [len(t.token_ids) for t in rows] or [0]
    tried = {k: ctx.stats[f"tried.{k}"] for k in PERTURBATIONS}
    return {
        "n_train_entries": n_train, "n_entries_used": n_used, "n_rows": len(rows),
        "n_success": n_success, "n_failure": len(rows) - n_success,
        "success_fraction": round(n_success / len(rows), 4) if rows else 0.0,
        "by_source": dict(sorted(Counter(t.provenance["source"] for t in rows).items())),
        "by_kind": dict(sorted(Counter(t.provenance["kind"] for t in rows).items())),
        "experts_dropped": ctx.stats["experts_dropped"],
        "experts_too_long": ctx.stats["experts_too_long"],
        "max_tokens": ctx.max_tokens,
        "near_miss_tried": tried,
        "near_miss_acceptance": {k: round(ctx.stats[f"accepted.{k}"] / n, 3) if n else None
                                 for k, n in tried.items()},
        "policy": {"n": len(policy), "n_success": sum(1 for t in policy if t.provenance["reward"] == 1.0),
                   "mean_partial_credit": round(sum(t.score["partial_credit"] for t in policy) / len(policy), 4)
                   if policy else None},
        "tokens": {"mean": round(sum(tokens) / len(tokens), 1), "max": max(tokens)},
    }


app = typer.Typer(add_completion=False)


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="params file (section `generate_trajectories`)."),
    entries: Path = typer.Option(Path("data/entries.jsonl"), help="entries JSONL from prepare_data."),
    split: Path = typer.Option(Path("data/split.json"), help="train/test id split from prepare_data."),
    model_dir: Path = typer.Option(Path("models/base"), help="model folder: tokenizer + default policy."),
    out: Path = typer.Option(Path("data/trajectories.jsonl"), help="output trajectory JSONL."),
    metrics: Path = typer.Option(Path("metrics/generate_trajectories.json"), help="output metrics JSON."),
) -> None:
    """Build the mixed-quality trajectory set (expert, policy, near-miss)."""
    try:
        cfg = load_config(GenerateConfig, params, "generate_trajectories")
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    from rcgrpo_tasks import tracking

    with tracking.stage_run("generate_trajectories", as_dict(cfg)):
        try:
            rows, record = generate(cfg, entries, split, model_dir)
        except InputError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        write_jsonl(out, (t.to_json() for t in rows))
        write_json(metrics, record)
        tracking.log_metrics({"n_rows": record["n_rows"], "n_success": record["n_success"],
                              "n_failure": record["n_failure"], "success_fraction": record["success_fraction"],
                              "experts_dropped": record["experts_dropped"], "seconds": record["seconds"]["total"]})
        tracking.log_dict(record, "generate_trajectories_metrics.json")
    typer.echo(f"wrote {out}: {record['n_rows']} trajectories ({record['n_success']} success / "
               f"{record['n_failure']} failure; by kind {record['by_kind']}) in {record['seconds']['total']} s")


if __name__ == "__main__":
    app()
