"""`rcgrpo score RESULTS.jsonl --output VERDICTS.jsonl`: score a BFCL v4 result file of either task.

Reads BFCL's result format, one entry per line: `{"id": ..., "result": ...}`, entries found by id in both
tasks (a file holds one task: a mix exits 2 naming the first row of each). Results are decoded as
`bfcl evaluate` decodes them (`env.results`), never run:
- multi-turn (`multi_turn_base_0`): turns -> steps, a step being call strings (the rollout engine's
  trajectories carry the same `result` field), a prompt-mode model's text, or a function-calling model's
  `{name: "<JSON arguments>"}` objects; scored by `env.multi_turn.scoring` (bfcl-eval's `multi_turn_checker`);
- single-turn (`simple_python_0`, `live_multiple_3-1-0`, ...): a prompt-mode model's text, a
  function-calling model's `[{name: "<JSON arguments>"}]`, or this project's `[[call strings]]`; judged
  by BFCL's AST checker (`env.single_turn.ast_check`); `--underscore-to-dot` for models that send `math_factorial`
  for `math.factorial` (bfcl-eval's per-model flag).
`--decoding auto` (default) takes the one decoding the rows need and refuses (exit 2, nothing written) a
file whose rows need different ones, naming the first row of each; `--decoding calls|prompt|fc` scores
every row that way.

Writes one line per scored entry: `id`, `category`, `valid`, `error_type`, `partial_credit`, `paper_reward`,
`undecodable_steps` (multi-turn: steps dropped because they did not decode; single-turn: 1 for an output
that did not decode); prints per-category and overall accuracy (official: correct / entries of the
category, overall = mean of categories) and the undecodable count, and, with `--summary`, writes it as JSON.

Bad lines (invalid JSON or UTF-8, nesting too deep, a line over the reader's cap, not an object, no
`id`/`result`, unknown id, duplicate id, a result the scorer cannot handle) are reported one by one on
stderr with file:line and skipped; every other line is still scored, and the exit status is 1. A file
with no line to score exits 2 and writes nothing. The verdicts and the summary are published together
(`atomic_outputs`) or not at all; an unwritable output exits 2 naming the path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from rcgrpo_tasks.env import results as bfcl_results
from rcgrpo_tasks.env import tasks
from rcgrpo_tasks.evaluation.score_file import (
    file_summary,
    file_task,
    pick_decoding,
    publish,
    score_rows,
    summary_lines,
)
from rcgrpo_tasks.ops.cli import cli_errors, fail
from rcgrpo_tasks.ops.inputs import InputError, read_jsonl_numbered

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    results: Path = typer.Argument(..., help="BFCL result JSONL (id, result)."),
    output: Path = typer.Option(..., "--output", "-o", help="Verdicts JSONL to write."),
    summary: Path | None = typer.Option(None, help="Also write the accuracy summary as JSON."),
    decoding: str = typer.Option("auto", help="How a result is decoded: auto (from the file), calls (call "
                                              "strings), prompt (model text) or fc (function-calling objects)."),
    underscore_to_dot: bool = typer.Option(False, "--underscore-to-dot",
                                           help="Single-turn: the model sent `a_b` for the function `a.b`."),
) -> None:
    """Score a BFCL result JSONL with the official-semantics scorer."""
    if decoding not in bfcl_results.DECODINGS:
        fail(f"--decoding {decoding!r}: expected one of {', '.join(bfcl_results.DECODINGS)}")
    with cli_errors():
        rows, errors = read_jsonl_numbered(results)
    if not rows:
        for e in errors:
            typer.echo(f"error: {e}", err=True)
        fail(f"{results}: no result rows{' (every line was bad)' if errors else ''}")
    entries = tasks.entries_by_id()
    with cli_errors():
        task = file_task(rows, results, entries)
        if underscore_to_dot and task is not None and not task.dotted_names:
            raise InputError(f"--underscore-to-dot: the {task.name} task's function names have no dots")
        decoding, how = pick_decoding(rows, results, decoding, task)
    typer.echo(f"decoding: {decoding} ({how})")
    verdicts, row_errors = score_rows(rows, str(results), entries, decoding, underscore_to_dot)
    errors += row_errors
    if not verdicts:
        for e in errors:
            typer.echo(f"error: {e}", err=True)
        fail(f"{results}: no line could be scored ({len(errors)} bad line(s)); nothing written")
    summ = file_summary(verdicts, entries, decoding, task)
    with cli_errors():  # OutputError: unwritable path, file too large, a concurrent writer
        publish(output, summary, verdicts, summ)
    for line in summary_lines(summ):
        typer.echo(line)
    for e in errors:
        typer.echo(f"error: {e}", err=True)
    if errors:
        typer.echo(f"{len(errors)} line(s) could not be scored; {len(verdicts)} scored", err=True)
        raise typer.Exit(1)


if __name__ == "__main__":
    sys.exit(app())
