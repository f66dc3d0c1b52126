"""The contract between the pipeline and a task: what a benchmark supplies (`Task`), what its entries and
episodes look like from outside (`Entry`, `Episode`), and the call scripts its expert and near misses are
(`Script`, `Perturbation`).

Everything shared (the rollout engine, reward tokens, data balancing and pairing, the trainers, evaluation
statistics) is written against these types and never looks inside an entry. A task is one package under
`env/` (`env.multi_turn`, `env.single_turn`) registered in `env.tasks`; this module imports none of them.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rcgrpo_tasks.env.prompt import ProtocolConfig
from rcgrpo_tasks.env.rewards import EntryScore

Script = tuple[tuple[str, ...], ...]
"""Calls per turn, as BFCL call strings (the format of a multi-turn `ground_truth`; one turn for single-turn)."""


@dataclass(frozen=True)
class Perturbation:
    """A changed call script and what was changed."""

    kind: str
    turns: Script
    detail: str


class Entry(Protocol):
    """One benchmark question of some task, as the shared code sees it."""

    @property
    def task(self) -> str:
        """The name of the entry's task (`env.tasks.task_of` dispatches on it)."""

    @property
    def id(self) -> str: ...

    @property
    def category(self) -> str: ...

    def to_json(self) -> dict: ...


class Episode(Protocol):
    """One rollout's conversation: feed it model outputs with `step` until `done`."""

    entry: Any
    messages: list[dict]
    """The chat so far (system prompt, user turns, model outputs, environment messages)."""
    result: list
    """BFCL's result layout: turns -> steps -> call strings."""
    turn: int
    n_steps: int
    """Model outputs so far."""
    done: bool
    termination: str | None

    def step(self, model_text: str) -> list[dict]:
        """Record the model's output, act on it, and return the messages the environment appends."""

    def terminate(self, reason: str) -> None:
        """End the episode from outside (context limit, generation error)."""

    def truncate(self, n_messages: int, reason: str) -> None:
        """End the episode, dropping messages after the first `n_messages` (what overflows the context)."""

    def score(self) -> EntryScore:
        """Every score of the trajectory so far."""


class Task(Protocol):
    """What a benchmark supplies to the pipeline. Hashable (stages collect the tasks of entries in sets)."""

    name: str
    categories: tuple[str, ...]
    """Every category the task knows."""
    default_categories: tuple[str, ...]
    """What prepare_data takes when params name none."""
    perturbations: tuple[str, ...]
    """Near-miss kinds `perturb` knows."""
    accuracy: str
    """What an evaluation's accuracy is, in words (report footnotes)."""
    dotted_names: bool
    """Function names may hold dots (`math.factorial`): `--underscore-to-dot` applies."""
    undecodable_unit: str
    """What a result that does not decode loses: a `step` (dropped) or the whole `output`."""
    paper_table1: Mapping[str, float]
    """The RC-GRPO paper's Table 1 overall accuracy (%) per report row on this task (empty: not reported)."""

    def load_entries(self, categories) -> list[Entry]: ...
    def entry_from_json(self, row: dict) -> Entry: ...
    def category_of(self, entry_id: str) -> str: ...
    def split(self, entries: list, test_fraction: float, seed: int) -> dict: ...
    def episode(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> Episode: ...
    def initial_messages(self, entry, cfg: ProtocolConfig, reward_token: str | None = None) -> list[dict]: ...
    def score(self, entry, result: list) -> EntryScore: ...
    def expert_script(self, entry) -> Script: ...
    def replay_texts(self, entry, cfg: ProtocolConfig, script: Script, final_text: str) -> list[str]: ...
    def perturb(self, entry, kind: str, rng: random.Random) -> Perturbation | None: ...
    def reward_defined(self, reward: str, protocol: str) -> bool: ...
    def partial_credit(self, entry, score: dict, result: list, protocol: str) -> tuple[float, str]: ...
    def score_result(self, entry, result, decoding: str, underscore_to_dot: bool = False) -> tuple[EntryScore, int]: ...

    def failure_kind(self, entry, result: Any, success: bool) -> str | None:
        """None for a success, else what the failure is made of (`env.failures.FAILURE_KINDS`)."""

    def result_steps(self, result: Any) -> Iterable[Any]:
        """The model steps of a BFCL result row, each decoded on its own (`env.results.row_kind`)."""

    def undetected_decoding(self, results: Iterable[Any]) -> tuple[str, str]:
        """(decoding, why) of a result file no row of which tells its decoding by itself."""
