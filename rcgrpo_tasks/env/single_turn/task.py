"""The single-turn task (BFCL v4's single-turn AST categories) behind the pipeline's `Task` contract."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rcgrpo_tasks.env import failures
from rcgrpo_tasks.env.contract import Perturbation, Script
from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.env.rewards import EntryScore
from rcgrpo_tasks.env.single_turn import perturb
from rcgrpo_tasks.env.single_turn.entries import (
    CATEGORIES,
    DEFAULT_CATEGORIES,
    TASK_NAME,
    SingleTurnEntry,
    category_of,
    load_entries,
    split_ids,
)
from rcgrpo_tasks.env.single_turn.episode import SingleTurnEpisode, initial_messages, score_text
from rcgrpo_tasks.env.single_turn.scoring import score_single_turn


@dataclass(frozen=True)
class SingleTurnTask:
    name: str = TASK_NAME
    categories: tuple[str, ...] = CATEGORIES
    default_categories: tuple[str, ...] = DEFAULT_CATEGORIES
    perturbations: tuple[str, ...] = perturb.PERTURBATIONS
    accuracy: str = "BFCL's AST checker (its `ast_checker` semantics: names, required/optional parameters, types, values)"
    dotted_names: bool = True
    undecodable_unit: str = "output"
    paper_table1: Mapping[str, float] = field(default_factory=dict, compare=False)
    """The paper reports BFCL v4 multi-turn only (single-turn rows show n/a)."""

    def load_entries(self, categories) -> list:
        return load_entries(tuple(categories))

    def entry_from_json(self, row: dict):
        return SingleTurnEntry.from_json(row)

    def category_of(self, entry_id: str) -> str:
        return category_of(entry_id)

    def split(self, entries: list, test_fraction: float, seed: int) -> dict:
        return split_ids(entries, test_fraction, seed)

    def episode(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> SingleTurnEpisode:
        return SingleTurnEpisode(entry, cfg, reward_token)

    def initial_messages(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> list[dict]:
        return initial_messages(entry, cfg, reward_token)

    def score(self, entry, result: list) -> EntryScore:
        calls = [c for turn in result for step in turn for c in step] if isinstance(result, list) else []
        return score_text(entry, "[" + ", ".join(calls) + "]")

    def expert_script(self, entry) -> Script:
        return (tuple(perturb.expert_calls(entry)),)

    def replay_texts(self, entry, cfg: ProtocolConfig, script: Script, final_text: str) -> list[str]:
        return ["[" + ", ".join(c for turn in script for c in turn) + "]"]

    def perturb(self, entry, kind: str, rng: random.Random) -> Perturbation | None:
        return perturb.perturb(entry, kind, rng)

    def reward_defined(self, reward: str, protocol: str) -> bool:
        """One output under either protocol: every reward is BFCL's AST verdict (partial credit: gold calls
        matched)."""
        return True

    def partial_credit(self, entry, score: dict, result: list, protocol: str) -> tuple[float, str]:
        return float(score["partial_credit"]), "gold_calls_matched"

    def score_result(self, entry, result, decoding: str, underscore_to_dot: bool = False) -> tuple[EntryScore, int]:
        """(scores, 1 if the output did not decode) of a BFCL result row (`scoring.score_single_turn`)."""
        return score_single_turn(entry, result, decoding, underscore_to_dot)

    def failure_kind(self, entry, result: Any, success: bool) -> str | None:
        """BFCL's checker wants exactly the gold's calls: the called names must equal the gold's (a multiset)."""
        gold = [next(iter(g)) for g in entry.possible_answer]
        return failures.failure_kind(failures.result_calls(result), gold, success, exact=True)

    def result_steps(self, result: Any) -> Iterable[Any]:
        """A single-turn result is one step (the model's one output)."""
        return (result,)

    def undetected_decoding(self, results: Iterable[Any]) -> tuple[str, str]:
        return "prompt", "outputs are text without calls (a prompt-mode model's results)"


TASK = SingleTurnTask()
