"""THE reader of prepared entries and the train/test split: every stage and command selects entries here.

- `read_split(path)`: `{"train": [ids], "rl": [ids], "dev": [ids], "test": [ids]}` (prepare_data's
  `split.json`), disjoint sides: train = the SFT part (SFT, RCTP and their samples), rl = RL's prompts; a
  split written before the dev or rl side existed reads as one with that side empty.
- `read_entries(path)`: entries by id from prepare_data's `entries.jsonl` (None: straight from bfcl-eval).
- `split_entries(entries, split, side, categories)`: one side of the split, in file order, every id known.
- `select_entries(pool, ids, split, side, categories, limit)`: the CLI's selection (`rcgrpo rollout`).
Every problem is an `InputError` naming the file (and line or field), raised before any work starts.
"""

from __future__ import annotations

from pathlib import Path

from rcgrpo_tasks.env import tasks
from rcgrpo_tasks.env.contract import Entry
from rcgrpo_tasks.ops.inputs import InputError, read_json, read_jsonl

SIDES = ("train", "rl", "dev", "test")


def read_split(split_path: str | Path) -> dict[str, list[str]]:
    """The split file: every side a list of ids, no id on two sides."""
    path = Path(split_path)
    if not path.is_file():
        raise InputError(f"{path}: split file not found (run `dvc repro prepare_data`)")
    split = read_json(path)
    if isinstance(split, dict):
        split = {"dev": [], "rl": [], **split}
    for key in SIDES:
        if not isinstance(split, dict) or not isinstance(split.get(key), list):
            raise InputError(f"{path}: expected {{'train': [ids], 'rl': [ids], 'dev': [ids], 'test': [ids]}}, "
                             f"field {key!r} missing or not a list")
    for i, a in enumerate(SIDES):
        for b in SIDES[i + 1:]:
            overlap = sorted(set(split[a]) & set(split[b]))
            if overlap:
                raise InputError(f"{path}: {len(overlap)} id(s) in both {a} and {b}, e.g. {overlap[:3]}")
    return split


def read_entries(entries_path: str | Path | None) -> dict[str, Entry]:
    """Entries by id, in file order: from a prepare_data `entries.jsonl` (rows of one task), else straight from
    bfcl-eval (every task)."""
    if entries_path is None:
        return tasks.entries_by_id()
    pool: dict[str, Entry] = {}
    for lineno, row in enumerate(read_jsonl(entries_path), 1):
        try:
            entry = tasks.entry_from_json(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{entries_path}:{lineno}: not an entry ({type(exc).__name__}: {exc})") from exc
        if pool and entry.task != next(iter(pool.values())).task:
            raise InputError(f"{entries_path}:{lineno}: a {entry.task} entry among {next(iter(pool.values())).task} "
                             "entries (prepare_data writes one task)")
        pool[entry.id] = entry
    return pool


def check_categories(categories) -> None:
    bad = [c for c in categories or () if c not in tasks.ALL_CATEGORIES]
    if bad:
        raise InputError(f"unknown categories {bad}; expected some of {list(tasks.ALL_CATEGORIES)}")


def split_entries(entries_path: str | Path, split_path: str | Path, side: str,
                  categories=None) -> list[Entry]:
    """One side of the split (in entries-file order), optionally of some categories; every id must exist."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}")
    check_categories(categories)
    pool = read_entries(entries_path)
    ids = read_split(split_path)[side]
    if not ids:
        why = {"dev": " (prepare_data.dev_fraction is 0, or the file predates the dev split)",
               "rl": " (prepare_data.rl_fraction is 0, or the file predates RL's own prompts)"}.get(side, "")
        raise InputError(f"{split_path}: the {side} side is empty{why}")
    missing = [i for i in ids if i not in pool]
    if missing:
        raise InputError(f"{split_path}: {len(missing)} {side} id(s) not in {entries_path}, e.g. {missing[:3]}")
    wanted = set(ids)
    chosen = [e for e in pool.values() if e.id in wanted and (not categories or e.category in categories)]
    if categories and not chosen:
        have = sorted({e.category for e in pool.values() if e.id in wanted})
        raise InputError(f"{split_path}: no {side} entries in categories {list(categories)}; the prepared "
                         f"entries ({entries_path}) have {have}")
    return chosen


def select_entries(pool: dict[str, Entry], ids: list[str] | None = None, split: str | Path | None = None,
                   side: str = "test", categories: list[str] | None = None,
                   limit: int | None = None) -> list[Entry]:
    """Entries by explicit ids and/or split side, filtered by category, capped at `limit` (in order)."""
    wanted: list[str] | None = list(ids) if ids else None
    if split is not None:
        if side not in SIDES:
            raise InputError(f"{split}: no split named {side!r}; expected one of {SIDES}")
        members = read_split(split)[side]
        wanted = members if wanted is None else [i for i in wanted if i in set(members)]
    unknown = [i for i in (wanted or []) if i not in pool]
    if unknown:
        raise InputError(f"unknown entry id(s): {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    check_categories(categories)
    chosen = [pool[i] for i in wanted] if wanted is not None else list(pool.values())
    chosen = [e for e in chosen if not categories or e.category in categories]
    if limit is not None:
        chosen = chosen[:limit]
    if not chosen:
        raise InputError("the selection is empty (check --ids / --split / --categories / --limit)")
    return chosen


def stratified(entries: list, limit: int | None) -> list:
    """The first `limit` entries taken round-robin over categories (all of them when limit is None)."""
    if limit is None:
        return entries
    by_cat: dict[str, list] = {}
    for e in entries:
        by_cat.setdefault(e.category, []).append(e)
    rounds = max(len(v) for v in by_cat.values())
    order = [v[i] for i in range(rounds) for v in by_cat.values() if i < len(v)]
    return order[:limit]
