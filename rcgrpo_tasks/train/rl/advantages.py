"""Pure reward / advantage / reward-token functions of GRPO and RC-GRPO (no torch, no trainer).

Everything here is a plain function of lists/arrays, so the RL wing (`train/rl/`), its
diagnostics and the tests share one definition. Shapes are given in comments: `B` = rollouts in a batch, `G` = rollouts per
group (`num_generations`), `T` = tokens of one trajectory; a batch is `B // G` groups laid out
consecutively (rollout `i` belongs to group `i // G`), exactly as TRL's `RepeatSampler` lays them out.

- Reward tokens are never named here: `levels` is params.yaml `label_rewards.tokens` (lowest first, highest
  last; `env.prompt.reward_tokens`), and RL conditions on its two ends, low = levels[0], high = levels[-1].
- Conditioning modes (`rc` / `fixed` / `none`) and the reward-token draw: in `rc` (RC-GRPO) every rollout
  draws its own token i.i.d. from {high, low} with P(high) = p, from a seed derived from (run seed, step,
  process, call), so a resumed run redraws the same tokens for the same step.
- `group_advantages` is TRL 1.16's GRPO advantage (`sum_then_normalize`, `scale_rewards`):
  A_i = (r_i - mean_g) / (std_g + 1e-4) with the unbiased std over the G rollouts of the group,
  *regardless of their reward tokens* -- which is exactly RC-GRPO's advantage: a group whose rollouts
  split by token (high succeeds, low fails) has reward variance, hence signal, where a uniformly
  conditioned group that always succeeds (or always fails) has none. The RL stage cross-checks this
  function against the advantages TRL actually used (`trainer_mixin.RCGRPOTrainerMixin`).
- `trajectory_fields` splits one engine trajectory into what TRL's `rollout_func` returns: prompt ids
  (everything before the first model generation; it contains the rollout's own reward token), completion
  ids, `env_mask` (1 = model-generated, 0 = environment/template tokens, which carry no loss) and the
  sampling log-probs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

from rcgrpo_tasks.env.prompt import check_reward_tokens
from rcgrpo_tasks.ops.names import ALGOS
from rcgrpo_tasks.train.rl.config import TokenDraw

Conditioning = Literal["rc", "fixed", "none"]
CONDITIONING_MODES: tuple[str, ...] = ("rc", "fixed", "none")
ZERO_STD_TOL = 1e-6
"""A group whose reward std is below this counts as zero-std (rewards are floats: never test `== 0`)."""
ADV_EPS = 1e-4
"""TRL's epsilon in A = (r - mean) / (std + eps)."""


# ---------------------------------------------------------------- conditioning and reward tokens


def conditioning_for(init: str, algo: str) -> Conditioning:
    """The paper's grid: RC-GRPO -> `rc`; GRPO (plain or with dynamic sampling) from an RCTP init -> `fixed`
    (always high); from SFT -> `none`."""
    if algo == "rc_grpo":
        return "rc"
    if algo in ("grpo", "dynamic"):
        return "fixed" if init == "rctp" else "none"
    raise ValueError(f"unknown algo {algo!r}; expected one of {ALGOS}")


def token_seed(seed: int, step: int, group: int = 0, call: int = 0) -> int:
    """Deterministic 63-bit seed for one draw of one group (`group`: its index in the step's whole batch):
    the same run seed + step -> the same tokens after a resume and on any number of processes."""
    rng = random.Random(f"rcgrpo-reward-token:{seed}:{step}:{group}:{call}")
    return rng.getrandbits(63)


def reward_levels(levels: Sequence[str]) -> tuple[str, str]:
    """(low, high) = the lowest and the highest of `levels` (label_rewards.tokens): the tokens RL draws."""
    levels = check_reward_tokens(levels)
    return levels[0], levels[-1]


