"""The pipeline's side of GRPO / RC-GRPO's pure functions (no torch, no trainer): which conditioning a grid cell
trains under, and one engine trajectory as the fields TRL's `rollout_func` returns.

The reward-token draw, the group statistics and the advantage live once, in the library (`rcgrpo.draw`,
`rcgrpo.group_metrics`), which the pipeline's modules import directly: `group_metrics.group_advantages` is TRL
1.16's GRPO advantage over each whole group regardless of the rollouts' reward tokens, which is exactly
RC-GRPO's, and the tests cross-check it against the advantages TRL used.

- Reward tokens are never named here: `levels` is params.yaml `label_rewards.tokens` (lowest first, highest
  last; `env.prompt.reward_tokens`), and RL conditions on its two ends, low = levels[0], high = levels[-1].
- `trajectory_fields` splits one engine trajectory into what TRL's `rollout_func` returns: prompt ids
  (everything before the first model generation; it contains the rollout's own reward token), completion
  ids, `env_mask` (1 = model-generated, 0 = environment/template tokens, which carry no loss) and the
  sampling log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence

from rcgrpo.draw import Conditioning
from rcgrpo.goal import check_levels
from rcgrpo_tasks.ops.names import ALGOS, RC_ALGOS


def conditioning_for(init: str, algo: str) -> Conditioning:
    """The paper's grid: RC-GRPO (and its ablations, `RC_ALGOS`) -> `rc`; GRPO (plain or with dynamic
    sampling) from an RCTP init -> `fixed` (always high); from SFT -> `none`."""
    if algo in RC_ALGOS:
        return "rc"
    if algo in ("grpo", "dynamic"):
        return "fixed" if init == "rctp" else "none"
    raise ValueError(f"unknown algo {algo!r}; expected one of {ALGOS}")


def reward_levels(levels: Sequence[str]) -> tuple[str, str]:
    """(low, high) = the lowest and the highest of `levels` (label_rewards.tokens): the tokens RL draws."""
    levels = check_levels(levels)
    return levels[0], levels[-1]


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

