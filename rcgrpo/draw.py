"""Each rollout's reward token: RC-GRPO's draw, seeded so that a resumed run or a run on another number of
processes draws the same tokens for the same rollouts. Pure functions (no torch).

A batch is laid out as TRL's `RepeatSampler` lays it out: groups of G consecutive rollouts of one prompt
(rollout `i` of the whole batch belongs to group `i // G`). A group's tokens depend on (seed, step, the
group's index in the whole batch, call) only, never on the process that generates it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

from rcgrpo.goal import check_levels

Conditioning = Literal["rc", "fixed", "none"]
CONDITIONING_MODES: tuple[str, ...] = ("rc", "fixed", "none")
"""`rc`: RC-GRPO, each rollout draws its own token; `fixed`: every rollout gets the highest level (GRPO from an
RCTP model, evaluated as it is trained); `none`: no token, plain GRPO."""
TokenDraw = Literal["iid", "stratified"]
TOKEN_DRAWS: tuple[str, ...] = ("iid", "stratified")


def token_seed(seed: int, step: int, group: int = 0, call: int = 0) -> int:
    """Deterministic 63-bit seed of one draw of one group (`group`: its index in the step's whole batch)."""
    rng = random.Random(f"rcgrpo-reward-token:{seed}:{step}:{group}:{call}")
    return rng.getrandbits(63)


def stratified_count(g: int, p: float, rng: random.Random) -> int:
    """High tokens in one stratified group of `g`: floor(g p) or ceil(g p), the ceiling with probability
    frac(g p), so E[k] = g p, clamped to [1, g - 1] so the group holds both tokens (the clamp moves E[k] only
    where g p < 1 or > g - 1)."""
    lo = math.floor(g * p)
    k = lo + (rng.random() < g * p - lo)
    return min(max(k, 1), g - 1)


def sample_reward_tokens(n: int, mode: Conditioning, p: float = 0.5, seed: int = 0, *,
                         levels: Sequence[str], draw: TokenDraw = "iid", g: int | None = None) -> list[str | None]:
    """Reward tokens of `n` rollouts -> list of length n, drawn between the lowest and the highest level.

    `rc`: with `draw="iid"` (the paper) each rollout's own token, P(high) = p (a G-group is single-token with
    probability p^G + (1-p)^G: 1 in 16 at G = 5, p = 0.5); with `draw="stratified"` every group of `g` holds
    both tokens (`stratified_count`), each rollout still high with probability p. `fixed`: all high; `none`:
    all None (no reward goal). Departure from the paper for more than two levels: the middle levels are
    labels for RCTP data only; RL draws the two ends.
    """
    levels = check_levels(levels)
    low, high = levels[0], levels[-1]
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if mode == "fixed":
        return [high] * n
    if mode == "none":
        return [None] * n
    if mode != "rc":
        raise ValueError(f"unknown conditioning mode {mode!r}; expected one of {CONDITIONING_MODES}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"p (P(high reward token)) must be in (0, 1), got {p}")
    rng = random.Random(seed)
    if draw == "iid":
        return [high if rng.random() < p else low for _ in range(n)]
    if draw != "stratified":
        raise ValueError(f"unknown reward-token draw {draw!r}; expected one of {TOKEN_DRAWS}")
    if g is None or g < 2 or n % g:
        raise ValueError(f"stratified reward tokens need whole groups of g >= 2; got n={n}, g={g}")
    out: list[str | None] = []
    for _ in range(n // g):
        k = stratified_count(g, p, rng)
        group = [high] * k + [low] * (g - k)
        rng.shuffle(group)
        out += group
    return out


def group_tokens(g: int, mode: Conditioning, p: float, seed: int, step: int, group: int, *,
                 levels: Sequence[str], draw: TokenDraw = "iid", call: int = 0) -> list[str | None]:
    """The G tokens of group `group` (its index in the step's whole batch) at `step`: one seeded draw."""
    return sample_reward_tokens(g, mode, p, token_seed(seed, step, group, call), levels=levels, draw=draw, g=g)


def batch_tokens(rows: int, g: int, mode: Conditioning, p: float, seed: int, step: int, *,
                 levels: Sequence[str], draw: TokenDraw = "iid", first_row: int = 0) -> list[str | None]:
    """Tokens of the `rows` rollouts starting at row `first_row` of the step's whole batch (a process's share:
    `first_row = process_index * rows`). Groups may straddle processes: each row takes its place in its
    group's draw, so every process's share agrees with one process drawing the whole batch."""
    if g < 1:
        raise ValueError(f"group size must be >= 1, got {g}")
    cache: dict[int, list[str | None]] = {}
    out = []
    for r in range(first_row, first_row + rows):
        j = r // g
        if j not in cache:
            cache[j] = group_tokens(g, mode, p, seed, step, j, levels=levels, draw=draw)
        out.append(cache[j][r % g])
    return out
