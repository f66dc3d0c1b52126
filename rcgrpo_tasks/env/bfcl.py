"""BFCL v4 data of the installed `bfcl-eval` package, for every task: where it is and how to read a file.

Reads (never imports code from) `bfcl_eval/data/`: each task reads its own files there (multi-turn:
`env.multi_turn.entries`; single-turn: `env.single_turn.entries`). The data files are JSON Lines despite their
`.json` suffix.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path


class BfclDataError(RuntimeError):
    """bfcl-eval is missing or its data is not where/what we expect."""


@functools.cache
def data_dir() -> Path:
    """`bfcl_eval/data` of the installed package, located without importing it (its import is heavy)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BfclDataError("bfcl-eval is not installed: run `pip install --no-deps bfcl-eval` (see README)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data"
    if not path.is_dir():
        raise BfclDataError(f"bfcl-eval installed without its data folder: {path}")
    return path


def read_data_file(path: Path) -> list[dict]:
    """A bfcl-eval data file (JSON Lines despite the `.json` suffix); a missing or bad file names itself."""
    if not path.is_file():
        raise BfclDataError(f"missing BFCL data file: {path}")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise BfclDataError(f"{path}:{lineno}: invalid JSON at column {exc.colno} "
                                    f"({exc.msg.removesuffix(' at').removesuffix(' starting')})") from exc
    return rows
