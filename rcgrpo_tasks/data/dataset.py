"""The mixed-quality trajectory set RCTP fine-tuning learns from: expert replays, policy samples,
near-miss failures, balanced to `success_fraction` (the generate_trajectories stage runs `generate`).

Sources (`provenance.source` / `provenance.kind`) and balance: see the stage's docstring
(`rcgrpo_tasks/stages/generate_trajectories.py`) and docs/data.md. Everything is seeded: the same params and
inputs give the same bytes (wall time lives in the metrics, not in the rows).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rcgrpo_tasks.engine.backend_registry import load_backend
from rcgrpo_tasks.engine.compute import ResolvedCompute
from rcgrpo_tasks.engine.decoding import DecodeConfig
from rcgrpo_tasks.engine.models import model_context
from rcgrpo_tasks.engine.rollout import replay_calls, run_group
from rcgrpo_tasks.engine.trajectory import DATASET_WALL_TIME
from rcgrpo_tasks.env.contract import Entry, Script, Task
from rcgrpo_tasks.env.entries import split_entries
from rcgrpo_tasks.env.prompt import GOAL_RESERVE, PromptConfig
from rcgrpo_tasks.env.rewards import BINARY_REWARDS, Reward, reward_value
from rcgrpo_tasks.env.tasks import ALL_PERTURBATIONS, task_of, task_of_entries
from rcgrpo_tasks.ops.config import ConfigError, flat_field

SOURCES: tuple[str, ...] = ("expert", "policy", "near_miss")
KINDS: tuple[str, ...] = ("expert", "policy", *ALL_PERTURBATIONS, "on_policy")
"""`on_policy`: the SFT model's own samples (`data.onpolicy`, the sample_policy stage), source `policy`.
Near-miss kinds of every task (`env.tasks`); a set holds those of its own task."""
FAILURE_SOURCES: tuple[str, ...] = ("policy", *ALL_PERTURBATIONS)


DECODE_KEYS = ("temperature", "top_p", "max_outputs", "max_new_tokens", "backend", "dtype")


@dataclass(frozen=True)
class GenerateConfig:
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "policy_backend": "generate_trajectories.backend (the policy rows are the only rows this stage decodes)",
        "policy_dtype": "generate_trajectories.dtype (the policy rows are the only rows this stage decodes)",
    }

    decode: DecodeConfig = flat_field(DecodeConfig, DECODE_KEYS, fixed={"batch_rows": 8})
    """How the policy rows decode (`engine.decoding`; flat keys); each policy entry is one shared-prefix group
    of `policy_samples` rollouts, so `batch_rows` does not apply."""
    reward: Reward
    """Which score defines success (R=1): the paper's binary reward or the official BFCL verdict."""
    success_fraction: float
    """Successes / all rows. The paper's 1:1 mix is 0.5."""
    failure_mix: dict
    """Share of failures per source: `policy` and each near-miss kind of the task; normalised to sum 1."""
    max_tokens: int | None
    """Longest trajectory kept, in tokens; null = the model's context (max_position_embeddings) minus 32,
    the room label_rewards' reward goal needs. Longer replays (long_context tool outputs) are cut by the
    engine (`context_limit`) and left out, counted in the metrics."""
    max_entries: int | None
    """Use at most this many train entries (seeded sample); null = the whole train split."""
    near_miss_attempts: int
    """Perturbation draws per (entry, kind) before giving up on that pair (harmless ones are rejected)."""
    policy_model: str | None
    """Model folder of the policy; null = `--model-dir` (the base model)."""
    policy_adapter: str | None
    """Optional PEFT adapter folder on top of the policy model."""
    policy_reward_token: str | None
    """Reward token to condition the policy on (for an RCTP policy); null = no reward goal."""
    policy_entries: int
    """Train entries the policy is sampled on (seeded sample); 0 disables policy samples."""
    policy_samples: int
    """Samples per policy entry (one shared-prefix group)."""
    seed: int
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
        if self.reward not in BINARY_REWARDS:
            raise ValueError(f"reward must be binary ({list(BINARY_REWARDS)}): it splits successes from failures")
        for name in ("near_miss_attempts", "policy_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.policy_entries < 0 or (self.max_entries is not None and self.max_entries < 1):
            raise ValueError("policy_entries must be >= 0 and max_entries >= 1 (or null)")
        if self.max_tokens is not None and self.max_tokens < 64:
            raise ValueError("max_tokens must be >= 64 or null")


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
    """Give a trajectory its deterministic id and full provenance; wall time 0.0 (`trajectory.DATASET_WALL_TIME`)."""
    reward = reward_value(traj.score, ctx.cfg.reward)
    prov = {**(traj.provenance or {}), **provenance, "reward_fn": ctx.cfg.reward, "reward": reward,
            "seed": ctx.cfg.seed}
    return dataclasses.replace(traj, trajectory_id=tid, provenance=prov, wall_time_s=DATASET_WALL_TIME)


def _replay(entry: Entry, turns: Script, ctx: _Context):
    return replay_calls(entry, ctx.protocol_cfg, [list(t) for t in turns], ctx.tokenizer,
                        max_positions=ctx.max_tokens)


def expert_trajectories(entries: list[Entry], ctx: _Context) -> list:
    """Gold replays scoring 1; the others are counted in `experts_dropped` and left out."""
    out = []
    for entry in entries:
        task = task_of(entry)
        gold = task.expert_script(entry)
        traj = _replay(entry, gold, ctx)
        if traj.termination == "context_limit":
            ctx.stats["experts_too_long"] += 1
            continue
        script = task.score(entry, _script_turns(gold)).to_json()
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
    order = list(entries)
    random.Random(f"{ctx.cfg.seed}:order:{kind}").shuffle(order)
    for entry in order:
        seen: set[Script] = set()
        for attempt in range(ctx.cfg.near_miss_attempts):
            p = task_of(entry).perturb(entry, kind, random.Random(f"{ctx.cfg.seed}:{entry.id}:{kind}:{attempt}"))
            if p is None or p.turns in seen:
                continue
            seen.add(p.turns)
            ctx.stats[f"tried.{kind}"] += 1
            script = task_of(entry).score(entry, _script_turns(p.turns)).to_json()
            # Cheap pre-screen on the script (the paper reward ignores turn grouping; the official
            # protocol keeps it), so harmless candidates skip the replay; the replay's score decides below.
            if reward_value(script, ctx.cfg.reward) != 0.0:
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


def policy_trajectories(entries: list[Entry], ctx: _Context, model_dir: str | Path,
                        compute: ResolvedCompute | None = None) -> list:
    """`policy_samples` rollouts on each of `policy_entries` seeded train entries."""
    cfg = ctx.cfg
    chosen = _sample(entries, cfg.policy_entries, f"{cfg.seed}:policy")
    if not chosen:
        return []
    model = cfg.policy_model or str(model_dir)
    if compute is None:
        raise ConfigError("generate_trajectories: policy rows decode a model: where and in what is the stage's "
                          "resolved `compute` (none given)")
    backend = load_backend(cfg.decode.backend, model, cfg.policy_adapter, **compute.backend_kwargs())
    # Cut rollouts where the dataset's length limit is (the model's own context minus the goal reserve).
    backend.max_positions = min(backend.max_positions, ctx.max_tokens)
    out = []
    for j, entry in enumerate(chosen):
        sampling = cfg.decode.sampling(cfg.seed + j)
        group = run_group(backend, entry, cfg.policy_samples, ctx.protocol_cfg, sampling,
                          [cfg.policy_reward_token] * cfg.policy_samples)
        for i, traj in enumerate(group):
            out.append(_finish(traj, ctx, f"{entry.id}.policy.{i}", {
                "source": "policy", "kind": "policy", "generator": "policy", "model": model,
                "adapter": cfg.policy_adapter, "policy_backend": cfg.decode.backend,
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


def check_task(cfg: GenerateConfig, prompt: PromptConfig, task: Task) -> None:
    """The reward must be defined for the task under the protocol (multi-turn: the official verdict needs the
    official protocol, `Task.reward_defined`), and every near-miss kind of `failure_mix` must be the task's."""
    if not task.reward_defined(cfg.reward, prompt.protocol):
        raise ConfigError(f"generate_trajectories.reward: {cfg.reward!r} is not defined for the {task.name} task "
                          f"under prompt.protocol {prompt.protocol!r}")
    foreign = sorted(k for k, w in cfg.failure_mix.items() if k != "policy" and w and k not in task.perturbations)
    if foreign:
        raise ConfigError(f"generate_trajectories.failure_mix: {foreign} are not near-miss kinds of the {task.name} "
                          f"task (its kinds: {list(task.perturbations)})")


def generate(cfg: GenerateConfig, prompt: PromptConfig, entries_path: str | Path, split_path: str | Path,
             model_dir: str | Path, compute: ResolvedCompute | None = None) -> tuple[list, dict]:
    """(trajectories, metrics) for the train split; pure apart from reading the inputs. `compute`: where and in
    what the policy rows decode (the stage's resolution; None: a set without policy rows)."""
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    train = split_entries(entries_path, split_path, "train")
    task = task_of_entries(train)
    check_task(cfg, prompt, task)
    entries = _sample(train, cfg.max_entries, f"{cfg.seed}:entries")
    ctx = _Context(cfg, prompt.protocol_config(cfg.decode.max_outputs),
                   AutoTokenizer.from_pretrained(model_dir), cfg.max_tokens or model_context(model_dir) - GOAL_RESERVE)
    timings = {}
    experts = expert_trajectories(entries, ctx)
    timings["experts"] = time.perf_counter() - t0
    policy = policy_trajectories(entries, ctx, model_dir, compute)
    timings["policy"] = time.perf_counter() - t0 - sum(timings.values())
    policy_fail = [t for t in policy if t.provenance["reward"] == 0.0]
    random.Random(f"{cfg.seed}:policy_failures").shuffle(policy_fail)
    sources: dict[str, Any] = {"policy": policy_fail}
    sources.update({k: near_miss_stream(entries, k, ctx) for k in task.perturbations})
    successes = experts + [t for t in policy if t.provenance["reward"] == 1.0]
    successes, failures = balance(successes, cfg, sources)
    timings["near_miss"] = time.perf_counter() - t0 - sum(timings.values())
    rows = sorted(successes + failures, key=_row_order(entries))
    metrics = {"task": task.name, **_metrics(rows, policy, ctx, len(train), len(entries), task.perturbations)}
    metrics["seconds"] = {k: round(v, 2) for k, v in timings.items()} | {"total": round(time.perf_counter() - t0, 2)}
    return rows, metrics


def _metrics(rows: list, policy: list, ctx: _Context, n_train: int, n_used: int, kinds: tuple[str, ...]) -> dict:
    n_success = sum(1 for t in rows if t.provenance["reward"] == 1.0)
    tokens = [len(t.token_ids) for t in rows] or [0]
    tried = {k: ctx.stats[f"tried.{k}"] for k in kinds}
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
