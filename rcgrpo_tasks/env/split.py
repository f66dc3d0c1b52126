"""The splits of the pipeline's task (the prepare_data stage): its entries from bfcl-eval, split by the
task's rule (`Task.split`, `env.tasks`) into train, dev and test (held out).

- test: `test_fraction` of the entries, drawn first; only reported, never used for a choice;
- dev: `dev_fraction` of the entries, carved from the train side by the same rule under its own seed
  (`seed + 1`): the design choices (RL's levers, step counts, thresholds; RCTP's margin curve) are made on
  it. No training stage reads it (they read the train side); 0 = no dev split;

- multi_turn: by numeric id, the same numeric id on the same side in every category
  (`env.multi_turn.entries.split_by_numeric_id`; 10% = 80 test entries, the paper's scheme; with the dev
  split 80 dev and 640 train);
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
    dev_fraction: float = 0.1
    """Fraction of ALL entries carved from the train side as the dev split (single_turn: 10 % of each category,
    40 of simple_python's 400; multi_turn: 20 numeric ids x 4 categories); 0 = none."""
    seed: int = 0
    """Seed of the split; change it to draw another held-out set (the dev split draws with `seed + 1`)."""

    def __post_init__(self) -> None:
        task = tasks.get_task(self.task)
        if self.categories is not None:
            unknown = sorted(set(self.categories) - set(task.categories))
            if unknown or not self.categories:
                raise ValueError(f"categories of task {self.task!r} must be a non-empty subset of "
                                 f"{list(task.categories)} or null (the task's defaults), got {list(self.categories)}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if not 0.0 <= self.dev_fraction < 1.0 - self.test_fraction:
            raise ValueError(f"dev_fraction must be in [0, 1 - test_fraction = {1.0 - self.test_fraction:g}), "
                             f"got {self.dev_fraction}")

    @property
    def chosen_categories(self) -> tuple[str, ...]:
        return tuple(self.categories) if self.categories else tasks.get_task(self.task).default_categories


def prepare(config: PrepareDataConfig) -> tuple[list, dict]:
    task = tasks.get_task(config.task)
    entries = task.load_entries(config.chosen_categories)
    split = task.split(entries, config.test_fraction, config.seed)
    split.update(carve_dev(task, entries, split, config))
    split.update(task=task.name, seed=config.seed, test_fraction=config.test_fraction,
                 dev_fraction=config.dev_fraction, categories=list(config.chosen_categories))
    return entries, split


def carve_dev(task, entries: list, split: dict, config: PrepareDataConfig) -> dict:
    """`{"train": [ids], "dev": [ids], ...}`: the dev split drawn from the train side by the task's own rule
    (multi_turn keeps numeric-id families together; single_turn stratifies by category), as a fraction of
    ALL entries (`dev_fraction / (1 - test_fraction)` of the train side), under seed `seed + 1`. Extra keys
    the rule returns for its drawn side (`test_numeric_ids`) come back as `dev_...`."""
    if config.dev_fraction == 0.0:
        return {"dev": []}
    train_ids = set(split["train"])
    train = [e for e in entries if e.id in train_ids]
    drawn = task.split(train, config.dev_fraction / (1.0 - config.test_fraction), config.seed + 1)
    extra = {f"dev_{k[len('test_'):]}": v for k, v in drawn.items() if k.startswith("test_")}
    return {"train": drawn["train"], "dev": drawn["test"], **extra}


def split_metrics(split: dict) -> dict:
    counts: dict[str, dict[str, int]] = {}
    for side in ("train", "dev", "test"):
        for entry_id in split[side]:
            counts.setdefault(tasks.task_of_id(entry_id).category_of(entry_id),
                              {"train": 0, "dev": 0, "test": 0})[side] += 1
    return {"task": split.get("task", tasks.LEGACY_TASK), "n_train": len(split["train"]),
            "n_dev": len(split["dev"]), "n_test": len(split["test"]),
            "per_category": counts}
