"""`rcgrpo score RESULTS.jsonl --output VERDICTS.jsonl`: score a BFCL v4 multi-turn result file.

Reads BFCL's result format, one entry per line: `{"id": "multi_turn_base_0", "result": turns}`, every
step decoded as `bfcl evaluate` decodes it (`env.results`): call strings (the rollout engine's trajectories
carry the same `result` field, so they score directly), a prompt-mode model's text, or a function-calling
model's `{name: "<JSON arguments>"}` objects, as `bfcl generate` writes them; `--decoding auto` (default)
tells them apart per file and says which it used.
Writes one line per scored entry: `id`, `category`, `valid`, `error_type`, `partial_credit`,
`paper_reward`; prints per-category and overall accuracy (official: correct / entries of the category,
overall = mean of categories) and, with `--summary`, writes it as JSON.

Bad lines (invalid JSON or UTF-8, nesting too deep, a line over the reader's cap, not an object, no
`id`/`result`, unknown id, duplicate id, a result the scorer cannot handle) are reported one by one on
stderr with file:line and skipped; every other line is still scored, and the exit status is 1. The
verdicts and the summary are published together (`atomic_outputs`) or not at all; an unwritable output
exits 2 naming the path. Scoring never evaluates the call strings (env.calls parses literals only).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from rcgrpo_tasks.env import bfcl
from rcgrpo_tasks.env import results as bfcl_results
from rcgrpo_tasks.env.scoring import score_entry
from rcgrpo_tasks.ops.io import InputError, atomic_outputs, read_jsonl_numbered, write_json, write_jsonl


def score_rows(rows: list[tuple[int, dict]], path: str, entries: dict[str, bfcl.Entry],
               decoding: bfcl_results.Decoding = "calls") -> tuple[list[dict], list[str]]:
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
            s = score_entry(entry, bfcl_results.decode_result(row["result"], decoding))
        except Exception as exc:  # model output is data: a shape the scorer chokes on is one bad line
            errors.append(f"{path}:{lineno}: result could not be scored ({type(exc).__name__}: {exc})"[:500])
            continue
        verdicts.append({"id": entry_id, "category": entry.category, "valid": s.valid, "error_type": s.error_type,
                         "partial_credit": s.partial_credit, "paper_reward": s.paper_reward})
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
        for c, vs in sorted(cats.items(), key=lambda kv: bfcl.CATEGORIES.index(kv[0]))
    }
    def mean(key: str) -> float:
        return sum(c[key] for c in per_cat.values()) / len(per_cat) if per_cat else 0.0
    return {"n": len(verdicts), "per_category": per_cat, "accuracy": mean("accuracy"),
            "partial_credit": mean("partial_credit"), "paper_reward": mean("paper_reward")}


def _print_summary(summary: dict) -> None:
    typer.echo(f"{'category':<14}{'n':>5}{'accuracy':>10}{'partial':>10}{'paper R':>10}")
    for cat, s in summary["per_category"].items():
        typer.echo(f"{cat:<14}{s['n']:>5}{s['accuracy']:>10.4f}{s['partial_credit']:>10.4f}{s['paper_reward']:>10.4f}")
    typer.echo(f"{'overall':<14}{summary['n']:>5}{summary['accuracy']:>10.4f}"
               f"{summary['partial_credit']:>10.4f}{summary['paper_reward']:>10.4f}")


app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


@app.command()
def main(
    results: Path = typer.Argument(..., help="BFCL result JSONL (id, result)."),
    output: Path = typer.Option(..., "--output", "-o", help="Verdicts JSONL to write."),
    summary: Path | None = typer.Option(None, help="Also write the accuracy summary as JSON."),
    decoding: str = typer.Option("auto", help="How a step is decoded: auto (from the file), calls (call strings), "
                                              "prompt (model text) or fc (function-calling objects)."),
) -> None:
    """Score a BFCL result JSONL with the official-semantics scorer."""
    try:
        rows, errors = read_jsonl_numbered(results)
    except InputError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if decoding not in bfcl_results.DECODINGS:
        typer.echo(f"error: --decoding {decoding!r}: expected one of {', '.join(bfcl_results.DECODINGS)}", err=True)
        raise typer.Exit(2)
    if not rows:
        typer.echo(f"error: {results}: no result rows{' (every line was bad)' if errors else ''}", err=True)
        for e in errors:
            typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if decoding == "auto":
        decoding, why = bfcl_results.detect(row.get("result") for _, row in rows)
        typer.echo(f"decoding: {decoding} (detected: {why})")
    else:
        typer.echo(f"decoding: {decoding} (as asked)")
    try:
        verdicts, row_errors = score_rows(rows, str(results), bfcl.entries_by_id(), decoding)
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    errors += row_errors
    summ = {**summarize(verdicts), "decoding": decoding}
    try:
        with atomic_outputs() as out:
            write_jsonl(out.file(output), verdicts)
            if summary:
                write_json(out.file(summary), summ)
    except InputError as exc:  # OutputError: unwritable path, file too large, a concurrent writer
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    _print_summary(summ)
    for e in errors:
        typer.echo(f"error: {e}", err=True)
    if errors:
        typer.echo(f"{len(errors)} line(s) could not be scored; {len(verdicts)} scored", err=True)
        raise typer.Exit(1)


if __name__ == "__main__":
    sys.exit(app())
