"""The multi-turn task (BFCL v4 multi-turn, the paper's task) behind the pipeline's `Task` contract."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rcgrpo_tasks.env import failures
from rcgrpo_tasks.env.contract import Perturbation, Script
from rcgrpo_tasks.env.multi_turn import decode, perturb
from rcgrpo_tasks.env.multi_turn.entries import (
    CATEGORIES,
    TASK_NAME,
    Entry,
    category_of,
    load_entries,
    split_by_numeric_id,
)
from rcgrpo_tasks.env.multi_turn.episode import Episode, initial_messages, replay_texts
from rcgrpo_tasks.env.multi_turn.scoring import call_recall, score_entry
from rcgrpo_tasks.env.paper import PAPER_TABLE1_OVERALL
from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.env.rewards import EntryScore


@dataclass(frozen=True)
class MultiTurnTask:
    name: str = TASK_NAME
    categories: tuple[str, ...] = CATEGORIES
    default_categories: tuple[str, ...] = CATEGORIES
    perturbations: tuple[str, ...] = perturb.PERTURBATIONS
    accuracy: str = ("the paper reward (final state + every gold call) under the paper protocol, the official "
                     "BFCL verdict under the official one")
    dotted_names: bool = False
    undecodable_unit: str = "step"
    paper_table1: Mapping[str, float] = field(default_factory=lambda: dict(PAPER_TABLE1_OVERALL), compare=False)

    def load_entries(self, categories) -> list:
        return load_entries(tuple(categories))

    def entry_from_json(self, row: dict):
        return Entry.from_json(row)

    def category_of(self, entry_id: str) -> str:
        return category_of(entry_id)

    def split(self, entries: list, test_fraction: float, seed: int) -> dict:
        return split_by_numeric_id(entries, test_fraction, seed)

    def episode(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> Episode:
        return Episode(entry, cfg, reward_token)

    def initial_messages(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> list[dict]:
        return initial_messages(entry, cfg, reward_token)

    def score(self, entry, result: list) -> EntryScore:
        return score_entry(entry, result)

    def expert_script(self, entry) -> Script:
        return tuple(tuple(t) for t in entry.ground_truth)

    def replay_texts(self, entry, cfg: ProtocolConfig, script: Script, final_text: str) -> list[str]:
        return replay_texts(cfg.protocol, script, final_text)

    def perturb(self, entry, kind: str, rng: random.Random) -> Perturbation | None:
        return perturb.perturb(entry, kind, rng)

    def reward_defined(self, reward: str, protocol: str) -> bool:
        """The paper protocol merges every turn into one, which the official checker always rejects as
        force_terminated and which has no per-turn credit: only the paper reward is defined there."""
        return protocol != "paper" or reward == "paper_reward"

    def partial_credit(self, entry, score: dict, result: list, protocol: str) -> tuple[float, str]:
        """(value, kind) an evaluation reports: turns passed (official), gold-call recall (paper)."""
        if protocol == "paper":
            return call_recall(entry, result), "gold_call_recall"
        return float(score["partial_credit"]), "turns_passed"

    def score_result(self, entry, result, decoding: str, underscore_to_dot: bool = False) -> tuple[EntryScore, int]:
        """(scores, steps dropped undecoded) of a BFCL result row, decoded as `bfcl evaluate` decodes it."""
        turns, dropped = decode.decode_result(result, decoding)
        return score_entry(entry, turns), dropped

    def failure_kind(self, entry, result: Any, success: bool) -> str | None:
        """The paper reward allows extra calls: the called names must cover the gold's (a multiset)."""
        gold = failures.call_names(c for turn in entry.ground_truth for c in turn)
        return failures.failure_kind(failures.result_calls(result), gold.elements(), success, exact=False)

    def result_steps(self, result: Any) -> Iterable[Any]:
        """Each step of each turn; a result that is not a list (an inference error) has none."""
        return decode.result_steps(result)

    def undetected_decoding(self, results: Iterable[Any]) -> tuple[str, str]:
        return decode.detect(results)


TASK = MultiTurnTask()
