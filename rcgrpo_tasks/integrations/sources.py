"""Which BFCL entries a TRL dataset holds: the installed bfcl-eval data, a prepared entries file, or one side of
a prepared split (the pipeline's prepare_data outputs), through the pipeline's own readers (`env.entries`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rcgrpo_tasks.env import entries as entry_files
from rcgrpo_tasks.env import tasks
from rcgrpo_tasks.env.contract import Task
from rcgrpo_tasks.ops.inputs import InputError


def task_categories(task: Task, categories: Iterable[str] | None) -> tuple[str, ...]:
    """The categories asked for (None: the task's defaults), each one of the task's; ValueError naming the rest."""
    chosen = tuple(categories) if categories is not None else task.default_categories
    unknown = [c for c in chosen if c not in task.categories]
    if unknown or not chosen:
        raise ValueError(f"categories of the {task.name} task must be a non-empty subset of {list(task.categories)}, "
                         f"got {list(chosen)}")
    return chosen


def task_entries(task_name: str, categories: Iterable[str] | None = None, side: str | None = None,
                 entries_path: str | Path | None = None, split_path: str | Path | None = None) -> list:
    """The entries of one task, in file order, of the given categories:
    - `split_path` and `side` ("train", "rl", "dev", "test"): that side of a prepare_data split, its entries read
      from `entries_path` (None: the installed bfcl-eval data);
    - `entries_path` alone: every entry of that file (a prepare_data `entries.jsonl`);
    - neither: every entry of the installed bfcl-eval data.
    InputError (naming the file) for an entry of another task or an empty selection."""
    task = tasks.get_task(task_name)
    chosen_categories = task_categories(task, categories)
    if (side is None) != (split_path is None):
        raise ValueError(f"side and split_path go together (one side of a prepare_data split.json), got side={side!r}, "
                         f"split_path={split_path!r}")
    if split_path is not None:
        chosen = entry_files.split_entries(entries_path, split_path, side, chosen_categories)
    elif entries_path is not None:
        chosen = [e for e in entry_files.read_entries(entries_path).values() if e.category in chosen_categories]
    else:
        chosen = task.load_entries(chosen_categories)
    others = [e.id for e in chosen if e.task != task.name]
    if others:
        raise InputError(f"{split_path or entries_path}: {len(others)} entries of another task than {task.name}, "
                         f"e.g. {others[:3]}")
    if not chosen:
        raise InputError(f"{split_path or entries_path or 'bfcl-eval data'}: no {task.name} entries in categories "
                         f"{list(chosen_categories)}")
    return chosen
