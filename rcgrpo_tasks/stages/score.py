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
from rcgrpo_tasks.env.contract import Task
from rcgrpo_tasks.ops.inputs import InputError, read_jsonl_numbered
from rcgrpo_tasks.ops.outputs import atomic_outputs, write_json, write_jsonl


def score_rows(rows: list[tuple[int, dict]], path: str, entries: dict, decoding: str = "calls",
               underscore_to_dot: bool = False) -> tuple[list[dict], list[str]]:
    """Score (line number, row) pairs, each result decoded by `decoding`; returns (verdict rows, per-line
    errors)."""
    verdicts, errors, seen = [], [], set()
    for lineno, row in rows:
        entry_id = row.get("id")
        if not isinstance(entry_id, str):
            errors.append(f"{path}:{lineno}: missing string field 'id'")
            continue
        if entry_id not in entries:
            errors.append(f"{path}:{lineno}: unknown entry id {entry_id!r}")
            continue
        if entry_id in seen:
            errors.append(f"{path}:{lineno}: duplicate entry id {entry_id!r}")
            continue
        if "result" not in row:
            errors.append(f"{path}:{lineno}: missing field 'result' for {entry_id}")
            continue
        seen.add(entry_id)
        entry = entries[entry_id]
        try:
            s, undecodable = tasks.task_of(entry).score_result(entry, row["result"], decoding, underscore_to_dot)
        except Exception as exc:  # model output is data: a shape the scorer chokes on is one bad line
            errors.append(f"{path}:{lineno}: result could not be scored ({type(exc).__name__}: {exc})"[:500])
            continue
        verdicts.append({"id": entry_id, "category": entry.category, "valid": s.valid, "error_type": s.error_type,
                         "partial_credit": s.partial_credit, "paper_reward": s.paper_reward,
                         "undecodable_steps": undecodable})
    return verdicts, errors


def summarize(verdicts: list[dict]) -> dict:
    """Official accuracy per category (correct / entries) and overall (mean of categories)."""
    cats: dict[str, list[dict]] = {}
    for v in verdicts:
        cats.setdefault(v["category"], []).append(v)
    per_cat = {
        c: {"n": len(vs), "accuracy": sum(v["valid"] for v in vs) / len(vs),
            "partial_credit": sum(v["partial_credit"] for v in vs) / len(vs),
            "paper_reward": sum(v["paper_reward"] for v in vs) / len(vs)}
        for c, vs in sorted(cats.items(), key=lambda kv: tasks.ALL_CATEGORIES.index(kv[0]))
    }
    def mean(key: str) -> float:
        return sum(c[key] for c in per_cat.values()) / len(per_cat) if per_cat else 0.0
    return {"n": len(verdicts), "per_category": per_cat, "accuracy": mean("accuracy"),
            "partial_credit": mean("partial_credit"), "paper_reward": mean("paper_reward")}


def _print_summary(summary: dict) -> None:
    width = max([14] + [len(c) + 2 for c in summary["per_category"]])
    typer.echo(f"{'category':<{width}}{'n':>5}{'accuracy':>10}{'partial':>10}{'paper R':>10}")
    for cat, s in summary["per_category"].items():
        typer.echo(f"{cat:<{width}}{s['n']:>5}{s['accuracy']:>10.4f}{s['partial_credit']:>10.4f}"
                   f"{s['paper_reward']:>10.4f}")
    typer.echo(f"{'overall':<{width}}{summary['n']:>5}{summary['accuracy']:>10.4f}"
               f"{summary['partial_credit']:>10.4f}{summary['paper_reward']:>10.4f}")
    unit = summary["undecodable_unit"]
    dropped = "were dropped" if unit == "step" else "are ast_decoder:decoder_failed"
    typer.echo(f"undecodable: {summary[f'undecodable_{unit}s']} {unit}(s) did not decode and {dropped}")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _task_of(rows: list[tuple[int, dict]], path: Path, entries: dict) -> Task | None:
    """The one task of the file's known ids (None: no known id); a mix raises InputError naming rows."""
    first: dict[str, tuple[int, str]] = {}
    for lineno, row in rows:
        entry = entries.get(row.get("id")) if isinstance(row.get("id"), str) else None
        if entry is not None and entry.task not in first:
            first[entry.task] = (lineno, entry.id)
    if len(first) > 1:
        named = "; ".join(f"{path}:{lineno} ({eid}) is {task}" for task, (lineno, eid) in first.items())
        raise InputError(f"{path}: rows of different tasks: {named}. A file holds one task; split it")
    return tasks.get_task(next(iter(first))) if first else None


def _decoding(rows, path: Path, decoding: str, task: Task | None) -> str:
    if decoding != "auto":
        typer.echo(f"decoding: {decoding} (as asked)")
        return decoding
    try:
        chosen, why = bfcl_results.choose_decoding(rows, str(path), task or tasks.default_task())
    except bfcl_results.MixedDecodingError as exc:
        raise InputError(str(exc)) from exc
    typer.echo(f"decoding: {chosen} (detected: {why})")
    return chosen


def _publish(output: Path, summary_path: Path | None, verdicts: list[dict], summ: dict) -> None:
    try:
        with atomic_outputs() as out:
            write_jsonl(out.file(output), verdicts)
            if summary_path:
                write_json(out.file(summary_path), summ)
    except InputError as exc:  # OutputError: unwritable path, file too large, a concurrent writer
        raise _fail(str(exc)) from exc


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
        raise _fail(f"--decoding {decoding!r}: expected one of {', '.join(bfcl_results.DECODINGS)}")
    try:
        rows, errors = read_jsonl_numbered(results)
    except InputError as exc:
        raise _fail(str(exc)) from exc
    if not rows:
        for e in errors:
            typer.echo(f"error: {e}", err=True)
        raise _fail(f"{results}: no result rows{' (every line was bad)' if errors else ''}")
    entries = tasks.entries_by_id()
    try:
        task = _task_of(rows, results, entries)
        if underscore_to_dot and task is not None and not task.dotted_names:
            raise InputError(f"--underscore-to-dot: the {task.name} task's function names have no dots")
        decoding = _decoding(rows, results, decoding, task)
    except InputError as exc:
        raise _fail(str(exc)) from exc
    verdicts, row_errors = score_rows(rows, str(results), entries, decoding, underscore_to_dot)
    errors += row_errors
    if not verdicts:
        for e in errors:
            typer.echo(f"error: {e}", err=True)
        raise _fail(f"{results}: no line could be scored ({len(errors)} bad line(s)); nothing written")
    undecodable = sum(v["undecodable_steps"] for v in verdicts)
    task = task or tasks.task_of(entries[verdicts[0]["id"]])
    summ = {**summarize(verdicts), "decoding": decoding, "task": task.name, "undecodable_unit": task.undecodable_unit,
            f"undecodable_{task.undecodable_unit}s": undecodable}
    _publish(output, summary, verdicts, summ)
    _print_summary(summ)
    for e in errors:
        typer.echo(f"error: {e}", err=True)
    if errors:
        typer.echo(f"{len(errors)} line(s) could not be scored; {len(verdicts)} scored", err=True)
        raise typer.Exit(1)


if __name__ == "__main__":
    sys.exit(app())
