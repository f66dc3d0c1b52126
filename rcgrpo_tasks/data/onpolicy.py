"""On-policy samples: the SFT model's own rollouts on train entries for RCTP, sampled in rounds until each
entry has both a success and a failure, and an init's rollouts on RL's prompts, from which RL's pool is
chosen by how often each succeeds (the `sample_policy` stage runs `sample_policy`).

Why: a reward token can only matter if the same prompt is seen under both tokens with trajectories the
model itself could produce. An SFT model tends to memorise its train entries (docs/data.md),
so failures are scarce and must be searched for: every entry gets
`samples_per_entry` rollouts per round, and entries that still lack one of the two outcomes get another
round, until `max_samples_per_entry`. All entries of a round are decoded together (`run_rollouts`,
`batch_rows` rows per session, shared system prompts prefilled once).

Every rollout is kept (the pairing rule in `data.pairing` picks from them), scored by the shared scorer
(the engine scores every trajectory), with success = `generate_trajectories.reward` (one definition of R
for every trajectory set). Rows have the `data/trajectories.jsonl` schema with `provenance.source =
"policy"`, `provenance.kind = "on_policy"` and the sampling provenance: model, adapter, backend,
temperature / top-p / max_new_tokens, the round, the entry's sample index, the run seed and the session
seed (`provenance.sampling.seed`). Seeded: the same params and inputs give the same rows.
Departure from the paper: the paper's RCTP data are its model's rollouts without this search.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rcgrpo_tasks.engine.backend import Backend
from rcgrpo_tasks.engine.decoding import DecodeConfig
from rcgrpo_tasks.engine.rollout import run_rollouts
from rcgrpo_tasks.engine.trajectory import DATASET_WALL_TIME, Trajectory
from rcgrpo_tasks.env.contract import Entry
from rcgrpo_tasks.env.entries import check_categories
from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.env.rewards import reward_value
from rcgrpo_tasks.ops.config import flat_field

SOURCE, KIND = "policy", "on_policy"
ROUND_SEED_STRIDE = 1_000_003
"""Session seeds of round r are derived from `seed + r * stride`: rounds never reuse a random stream."""


@dataclass(frozen=True)
class SampleConfig:
    """params.yaml `sample_policy`; the prompt is the shared `prompt` section, R is generate_trajectories.reward."""

    decode: DecodeConfig = flat_field(DecodeConfig)
    """Sampling, budgets and engine (`engine.decoding`; flat keys). Temperature > 0: on-policy samples
    (the paper's RCTP samples: 0.7)."""
    n_entries: int | None
    """Train entries sampled (`--side train`: the RCTP set's own pairs; a seeded sample of `categories`, in
    file order); null = every one."""
    pool_entries: int | None
    """RL-side entries sampled (`--side rl`: the prompts RL's pool is chosen from, `rl.pool_band`), drawn as
    `n_entries`; null = every one."""
    categories: tuple[str, ...] | None
    """Categories drawn from; null = every category of the prepared entries."""
    samples_per_entry: int
    """Rollouts per entry per round."""
    max_samples_per_entry: int
    """Cap: an entry stops being sampled at this many rollouts, with or without both outcomes."""
    seed: int
    """Seeds the entry sample and every round's sampling."""

    def __post_init__(self) -> None:
        for name in ("n_entries", "pool_entries"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or null")
        if self.samples_per_entry < 1 or self.max_samples_per_entry < self.samples_per_entry:
            raise ValueError("need samples_per_entry >= 1 and max_samples_per_entry >= samples_per_entry")
        if self.decode.temperature <= 0:
            raise ValueError("temperature must be > 0 (on-policy samples, not greedy)")
        if self.categories is not None and not self.categories:
            raise ValueError("categories must be null (every category) or a non-empty list")
        check_categories(self.categories)


def pick_entries(train: Sequence[Entry], cfg: SampleConfig, side: str = "train") -> list[Entry]:
    """A seeded sample of `n_entries` (side train) or `pool_entries` (side rl) entries of `cfg.categories`,
    kept in file order."""
    pool = [e for e in train if cfg.categories is None or e.category in cfg.categories]
    n = cfg.n_entries if side == "train" else cfg.pool_entries
    if n is None or n >= len(pool):
        return pool
    chosen = set(random.Random(f"{cfg.seed}:sample_policy").sample(range(len(pool)), n))
    return [e for i, e in enumerate(pool) if i in chosen]


def needs_more(rewards: Sequence[float], cap: int) -> bool:
    """An entry is sampled again while it lacks a success or a failure and is under the cap."""
    return len(rewards) < cap and not (1.0 in rewards and any(r != 1.0 for r in rewards))


def finish(traj: Trajectory, reward_fn: str, sample_index: int, round_: int, extra: dict) -> Trajectory:
    """The row as the trajectory sets store it: deterministic id, R under `reward_fn`, provenance, no wall
    time (`trajectory.DATASET_WALL_TIME`)."""
    prov = {**traj.provenance, **extra, "source": SOURCE, "kind": KIND, "generator": "policy",
            "perturbation": None, "script_score": None, "reward_fn": reward_fn,
            "reward": reward_value(traj.score, reward_fn), "sample_index": sample_index, "round": round_}
    return dataclasses.replace(traj, trajectory_id=f"{traj.entry_id}.{KIND}.{sample_index}", provenance=prov,
                               wall_time_s=DATASET_WALL_TIME)


def sample_policy(backend: Backend, entries: Sequence[Entry], cfg: SampleConfig, protocol: ProtocolConfig,
                  reward_fn: str, provenance: dict | None = None,
                  progress: Callable[[list[Trajectory]], None] | None = None,
                  reward_token: str | None = None) -> tuple[list[Trajectory], dict]:
    """(every rollout, entries in input order and samples in sampling order per entry; metrics).

    Round r samples `min(samples_per_entry, cap - taken)` rollouts of every entry that still `needs_more`
    (all such entries have the same count, so one `run_rollouts` call decodes the whole round), each
    conditioned on `reward_token` (None: no reward goal; an RCTP model sampled as RL's cells from it sample).
    """
    t0 = time.perf_counter()
    extra = {"seed": cfg.seed, **(provenance or {})}
    taken: dict[str, list[Trajectory]] = {e.id: [] for e in entries}
    first_round: list[float] = []
    round_ = 0
    while active := [e for e in entries if needs_more([t.provenance["reward"] for t in taken[e.id]],
                                                        cfg.max_samples_per_entry)]:
        n = min(cfg.samples_per_entry, cfg.max_samples_per_entry - len(taken[active[0].id]))
        sampling = cfg.decode.sampling(cfg.seed + round_ * ROUND_SEED_STRIDE)
        trajs = run_rollouts(backend, active, n, protocol, sampling, lambda e, i: reward_token,
                             batch_rows=cfg.decode.batch_rows, provenance=extra, progress=progress)
        for k, entry in enumerate(active):
            for traj in trajs[k * n:(k + 1) * n]:
                row = finish(traj, reward_fn, len(taken[entry.id]), round_, extra)
                taken[entry.id].append(row)
                if round_ == 0:
                    first_round.append(row.provenance["reward"])
        round_ += 1
    rows = [t for e in entries for t in taken[e.id]]
    metrics = sample_metrics(taken, first_round, round_)
    metrics["seconds"] = round(time.perf_counter() - t0, 2)
    metrics["model_tokens_per_s"] = round(sum(t.n_model_tokens for t in rows) / max(metrics["seconds"], 1e-9), 1)
    return rows, metrics


def _rate(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def sample_metrics(taken: dict[str, list[Trajectory]], first_round: list[float], rounds: int) -> dict:
    """Counts per entry outcome, success rates (first round = unbiased; all samples = biased toward
    entries that needed more rounds), samples and tokens used."""
    rows = [t for ts in taken.values() for t in ts]
    outcome = Counter()
    for ts in taken.values():
        rewards = {t.provenance["reward"] == 1.0 for t in ts}
        outcome["both" if rewards == {True, False} else "only_success" if rewards == {True} else "only_failure"] += 1
    return {
        "n_entries": len(taken), "rounds": rounds, "samples": len(rows),
        "samples_per_entry_mean": round(len(rows) / len(taken), 3) if taken else None,
        "success_rate_first_round": _rate(first_round),
        "success_rate_all_samples": _rate([t.provenance["reward"] for t in rows]),
        "entries_with_both": outcome["both"], "entries_only_success": outcome["only_success"],
        "entries_only_failure": outcome["only_failure"],
        "mean_partial_credit": _rate([float(t.score["partial_credit"]) for t in rows]),
        "terminations": dict(sorted(Counter(t.termination for t in rows).items())),
        "model_tokens_mean": round(sum(t.n_model_tokens for t in rows) / len(rows), 1) if rows else None,
    }


def sampled_success_rates(rows: Sequence[dict]) -> dict[str, float]:
    """Per entry id, the share of its on-policy samples (trajectory rows of this module) that succeeded
    (`provenance.reward` == 1): how well the sampled model already solves each train entry."""
    by: dict[str, list[float]] = {}
    for row in rows:
        by.setdefault(row["entry_id"], []).append(float(float(row["provenance"]["reward"]) == 1.0))
    return {e: sum(v) / len(v) for e, v in by.items()}
