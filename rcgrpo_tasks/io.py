"""Small I/O helpers every stage uses: atomic outputs and JSONL with file:line errors.

Stages never leave partial outputs: they write to a temporary sibling and rename into place only when
the whole output is complete (rename is atomic on one filesystem).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class InputError(ValueError):
    """Bad input file; the message names the file (and line)."""


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp file path next to `path`; on success rename it to `path`, on error delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.exists():
            os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get normal permissions
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temp directory next to `path`; on success replace `path` with it, on error delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: object) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    n = 0
    with atomic_path(path) as tmp, tmp.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict]:
    """All rows of a JSONL file; a corrupt line raises InputError naming file and line."""
    rows, errors = read_jsonl_lenient(path)
    if errors:
        raise InputError(errors[0])
    return rows


def read_jsonl_lenient(path: str | Path) -> tuple[list[dict], list[str]]:
    """(rows, errors): every bad line becomes an `file:line: message` error; good lines still load."""
    numbered, errors = read_jsonl_numbered(path)
    return [row for _, row in numbered], errors


def read_jsonl_numbered(path: str | Path) -> tuple[list[tuple[int, dict]], list[str]]:
    """((line number, row) pairs, errors) of a JSONL file; a missing file raises InputError."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: file not found")
    rows: list[tuple[int, dict]] = []
    errors: list[str] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                errors.append(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(row, dict):
                errors.append(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                continue
            rows.append((lineno, row))
    return rows, errors
