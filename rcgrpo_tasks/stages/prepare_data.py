"""Stage `prepare_data`: the entries of the pipeline's task from bfcl-eval, and the seeded held-out split.

`prepare_data.task` chooses the benchmark every later stage runs (`env.tasks`): `single_turn` (BFCL v4's
AST categories: simple_python, multiple, parallel, parallel_multiple and the live ones) or `multi_turn`
(BFCL v4 multi-turn: base, miss_func, miss_param, long_context; the paper's task).
Writes (paths from `dvc.yaml`):
- `--entries`: one entry per line (`to_json()`, naming its task): the frozen snapshot every later stage reads;
- `--split`: `{"train": [ids], "rl": [ids], "dev": [ids], "test": [ids], "task": ..., ...}`, seeded. multi_turn: by
  *numeric id*, the same numeric id on the same side in every category (miss_func_17 is a variant of base_17);
  10% = 80 test entries, the paper's scheme (its exact ids are not published). single_turn: stratified by
  category (10% of each). The dev side (`dev_fraction`, drawn from train by the same rule) is what every
  design choice is made on, and the rl side (`rl_fraction`, drawn next) RL's own prompts, which no
  fine-tuning stage reads (`env.split`);
- `--metrics`: counts per category and side.

Run: `rcgrpo prepare-data --params params.yaml --entries data/entries.jsonl --split data/split.json
--metrics metrics/prepare_data.json` (what `dvc repro prepare_data` does).
"""

from __future__ import annotations

from pathlib import Path

import typer

from rcgrpo_tasks.env.split import PrepareDataConfig, prepare, split_metrics
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.cli import cli_errors
from rcgrpo_tasks.ops.config import load_config
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    params: Path = typer.Option(Path("params.yaml"), help="Params file (section `prepare_data`)."),
    entries: Path = typer.Option(..., help="Output: entries JSONL."),
    split: Path = typer.Option(..., help="Output: split JSON."),
    metrics: Path | None = typer.Option(None, help="Output: counts JSON."),
) -> None:
    """Load the task's BFCL v4 entries from bfcl-eval and split them (seeded)."""
    with cli_errors():
        config = load_config(PrepareDataConfig, params, "prepare_data")
    rows, split_data = prepare(config)
    m = split_metrics(split_data)
    # Published together, and only while params.yaml still holds the values read (`published_run`).
    with tracking.published_run("prepare_data", outputs=(entries, split, metrics), track=False) as (_, staged):
        write_jsonl(staged.file(entries), (e.to_json() for e in rows))
        write_json(staged.file(split), split_data)
        if metrics:
            write_json(staged.file(metrics), m)
    typer.echo(f"{len(rows)} {config.task} entries -> {entries}; train (SFT) {m['n_train']} / rl {m['n_rl']} / "
               f"dev {m['n_dev']} / test {m['n_test']} -> {split}")


if __name__ == "__main__":
    app()
