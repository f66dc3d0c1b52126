"""RCTP data for any task: rows of (prompt, completion, reward) as reward-token-labelled SFT rows.

RCTP-FT (the paper's first stage) fine-tunes on mixed-quality trajectories, each labelled with the token of
its reward level in its prompt: successes under `<|high_reward|>`, failures under `<|low_reward|>` (in the
paper the failures are the model's own). `rctp_rows` labels the rows and pairs a success with a failure of the
same prompt where a prompt has both, so the only difference between the two prompts is the token and the
model learns to read it. The rows are TRL's prompt-completion format for `SFTTrainer` (loss on the completion
only, its default for this format).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence

from rcgrpo.goal import DEFAULT_LEVELS, GOAL_TEMPLATE, check_levels, check_thresholds, format_goal, level_of, place_goal

UNPAIRED = ("keep", "drop")


def _key(prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def label_row(row: Mapping, *, tokens: Sequence[str] = DEFAULT_LEVELS, thresholds: Sequence[float] = (0.5,),
              template: str = GOAL_TEMPLATE, place: str = "first_user") -> dict:
    """One (prompt, completion, reward) row -> its RCTP row: the prompt with the goal of the reward's level
    (`level_of`) at `place`, the completion as it is, `reward_token` and `reward` kept (other columns too)."""
    for col in ("prompt", "completion", "reward"):
        if col not in row:
            raise ValueError(f"RCTP row needs a {col!r} column, got {sorted(row)}")
    levels = check_levels(tokens)
    token = levels[level_of(float(row["reward"]), check_thresholds(thresholds, len(levels)))]
    return {**row, "prompt": place_goal(row["prompt"], format_goal(token, template), place), "reward_token": token}


def rctp_rows(rows: Sequence[Mapping], *, tokens: Sequence[str] = DEFAULT_LEVELS, thresholds: Sequence[float] = (0.5,),
              template: str = GOAL_TEMPLATE, place: str = "first_user", unpaired: str = "keep",
              seed: int = 0) -> list[dict]:
    """Reward-token-labelled SFT rows (`label_row`), pairs first: for every prompt with rows at both the highest
    and the lowest level, as many (success, failure) pairs as it has of the rarer kind, each pair adjacent
    (`pair` = the pair's index); then the other rows (`pair` = None), dropped with `unpaired="drop"`. Units
    (pairs, single rows) are shuffled with `seed`; the input order within a prompt is kept. Keep the pairs
    adjacent (a sequential sampler) if a batch should see both sides of a pair."""
    if unpaired not in UNPAIRED:
        raise ValueError(f"unpaired must be one of {UNPAIRED}, got {unpaired!r}")
    levels = check_levels(tokens)
    labelled = [label_row(r, tokens=levels, thresholds=thresholds, template=template, place=place) for r in rows]
    by_prompt: dict[str, list[tuple[dict, dict]]] = {}
    for src, lab in zip(rows, labelled):
        by_prompt.setdefault(_key(src["prompt"]), []).append((src, lab))
    units: list[list[dict]] = []
    for items in by_prompt.values():
        highs = [lab for _, lab in items if lab["reward_token"] == levels[-1]]
        lows = [lab for _, lab in items if lab["reward_token"] == levels[0]]
        n = min(len(highs), len(lows))
        units += [[highs[i], lows[i]] for i in range(n)]
        rest = highs[n:] + lows[n:] + [lab for _, lab in items if lab["reward_token"] not in (levels[0], levels[-1])]
        if unpaired == "keep":
            units += [[lab] for lab in rest]
    random.Random(seed).shuffle(units)
    out, n_pairs = [], 0
    for unit in units:
        pair = n_pairs if len(unit) == 2 else None
        n_pairs += len(unit) == 2
        out += [{**row, "pair": pair} for row in unit]
    return out
