"""The held-out split: BFCL v4 multi-turn entries from bfcl-eval split by numeric id (the prepare_data stage).

The same numeric id goes to the same side in every category (miss_func_17 is a variant of base_17, so
splitting them apart would leak the test question into training). With the default 10% that is 20
numeric ids x 4 categories = 80 test entries and 720 train, the paper's scheme (its exact ids are not
published).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rcgrpo_tasks.env import bfcl


@dataclass(frozen=True)
class PrepareDataConfig:
    categories: tuple[str, ...] = bfcl.CATEGORIES
    """BFCL v4 multi-turn categories to include."""
    test_fraction: float = 0.1
    """Fraction of numeric ids held out (paper: 80 of 800 entries)."""
    seed: int = 0
    """Seed of the split; change it to draw another held-out set."""

    def __post_init__(self):
        unknown = set(self.categories) - set(bfcl.CATEGORIES)
        if unknown or not self.categories:
            raise ValueError(f"categories must be a non-empty subset of {bfcl.CATEGORIES}, got {self.categories}")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")


def split_ids(entries: list[bfcl.Entry], test_fraction: float, seed: int) -> dict[str, list[str]]:
    """Seeded split by numeric id; every entry sharing a numeric id lands on the same side."""
    numeric = sorted({e.numeric_id for e in entries})
    n_test = max(1, round(len(numeric) * test_fraction))
    test_nums = set(random.Random(seed).sample(numeric, n_test))
    train = [e.id for e in entries if e.numeric_id not in test_nums]
    test = [e.id for e in entries if e.numeric_id in test_nums]
    return {"train": train, "test": test, "test_numeric_ids": sorted(test_nums)}


def prepare(config: PrepareDataConfig) -> tuple[list[bfcl.Entry], dict]:
    entries = bfcl.load_entries(config.categories)
    split = split_ids(entries, config.test_fraction, config.seed)
    split.update(seed=config.seed, test_fraction=config.test_fraction, categories=list(config.categories))
    return entries, split


def split_metrics(split: dict) -> dict:
    counts: dict[str, dict[str, int]] = {}
    for side in ("train", "test"):
        for entry_id in split[side]:
            counts.setdefault(bfcl.category_of(entry_id), {"train": 0, "test": 0})[side] += 1
    return {"n_train": len(split["train"]), "n_test": len(split["test"]), "per_category": counts}
