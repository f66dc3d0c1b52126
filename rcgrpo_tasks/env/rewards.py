"""What a task's scorer returns and what every stage reads from it: `EntryScore` (every score of one
trajectory) and the reward choice (`Reward`: which of its scores drives training; `reward_value`).

Each task fills `EntryScore` with its own checker (`Task.score`): multi-turn with bfcl-eval's
`multi_turn_checker` semantics and the paper reward (`env.multi_turn.scoring`), single-turn with BFCL's AST
checker (`env.single_turn.scoring`). Training rewards (generation, RL) and evaluation read the same fields,
so they cannot drift apart.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, field
from typing import Literal


@dataclass(frozen=True)
class EntryScore:
    """Every score of one trajectory."""

    valid: bool
    """The task's official verdict (multi-turn: bfcl-eval `multi_turn_checker` semantics; single-turn: BFCL's AST
    checker)."""
    error_type: str | None
    error_message: str | None
    partial_credit: float
    """0.0..1.0: fraction of checked turns passing (multi-turn), of gold calls matched (single-turn)."""
    paper_reward: float
    """RC-GRPO binary reward: 1.0 or 0.0 (single-turn: the verdict)."""
    turn_passed: list[bool] = field(default_factory=list)
    """Per checked turn (non-empty ground truth), in order (single-turn: one)."""

    def to_json(self) -> dict:
        return asdict(self)


Reward = Literal["paper_reward", "official_verdict", "partial_credit"]
"""THE reward choice of every stage: the name of the scorer function (and of TRL's reward function)."""
REWARDS: tuple[str, ...] = typing.get_args(Reward)
BINARY_REWARDS: tuple[str, ...] = ("paper_reward", "official_verdict")


def reward_value(score: dict | EntryScore | None, reward: str) -> float | None:
    """The chosen reward of one `score_entry` result (or its JSON dict); None where there is no score."""
    if score is None:
        return None
    s = asdict(score) if isinstance(score, EntryScore) else score
    if reward == "official_verdict":
        return 1.0 if s["valid"] else 0.0
    if reward == "partial_credit":
        return float(s["partial_credit"])
    if reward == "paper_reward":
        return float(s["paper_reward"])
    raise ValueError(f"unknown reward {reward!r}; expected one of {REWARDS}")
