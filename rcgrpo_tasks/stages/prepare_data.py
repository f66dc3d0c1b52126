"""Stage `prepare_data`: BFCL v4 multi-turn entries from bfcl-eval, and the seeded 90/10 split.

Reads the installed `bfcl-eval` package's data (four categories, 200 entries each, ground truth included).
Writes (paths from `dvc.yaml`):
- `--entries`: one `Entry.to_json()` per line (questions per turn, initial_config, involved classes,
  ground truth, missed functions) — the frozen snapshot every later stage reads;
- `--split`: `{"train": [ids], "test": [ids], ...}`: a seeded split by *numeric id*: the same numeric id
  goes to the same side in every category (miss_func_17 is a variant of base_17, so splitting them apart
  would leak the test question into training). With the default 10% that is 20 numeric ids x 4
  categories = 80 test entries and 720 train, the paper's scheme (its exact ids are not published);
- `--metrics`: counts per category and side.

Run: `rcgrpo prepare-data --params params.yaml --entries data/entries.jsonl --split data/split.json
--metrics metrics/prepare_data.json` (what `dvc repro prepare_data` does).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import typer

from rcgrpo_tasks.env import bfcl
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import load_config
from rcgrpo_tasks.ops.io import write_json, write_jsonl


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


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="Params file (section `prepare_data`)."),
    entries: Path = typer.Option(..., help="Output: entries JSONL."),
    split: Path = typer.Option(..., help="Output: split JSON."),
    metrics: Path = typer.Option(None, help="Output: counts JSON."),
) -> None:
    """Load BFCL v4 multi-turn from bfcl-eval and split it 90/10 by numeric id."""
    with cli_errors():
        config = load_config(PrepareDataConfig, params, "prepare_data")
    rows, split_data = prepare(config)
    write_jsonl(entries, (e.to_json() for e in rows))
    write_json(split, split_data)
    m = split_metrics(split_data)
    if metrics:
        write_json(metrics, m)
    typer.echo(f"{len(rows)} entries -> {entries}; train {m['n_train']} / test {m['n_test']} -> {split}")


if __name__ == "__main__":
    app()
