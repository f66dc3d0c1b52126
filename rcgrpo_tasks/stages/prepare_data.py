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

from pathlib import Path

import typer

from rcgrpo_tasks.env.split import PrepareDataConfig, prepare, split_metrics
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import load_config
from rcgrpo_tasks.ops.io import write_json, write_jsonl

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="Params file (section `prepare_data`)."),
    entries: Path = typer.Option(..., help="Output: entries JSONL."),
    split: Path = typer.Option(..., help="Output: split JSON."),
    metrics: Path | None = typer.Option(None, help="Output: counts JSON."),
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
