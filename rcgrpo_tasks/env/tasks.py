"""THE registry of the tasks the pipeline trains and evaluates on, behind one contract (`env.contract.Task`).

`prepare_data.task` picks the task: prepare_data writes that task's entries (each JSON row names its task)
and every later stage dispatches on the entry it reads (`task_of(entry)`), so no stage branches on the task.
A task supplies what differs between benchmarks: its entries and split, the prompt and the episode (how
model text moves a conversation forward), the scorer, the expert script and the near-miss perturbations.
What is shared (the rollout engine, reward tokens, data balancing and pairing, the trainers, evaluation
statistics) never looks inside an entry.

- `multi_turn` (`env.multi_turn`): BFCL v4 multi-turn, the paper's task, executed in isolated environments.
- `single_turn` (`env.single_turn`): BFCL v4's single-turn AST categories: one question, one answer, BFCL's
  AST checker.

A task is one package under `env/` whose `task` module holds `TASK` (see `env.multi_turn.task`); registering
it is its import below and its name in `TASKS`. The task a pipeline runs is params `prepare_data.task` alone.
One name, decided here and nowhere else:
- `LEGACY_TASK`: the task of data that names none (entries rows, split files and evaluation rows written
  before tasks existed, whose format was multi-turn only; result files of no known id). It is a fact
  about those files, not a choice: it stays multi_turn whatever the default.
"""

from __future__ import annotations

import functools

from rcgrpo_tasks.env.contract import Entry, Task
from rcgrpo_tasks.env.multi_turn.task import TASK as MULTI_TURN
from rcgrpo_tasks.env.single_turn.task import TASK as SINGLE_TURN

TASKS: dict[str, Task] = {t.name: t for t in (MULTI_TURN, SINGLE_TURN)}
LEGACY_TASK: str = MULTI_TURN.name
"""The task of rows and files that name none: written before tasks existed, when every file was multi-turn."""
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
ALL_CATEGORIES: tuple[str, ...] = tuple(c for t in TASKS.values() for c in t.categories)
"""Every category of every task, in each task's order (tables list categories in this order)."""
ALL_PERTURBATIONS: tuple[str, ...] = tuple(dict.fromkeys(k for t in TASKS.values() for k in t.perturbations))


def legacy_task() -> Task:
    """The task of data that names none (`LEGACY_TASK`)."""
    return TASKS[LEGACY_TASK]


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


def entry_from_json(row: dict) -> Entry:
    """An entries-file row of any task (rows without `task` are `LEGACY_TASK`'s, the format's first layout)."""
    return get_task(row.get("task", LEGACY_TASK)).entry_from_json(row)


@functools.cache
def entries_by_id() -> dict[str, Entry]:
    """Every entry of every task and category straight from bfcl-eval, by id (`rcgrpo score`)."""
    return {e.id: e for t in TASKS.values() for e in t.load_entries(t.categories)}


def task_of_entries(entries) -> Task:
    """The one task of a set of entries; a mix is an error (prepare_data writes one task)."""
    names = {e.task for e in entries}
    if len(names) != 1:
        raise ValueError(f"entries of {len(names)} tasks ({sorted(names)}); a pipeline runs one task")
    return TASKS[names.pop()]


def paper_overall(task: str, label: str) -> float | None:
    """The paper's Table 1 overall accuracy of a row on a task (None where it reports none)."""
    return TASKS[task].paper_table1.get(label) if task in TASKS else None
