"""The held-out split of the pipeline's task (the prepare_data stage): its entries from bfcl-eval, split
by the task's rule (`Task.split`, `env.tasks`).

- multi_turn: by numeric id, the same numeric id on the same side in every category
  (`env.multi_turn.entries.split_by_numeric_id`; 10% = 80 test entries and 720 train, the paper's scheme);
- single_turn: stratified by category, `round(n * test_fraction)` of each category held out
  (`env.single_turn.entries.split_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rcgrpo_tasks.env import tasks


@dataclass(frozen=True)
class PrepareDataConfig:
    task: str = tasks.DEFAULT_TASK
    """The benchmark the whole pipeline runs (`env.tasks.TASK_NAMES`): every later stage reads its entries."""
    categories: tuple[str, ...] | None = ("simple_python", "multiple")
    """Categories of the task to include (the default: the default task's two one-call categories, as
    params.yaml; another task names its own); null = the task's defaults (multi_turn: all four; single_turn:
    simple_python, multiple, parallel, parallel_multiple)."""
    test_fraction: float = 0.1
    """Fraction held out (multi_turn: of numeric ids, paper: 80 of 800 entries; single_turn: of each category)."""
    seed: int = 0
    """Seed of the split; change it to draw another held-out set."""

    def __post_init__(self) -> None:
        task = tasks.get_task(self.task)
        if self.categories is not None:
            unknown = sorted(set(self.categories) - set(task.categories))
            if unknown or not self.categories:
                raise ValueError(f"categories of task {self.task!r} must be a non-empty subset of "
                                 f"{list(task.categories)} or null (the task's defaults), got {list(self.categories)}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")

    @property
    def chosen_categories(self) -> tuple[str, ...]:
        return tuple(self.categories) if self.categories else tasks.get_task(self.task).default_categories


def prepare(config: PrepareDataConfig) -> tuple[list, dict]:
    task = tasks.get_task(config.task)
    entries = task.load_entries(config.chosen_categories)
    split = task.split(entries, config.test_fraction, config.seed)
    split.update(task=task.name, seed=config.seed, test_fraction=config.test_fraction,
                 categories=list(config.chosen_categories))
    return entries, split


def split_metrics(split: dict) -> dict:
    counts: dict[str, dict[str, int]] = {}
    for side in ("train", "test"):
        for entry_id in split[side]:
            counts.setdefault(tasks.task_of_id(entry_id).category_of(entry_id), {"train": 0, "test": 0})[side] += 1
    return {"task": split.get("task", tasks.LEGACY_TASK), "n_train": len(split["train"]), "n_test": len(split["test"]),
            "per_category": counts}
