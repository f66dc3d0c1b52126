"""Scoring a BFCL v4 result file of either task, with the official semantics (the `rcgrpo score` command;
docs/scoring.md).

- `file_task`: the one task of a file's known ids (a mix is an InputError naming the first row of each).
- `pick_decoding`: how the file's results are decoded (`env.results.choose_decoding` for `auto`).
- `score_rows`: one verdict per good row (`Task.score_result`); every bad row is one error naming file:line.
- `summarize` / `file_summary`: official accuracy per category (correct / entries) and overall (mean of
  categories), with the decoding, the task and the undecodable count; `summary_lines` as printed.
- `publish`: the verdicts and the summary written together (`atomic_outputs`) or not at all.
"""

from __future__ import annotations

from pathlib import Path

from rcgrpo_tasks.env import results as bfcl_results
from rcgrpo_tasks.env import tasks
from rcgrpo_tasks.env.contract import Task
from rcgrpo_tasks.ops.inputs import InputError
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


def file_summary(verdicts: list[dict], entries: dict, decoding: str, task: Task | None) -> dict:
    """`summarize` + the decoding, the task (`task`, else the first verdict's) and its undecodable count."""
    task = task or tasks.task_of(entries[verdicts[0]["id"]])
    unit = task.undecodable_unit
    return {**summarize(verdicts), "decoding": decoding, "task": task.name, "undecodable_unit": unit,
            f"undecodable_{unit}s": sum(v["undecodable_steps"] for v in verdicts)}


def summary_lines(summary: dict) -> list[str]:
    """The summary as the command prints it: one row per category, overall, the undecodable count."""
    width = max([14] + [len(c) + 2 for c in summary["per_category"]])
    lines = [f"{'category':<{width}}{'n':>5}{'accuracy':>10}{'partial':>10}{'paper R':>10}"]
    for cat, s in summary["per_category"].items():
        lines.append(f"{cat:<{width}}{s['n']:>5}{s['accuracy']:>10.4f}{s['partial_credit']:>10.4f}"
                     f"{s['paper_reward']:>10.4f}")
    lines.append(f"{'overall':<{width}}{summary['n']:>5}{summary['accuracy']:>10.4f}"
                 f"{summary['partial_credit']:>10.4f}{summary['paper_reward']:>10.4f}")
    unit = summary["undecodable_unit"]
    dropped = "were dropped" if unit == "step" else "are ast_decoder:decoder_failed"
    lines.append(f"undecodable: {summary[f'undecodable_{unit}s']} {unit}(s) did not decode and {dropped}")
    return lines


def file_task(rows: list[tuple[int, dict]], path: Path, entries: dict) -> Task | None:
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


def pick_decoding(rows, path: Path, decoding: str, task: Task | None) -> tuple[str, str]:
    """(decoding, how it was chosen): `decoding` as asked, or with `auto` the one the rows need; rows that
    need different ones are an InputError naming the first row of each."""
    if decoding != "auto":
        return decoding, "as asked"
    try:
        chosen, why = bfcl_results.choose_decoding(rows, str(path), task or tasks.legacy_task())
    except bfcl_results.MixedDecodingError as exc:
        raise InputError(str(exc)) from exc
    return chosen, f"detected: {why}"


def publish(output: Path, summary_path: Path | None, verdicts: list[dict], summary: dict) -> None:
    """Write the verdicts (and the summary) together or not at all; an unwritable path is an OutputError."""
    with atomic_outputs() as out:
        write_jsonl(out.file(output), verdicts)
        if summary_path:
            write_json(out.file(summary_path), summary)
