"""The tasks the pipeline trains and evaluates on, behind one interface, chosen once.

`prepare_data.task` picks the task: prepare_data writes that task's entries (each JSON row names its task)
and every later stage dispatches on the entry it reads (`task_of(entry)`), so no stage branches on the task.
A task supplies what differs between benchmarks (`Task`): its entries and split, the prompt and the episode
(how model text moves a conversation forward), the scorer, the expert script and the near-miss
perturbations. What is shared (the rollout engine, reward tokens, data balancing and pairing, the trainers,
evaluation statistics) never looks inside an entry.

- `multi_turn`: BFCL v4 multi-turn (`env.bfcl`, `env.protocols`, `env.scoring`, `env.perturb`): the paper's
  task, executed in isolated environments.
- `single_turn`: BFCL v4's single-turn AST categories (`env.single_turn`, `env.single_turn_episode`,
  `env.single_turn_perturb`): one question, one answer, BFCL's AST checker.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any, Protocol

from rcgrpo_tasks.env import bfcl, perturb, results, single_turn, single_turn_episode, single_turn_perturb
from rcgrpo_tasks.env.protocols import Episode, ProtocolConfig, initial_messages, replay_texts
from rcgrpo_tasks.env.scoring import EntryScore, call_recall, score_entry

Script = perturb.Script
Perturbation = perturb.Perturbation


class Task(Protocol):
    """What a benchmark supplies to the pipeline."""

    name: str
    categories: tuple[str, ...]
    """Every category the task knows."""
    default_categories: tuple[str, ...]
    """What prepare_data takes when params name none."""
    perturbations: tuple[str, ...]
    """Near-miss kinds `perturb` knows."""
    accuracy: str
    """What an evaluation's accuracy is, in words (report footnotes)."""
    single_output: bool
    """A BFCL result of the task is one model output (single-turn), not turns of steps (`rcgrpo score`)."""
    dotted_names: bool
    """Function names may hold dots (`math.factorial`): `--underscore-to-dot` applies."""
    undecodable_unit: str
    """What a result that does not decode loses: a `step` (dropped) or the whole `output`."""

    def load_entries(self, categories) -> list: ...
    def entry_from_json(self, row: dict) -> Any: ...
    def category_of(self, entry_id: str) -> str: ...
    def split(self, entries: list, test_fraction: float, seed: int) -> dict: ...
    def episode(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> Any: ...
    def initial_messages(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> list[dict]: ...
    def score(self, entry, result: list) -> EntryScore: ...
    def expert_script(self, entry) -> Script: ...
    def replay_texts(self, entry, cfg: ProtocolConfig, script: Script, final_text: str) -> list[str]: ...
    def perturb(self, entry, kind: str, rng: random.Random) -> Perturbation | None: ...
    def reward_defined(self, reward: str, protocol: str) -> bool: ...
    def partial_credit(self, entry, score: dict, result: list, protocol: str) -> tuple[float, str]: ...
    def score_result(self, entry, result, decoding: str, underscore_to_dot: bool = False) -> tuple[EntryScore, int]: ...


@dataclass(frozen=True)
class MultiTurnTask:
    name: str = "multi_turn"
    categories: tuple[str, ...] = bfcl.CATEGORIES
    default_categories: tuple[str, ...] = bfcl.CATEGORIES
    perturbations: tuple[str, ...] = perturb.PERTURBATIONS
    accuracy: str = ("the paper reward (final state + every gold call) under the paper protocol, the official "
                     "BFCL verdict under the official one")
    single_output: bool = False
    dotted_names: bool = False
    undecodable_unit: str = "step"

    def load_entries(self, categories) -> list:
        return bfcl.load_entries(tuple(categories))

    def entry_from_json(self, row: dict):
        return bfcl.Entry.from_json(row)

    def category_of(self, entry_id: str) -> str:
        return bfcl.category_of(entry_id)

    def split(self, entries: list, test_fraction: float, seed: int) -> dict:
        return bfcl.split_by_numeric_id(entries, test_fraction, seed)

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
        turns, dropped = results.decode_result(result, decoding)
        return score_entry(entry, turns), dropped


@dataclass(frozen=True)
class SingleTurnTask:
    name: str = single_turn.TASK
    categories: tuple[str, ...] = single_turn.CATEGORIES
    default_categories: tuple[str, ...] = single_turn.DEFAULT_CATEGORIES
    perturbations: tuple[str, ...] = single_turn_perturb.PERTURBATIONS
    accuracy: str = "BFCL's AST checker (its `ast_checker` semantics: names, required/optional parameters, types, values)"
    single_output: bool = True
    dotted_names: bool = True
    undecodable_unit: str = "output"

    def load_entries(self, categories) -> list:
        return single_turn.load_entries(tuple(categories))

    def entry_from_json(self, row: dict):
        return single_turn.SingleTurnEntry.from_json(row)

    def category_of(self, entry_id: str) -> str:
        return single_turn.category_of(entry_id)

    def split(self, entries: list, test_fraction: float, seed: int) -> dict:
        return single_turn.split_ids(entries, test_fraction, seed)

    def episode(self, entry, cfg: ProtocolConfig, reward_token: str | None = None):
        return single_turn_episode.SingleTurnEpisode(entry, cfg, reward_token)

    def initial_messages(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> list[dict]:
        return single_turn_episode.initial_messages(entry, cfg, reward_token)

    def score(self, entry, result: list) -> EntryScore:
        calls = [c for turn in result for step in turn for c in step] if isinstance(result, list) else []
        return single_turn_episode.score_text(entry, "[" + ", ".join(calls) + "]")

    def expert_script(self, entry) -> Script:
        return (tuple(single_turn_perturb.expert_calls(entry)),)

    def replay_texts(self, entry, cfg: ProtocolConfig, script: Script, final_text: str) -> list[str]:
        return ["[" + ", ".join(c for turn in script for c in turn) + "]"]

    def perturb(self, entry, kind: str, rng: random.Random) -> Perturbation | None:
        return single_turn_perturb.perturb(entry, kind, rng)

    def reward_defined(self, reward: str, protocol: str) -> bool:
        """One output under either protocol: every reward is BFCL's AST verdict (partial credit: gold calls
        matched)."""
        return True

    def partial_credit(self, entry, score: dict, result: list, protocol: str) -> tuple[float, str]:
        return float(score["partial_credit"]), "gold_calls_matched"

    def score_result(self, entry, result, decoding: str, underscore_to_dot: bool = False) -> tuple[EntryScore, int]:
        """(scores, 1 if the output did not decode) of a BFCL result row (`results.score_single_turn`)."""
        return results.score_single_turn(entry, result, decoding, underscore_to_dot)


TASKS: dict[str, Task] = {t.name: t for t in (MultiTurnTask(), SingleTurnTask())}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
ALL_CATEGORIES: tuple[str, ...] = tuple(c for t in TASKS.values() for c in t.categories)
"""Every category of every task, in each task's order (tables list categories in this order)."""
ALL_PERTURBATIONS: tuple[str, ...] = tuple(dict.fromkeys(k for t in TASKS.values() for k in t.perturbations))


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {list(TASKS)}")
    return TASKS[name]


def task_of(entry) -> Task:
    """The task an entry belongs to (its class says it)."""
    return TASKS[entry.task]


def task_of_id(entry_id: str) -> Task:
    """The task whose categories name this id (`multi_turn_base_3`, `simple_python_3`)."""
    for task in TASKS.values():
        try:
            task.category_of(entry_id)
        except ValueError:
            continue
        return task
    raise ValueError(f"not a BFCL v4 entry id of any task: {entry_id!r}")


def entry_from_json(row: dict):
    """An entries-file row of any task (rows without `task` are multi-turn, the format's first layout)."""
    return get_task(row.get("task", "multi_turn")).entry_from_json(row)


@functools.cache
def entries_by_id() -> dict[str, Any]:
    """Every entry of every task and category straight from bfcl-eval, by id (`rcgrpo score`)."""
    return {e.id: e for t in TASKS.values() for e in t.load_entries(t.categories)}


def task_of_entries(entries) -> Task:
    """The one task of a set of entries; a mix is an error (prepare_data writes one task)."""
    names = {e.task for e in entries}
    if len(names) != 1:
        raise ValueError(f"entries of {len(names)} tasks ({sorted(names)}); a pipeline runs one task")
    return TASKS[names.pop()]
