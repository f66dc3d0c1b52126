"""RL's entries: the split's side RL samples, its pool chosen by the init's success on each prompt.

- `train_entries`: the entries a run samples from: RL's own side of the split (`rl_side`), of
  `rl.categories`; with `rl.pool_band`, the prompts `pool_ids` keeps; with `rl.max_entries`, the shortest
  prompts (`prompt_length`). `env.entries` is the one reader of the split.
"""

from __future__ import annotations

import random
from pathlib import Path

from rcgrpo_tasks.env.entries import read_split, split_entries
from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.env.tasks import task_of
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.train.rl.config import RLConfig


def pool_ids(success: dict[str, float], band: tuple[float, float] | None, solved_share: float,
             seed: int) -> list[str]:
    """RL's pool from each sampled prompt's success share (`onpolicy.sampled_success_rates`), sorted: those in
    `band` (every one when None), and always-solved ones (share 1.0, outside the band) drawn by `seed` up to
    `solved_share` of the pool (rounded down)."""
    if band is None:
        return sorted(success)
    lo, hi = band
    inside = sorted(e for e, p in success.items() if lo <= p <= hi)
    solved = sorted(e for e, p in success.items() if p == 1.0 and not lo <= p <= hi)
    extra = min(len(solved), int(solved_share * len(inside) / (1.0 - solved_share)))
    return sorted(inside + random.Random(f"{seed}:pool").sample(solved, extra))


def train_entries(entries_path: Path, split_path: Path, cfg: RLConfig, protocol: ProtocolConfig,
                  tokenizer=None, success: dict[str, float] | None = None) -> list:
    """RL's entries: the split's `rl` side (the `train` side where the split has none), of `cfg.categories`;
    with `pool_band`, the prompts `pool_ids` keeps from `success` (the init's samples; a prompt never sampled
    is left out); with `max_entries`, those with the shortest prompts, counted in `tokenizer` tokens, else
    characters. Too few for one generation batch is a ConfigError."""
    side = rl_side(split_path)
    entries = split_entries(entries_path, split_path, side, cfg.categories)
    if cfg.pool_band is not None:
        if success is None:
            raise ConfigError("rl.pool_band needs the init's samples of RL's prompts (--pool)")
        keep = set(pool_ids({e.id: success[e.id] for e in entries if e.id in success}, cfg.pool_band,
                            cfg.pool_solved_share, cfg.seed))
        entries = [e for e in entries if e.id in keep]
    if cfg.max_entries is not None:
        entries.sort(key=lambda e: (prompt_length(e, protocol, tokenizer), e.id))
        entries = entries[: cfg.max_entries]
    if len(entries) < cfg.entries_per_generation:
        raise ConfigError(f"{split_path}: {len(entries)} {side} entries in {cfg.categories} (pool_band "
                          f"{cfg.pool_band}), need at least {cfg.entries_per_generation} per generation batch")
    return entries


def rl_side(split_path: Path) -> str:
    """The split side RL samples: `rl` (its own prompts), or `train` where the split has none."""
    return "rl" if read_split(split_path)["rl"] else "train"


def prompt_length(entry, protocol: ProtocolConfig, tokenizer=None) -> int:
    """Length of an entry's initial messages: `tokenizer` tokens, else characters."""
    text = "".join(m["content"] for m in task_of(entry).initial_messages(entry, protocol))
    return len(tokenizer(text)["input_ids"]) if tokenizer is not None else len(text)
