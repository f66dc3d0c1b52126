"""The splits of the pipeline's task (the prepare_data stage): its entries from bfcl-eval, split by the
task's rule (`Task.split`, `env.tasks`) into train (the SFT part), rl, dev and test (held out).

- test: `test_fraction` of the entries, drawn first; only reported, never used for a choice;
- dev: `dev_fraction` of the entries, carved from the train side by the same rule under its own seed
  (`seed + 1`): the design choices (RL's levers, step counts, thresholds; RCTP's margin curve) are made on
  it. No training stage reads it; 0 = no dev split;
- rl: `rl_fraction` of the entries, carved next by the same rule (`seed + 2`): RL's prompts (its pool and
  probe). No fine-tuning stage reads them (SFT, sample_policy's RCTP pairs and RCTP read train, the rest),
  so RL learns on prompts SFT never saw and what it learns has to transfer; 0 = RL samples the train side;

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
    task: str
    """The benchmark the whole pipeline runs (`env.tasks.TASK_NAMES`): every later stage reads its entries."""
    categories: tuple[str, ...] | None
    """Categories of the task to include (the default: the default task's two one-call categories, as
    params.yaml; another task names its own); null = the task's defaults (multi_turn: all four; single_turn:
    simple_python, multiple, parallel, parallel_multiple)."""
    test_fraction: float
    """Fraction held out (multi_turn: of numeric ids, paper: 80 of 800 entries; single_turn: of each category)."""
    dev_fraction: float
    """Fraction of ALL entries carved from the train side as the dev split (single_turn: 10 % of each category,
    40 of simple_python's 400; multi_turn: 20 numeric ids x 4 categories); 0 = none."""
    rl_fraction: float
    """Fraction of ALL entries carved from the train side (after dev) as RL's own prompts (single_turn: 20 % of
    each category); the train side left is the SFT part. 0 = none (RL samples the SFT part's prompts)."""
    seed: int
    """Seed of the split; change it to draw another held-out set (the dev split draws with `seed + 1`, rl
    with `seed + 2`)."""

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
        left = 1.0 - self.test_fraction - self.dev_fraction
        if not 0.0 <= self.rl_fraction < left:
            raise ValueError(f"rl_fraction must be in [0, 1 - test_fraction - dev_fraction = {left:g}), "
                             f"got {self.rl_fraction}")

    @property
    def chosen_categories(self) -> tuple[str, ...]:
        return tuple(self.categories) if self.categories else tasks.get_task(self.task).default_categories


def prepare(config: PrepareDataConfig) -> tuple[list, dict]:
    task = tasks.get_task(config.task)
    entries = task.load_entries(config.chosen_categories)
    split = task.split(entries, config.test_fraction, config.seed)
    split.update(carve(task, entries, split, "dev", config.dev_fraction, config.test_fraction, config.seed + 1))
    split.update(carve(task, entries, split, "rl", config.rl_fraction, config.test_fraction + config.dev_fraction,
                       config.seed + 2))
    split.update(task=task.name, seed=config.seed, test_fraction=config.test_fraction,
                 dev_fraction=config.dev_fraction, rl_fraction=config.rl_fraction,
                 categories=list(config.chosen_categories))
    return entries, split


def carve(task, entries: list, split: dict, side: str, fraction: float, taken: float, seed: int) -> dict:
    """`{"train": [ids], side: [ids], ...}`: `side` drawn from the train side by the task's own rule (multi_turn
    keeps numeric-id families together; single_turn stratifies by category), as `fraction` of ALL entries
    (`fraction / (1 - taken)` of the train side, where `taken` is the fraction already drawn), under `seed`.
    Extra keys the rule returns for its drawn side (`test_numeric_ids`) come back as `<side>_...`."""
    if fraction == 0.0:
        return {side: []}
    train_ids = set(split["train"])
    train = [e for e in entries if e.id in train_ids]
    drawn = task.split(train, fraction / (1.0 - taken), seed)
    extra = {f"{side}_{k[len('test_'):]}": v for k, v in drawn.items() if k.startswith("test_")}
    return {"train": drawn["train"], side: drawn["test"], **extra}


def split_metrics(split: dict) -> dict:
    sides = ("train", "rl", "dev", "test")
    counts: dict[str, dict[str, int]] = {}
    for side in sides:
        for entry_id in split.get(side, []):
            counts.setdefault(tasks.task_of_id(entry_id).category_of(entry_id), dict.fromkeys(sides, 0))[side] += 1
    return {"task": split.get("task", tasks.LEGACY_TASK), **{f"n_{s}": len(split.get(s, [])) for s in sides},
            "per_category": counts}