def sample_reward_tokens(n: int, mode: Conditioning, p: float = 0.5, seed: int = 0, *,
                         levels: Sequence[str], draw: TokenDraw = "iid", g: int | None = None) -> list[str | None]:
    """Reward tokens of `n` rollouts -> list of length n.

    `rc`: with `draw="iid"` (the paper) each rollout's own token, P(high) = p (a G-group is single-token with
    probability p^G + (1-p)^G: 1 in 16 at G=5, p=0.5); with `draw="stratified"` every group of `g` holds
    both tokens (`stratified_counts`), each rollout still high with probability p. `fixed`: all high
    (`levels[-1]`); `none`: all None (no reward goal in the prompt).
    """
    low, high = reward_levels(levels)
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
        raise ValueError(f"unknown reward-token draw {draw!r}; expected 'iid' or 'stratified'")
    if g is None or g < 2 or n % g:
        raise ValueError(f"stratified reward tokens need whole groups of g >= 2; got n={n}, g={g}")
    out: list[str | None] = []
    for _ in range(n // g):
        k = stratified_count(g, p, rng)
        group = [high] * k + [low] * (g - k)
        rng.shuffle(group)
        out += group
    return out


def stratified_count(g: int, p: float, rng: random.Random) -> int:
    """High tokens in one stratified group of `g`: floor(g p) or ceil(g p), the ceiling with probability
    frac(g p), so E[k] = g p (every rollout high with probability p), clamped to [1, g - 1] so the group holds
    both tokens (the clamp moves E[k] only where g p < 1 or > g - 1)."""
    lo = math.floor(g * p)
    k = lo + (rng.random() < g * p - lo)
    return min(max(k, 1), g - 1)


# ---------------------------------------------------------------- advantages and group statistics


def _groups(values: Sequence[float], g: int) -> list[list[float]]:
    """(B,) -> (B/G, G); raises if B is not a multiple of G."""
    if g < 1 or len(values) % g:
        raise ValueError(f"{len(values)} rollouts do not split into groups of {g}")
    return [list(values[i : i + g]) for i in range(0, len(values), g)]


def _std(xs: Sequence[float]) -> float:
    """Unbiased (n-1) std, as torch.std / TRL's nanstd; 0.0 for a single value."""
    n = len(xs)
    if n < 2:
        return 0.0
    mean = sum(xs) / n
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))


def group_stats(rewards: Sequence[float], g: int) -> list[tuple[float, float]]:
    """rewards (B,) -> [(mean, std)] of shape (B/G,): per-group mean and unbiased std."""
    return [(sum(grp) / len(grp), _std(grp)) for grp in _groups(rewards, g)]


