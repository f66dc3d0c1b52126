"""THE input reader of the package: hostile lines become `file:line` errors.

`read_jsonl*`, `read_json`: bytes are read with a per-line cap (`MAX_LINE_BYTES`), decoded as strict UTF-8
(a BOM on line 1 is accepted), parsed with the standard `json` module; invalid UTF-8, bad JSON, nesting
deeper than the interpreter's recursion limit (`[[[...]]]`, which makes `json` raise RecursionError), a line
over the cap, and a line that is not an object each become one `file:line: reason` error (the reason names
the column or byte on that line). Strict readers (`read_jsonl`, `read_jsonl_numbered(strict=True)`) raise
InputError on the first bad line, before the caller has written anything; lenient ones return
`(rows, errors)` so a scorer can keep every good line. OS errors (missing file, permissions, a folder)
become InputError naming the path. NaN/Infinity are accepted, as Python's own `json.dumps` writes them.
`read_tsv`: a per-step plots file (`ops.outputs.write_tsv`). Outputs are written by `ops.outputs`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

MAX_LINE_BYTES = 64 << 20
"""Longest JSONL line accepted (64 MiB): far above any trajectory row, far below a memory blow-up."""
MAX_JSON_BYTES = 256 << 20
"""Largest single JSON document `read_json` accepts."""
_CHUNK = 1 << 20


class InputError(ValueError):
    """Bad input file; the message names the file (and line)."""


# -- reading ---------------------------------------------------------------------------------------------

def parse_json_bytes(raw: bytes, first: bool = False) -> tuple[object, str | None, int | None]:
    """(value, None, None) or (None, reason, line) for one JSON document given as bytes, `line` the 0-based
    line of the document the reason points into (the reason names the column or byte offset on it; None:
    no position); never raises on bad data. Callers name the file and line once: `file:line: reason`."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as exc:
        start = raw.rfind(b"\n", 0, exc.start) + 1
        return None, f"invalid UTF-8 at byte {exc.start - start}", raw.count(b"\n", 0, exc.start)
    try:
        return json.loads(text), None, None
    except json.JSONDecodeError as exc:  # its msg may end in " at" ("Unterminated string starting at"): dropped
        msg = re.sub(r"( starting)? at$", "", exc.msg)
        return None, f"invalid JSON at column {exc.colno} ({msg})", exc.lineno - 1
    except RecursionError:
        return None, "invalid JSON (nested too deeply)", None


def _open_input(path: Path):
    """Open `path` for binary reading; every OS failure becomes InputError naming the path."""
    if not path.exists():
        raise InputError(f"{path}: file not found")
    if path.is_dir():
        raise InputError(f"{path}: is a folder, expected a file")
    try:
        return path.open("rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _lines(fh, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; bytes is None for a line longer than the cap (skipped unread)."""
    lineno = 0
    while True:
        raw = fh.readline(max_line_bytes + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            while (rest := fh.readline(_CHUNK)) and not rest.endswith(b"\n"):
                pass  # drain the rest of the huge line in bounded chunks
            yield lineno, None
            continue
        yield lineno, raw


def scan_jsonl(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, dict | None, str | None]]:
    """Stream `(line number, row, None)` for good lines and `(line number, None, "file:line: reason")` for
    bad ones; blank lines are skipped. Raises InputError only when the file itself cannot be read."""
    path = Path(path)
    with _open_input(path) as fh:
        try:
            for lineno, raw in _lines(fh, max_line_bytes):
                if raw is None:
                    yield lineno, None, f"{path}:{lineno}: line longer than {max_line_bytes} bytes"
                    continue
                if not raw.strip():
                    continue
                row, reason, _ = parse_json_bytes(raw, first=lineno == 1)
                if reason is None and not isinstance(row, dict):
                    reason = f"expected a JSON object, got {type(row).__name__}"
                yield lineno, (row if reason is None else None), (f"{path}:{lineno}: {reason}" if reason else None)
        except OSError as exc:  # e.g. EIO, or the file vanished under us
            raise InputError(f"{path}: read failed ({exc.strerror or exc})") from exc


def read_jsonl_numbered(path: str | Path, strict: bool = False,
                        max_line_bytes: int = MAX_LINE_BYTES) -> tuple[list[tuple[int, dict]], list[str]]:
    """((line number, row) pairs, `file:line: reason` errors). strict: raise InputError at the first bad
    line instead (the caller has then written nothing). A missing/unreadable file raises InputError."""
    rows: list[tuple[int, dict]] = []
    errors: list[str] = []
    for lineno, row, error in scan_jsonl(path, max_line_bytes):
        if error is not None:
            if strict:
                raise InputError(error)
            errors.append(error)
        else:
            rows.append((lineno, row))
    return rows, errors


def read_jsonl(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES) -> list[dict]:
    """All rows of a JSONL file; the first bad line raises InputError naming file and line."""
    return [row for _, row in read_jsonl_numbered(path, strict=True, max_line_bytes=max_line_bytes)[0]]


def read_json(path: str | Path, max_bytes: int = MAX_JSON_BYTES, want: type | None = dict) -> object:
    """One JSON document (a JSON object unless `want` says otherwise); any problem raises InputError
    naming the file: missing, unreadable, too large, invalid UTF-8, invalid or too deeply nested JSON."""
    path = Path(path)
    with _open_input(path) as fh:
        try:
            raw = fh.read(max_bytes + 1)
        except OSError as exc:
            raise InputError(f"{path}: read failed ({exc.strerror or exc})") from exc
    if len(raw) > max_bytes:
        raise InputError(f"{path}: larger than {max_bytes} bytes")
    value, reason, line = parse_json_bytes(raw, first=True)
    if reason is not None:
        raise InputError(f"{path}{'' if line is None else f':{line + 1}'}: {reason}")
    if want is not None and not isinstance(value, want):
        raise InputError(f"{path}: expected a JSON {want.__name__}, got {type(value).__name__}")
    return value


def read_tsv(path: str | Path) -> list[dict]:
    """Rows of an `ops.outputs.write_tsv` file as floats (empty cell -> NaN); [] when there is no file."""
    if not Path(path).is_file():
        return []
    lines = Path(path).read_text().splitlines()
    header = lines[0].split("\t") if lines else []
    return [{k: (float(v) if v else float("nan")) for k, v in zip(header, ln.split("\t"))} for ln in lines[1:] if ln]