def group_advantages(rewards: Sequence[float], g: int, scale: str = "group") -> list[float]:
    """rewards (B,) -> advantages (B,), TRL's GRPO formula over each whole group (tokens ignored).

    scale: `group` divides by the group std (+1e-4), `batch` by the batch std, `none` not at all.
    """
    stats = group_stats(rewards, g)
    batch_std = _std(list(rewards))
    out = []
    for i, r in enumerate(rewards):
        mean, std = stats[i // g]
        a = r - mean
        if scale == "group":
            a /= std + ADV_EPS
        elif scale == "batch":
            a /= batch_std + ADV_EPS
        elif scale != "none":
            raise ValueError(f"unknown scale_rewards {scale!r}")
        out.append(a)
    return out


def zero_std_fraction(rewards: Sequence[float], g: int, tol: float = ZERO_STD_TOL) -> float:
    """rewards (B,) -> fraction of the B/G groups whose reward std < tol (groups with no learning signal)."""
    stats = group_stats(rewards, g)
    return sum(std < tol for _, std in stats) / len(stats) if stats else float("nan")


def flat_fractions(rewards: Sequence[float], g: int, tol: float = ZERO_STD_TOL) -> tuple[float, float]:
    """rewards (B,) -> (share of the B/G groups flat at failure, share flat at success): a zero-std group
    whose common reward is <= 0.5 failed everywhere (all-0 under a 0/1 reward), one above succeeded
    everywhere (all-1). The two add up to `zero_std_fraction`. Which side is flat says what can help: a low
    token adds spread to all-1 groups only (it can only lower success), exploration to all-0 ones."""
    stats = group_stats(rewards, g)
    if not stats:
        return float("nan"), float("nan")
    low = sum(std < tol and mu <= 0.5 for mu, std in stats)
    high = sum(std < tol and mu > 0.5 for mu, std in stats)
    return low / len(stats), high / len(stats)


def spread_groups(rewards: Sequence[float], g: int, tol: float = ZERO_STD_TOL) -> list[bool]:
    """rewards (B,) -> (B/G,): whether each group has reward spread (std >= tol), i.e. a learning signal."""
    return [std >= tol for _, std in group_stats(rewards, g)]


def advantage_spread(advantages: Sequence[float]) -> float:
    """advantages (B,) -> mean |A| (0 when every group is zero-std)."""
    return sum(abs(a) for a in advantages) / len(advantages) if advantages else float("nan")


def advantage_std(advantages: Sequence[float]) -> float:
    """advantages (B,) -> their unbiased std over the batch (0 when every group is zero-std; NaN for B = 0)."""
    return _std(list(advantages)) if advantages else float("nan")


def reward_by_token(rewards: Sequence[float], tokens: Sequence[str | None], *,
                    levels: Sequence[str]) -> dict[str, float]:
    """rewards (B,), tokens (B,) -> {'high': mean, 'low': mean, 'none': mean} over the rollouts present
    (high / low: the ends of `levels`; any other level under its own token)."""
    if len(rewards) != len(tokens):
        raise ValueError(f"{len(rewards)} rewards but {len(tokens)} tokens")
    low, high = reward_levels(levels)
    names = {high: "high", low: "low", None: "none"}
    sums: dict[str, list[float]] = {}
    for r, t in zip(rewards, tokens, strict=True):
        sums.setdefault(names.get(t, str(t)), []).append(r)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def controllability_gap(rewards: Sequence[float], tokens: Sequence[str | None], *,
                        levels: Sequence[str]) -> float:
    """E[R | high] - E[R | low] over a batch (B,); NaN unless both tokens occur."""
    by = reward_by_token(rewards, tokens, levels=levels)
    if "high" not in by or "low" not in by:
        return float("nan")
    return by["high"] - by["low"]


# ---------------------------------------------------------------- trajectory -> TRL rollout fields


def trajectory_fields(
    token_ids: Sequence[int], prompt_len: int, completion_mask: Sequence[int], logprobs: Sequence[float]
) -> tuple[list[int], list[int], list[int], list[float]]:
    """One trajectory (T,) -> (prompt_ids (P,), completion_ids (T-P,), env_mask (T-P,), logprobs (T-P,)).

    Everything after the first model generation is the "completion" for TRL; inside it, tool results,
    next user turns and chat-template tokens are environment tokens: env_mask 0, so TRL's loss mask
    (`completion_mask * tool_mask`) drops them. Log-probs outside the model's tokens are 0.0.
    """
    n = len(token_ids)
    if not (len(completion_mask) == len(logprobs) == n):
        raise ValueError(f"lengths differ: token_ids {n}, completion_mask {len(completion_mask)}, "
                         f"logprobs {len(logprobs)}")
    if not 0 < prompt_len <= n:
        raise ValueError(f"prompt_len {prompt_len} outside (0, {n}]")
    if any(completion_mask[:prompt_len]):
        raise ValueError("completion_mask marks model tokens inside the prompt")
    env_mask = [1 if m else 0 for m in completion_mask[prompt_len:]]
    lps = [float(lp) if m else 0.0 for lp, m in zip(logprobs[prompt_len:], env_mask, strict=True)]
    return list(token_ids[:prompt_len]), list(token_ids[prompt_len:]), env_mask, lps


FINISHED = ("done", "completed")
"""Terminations where the model itself ended the episode (`done()`, or an output without a call); the others
(`step_limit`, `context_limit`, `error`) were cut by a budget."""


def end_at_stop(completion_ids: Sequence[int], env_mask: Sequence[int], logprobs: Sequence[float],
                end_ids: set[int]) -> tuple[list[int], list[int], list[float]]:
    """The TRL fields (C,) of a rollout whose model ended the episode (`FINISHED`), cut after its last model
    token where that token is an end-of-turn id (`end_ids`); otherwise unchanged.

    Why: TRL counts a completion as finished only when its last token is an EOS / pad id, and a multi-turn
    rollout ends with the chat template's tokens after the model's end-of-turn (`<|im_end|>` then a newline),
    so every rollout would count as truncated (`completions/clipped_ratio` 1; `mask_truncated_completions`
    would mask them all). The dropped tail is environment / template tokens after the last model token:
    no loss, and under causal attention nothing before it changes. A rollout cut by a budget keeps its tail
    and stays truncated for TRL."""
    last = max((i for i, m in enumerate(env_mask) if m), default=None)
    if last is None or completion_ids[last] not in end_ids:
        return list(completion_ids), list(env_mask), list(logprobs)
    return list(completion_ids[:last + 1]), list(env_mask[:last + 1]), list(logprobs[:last + 1])

