"""BFCL v4 multi-turn entries from the installed `bfcl-eval` package: entries, ground truth, function docs.

Reads (never imports code from) `bfcl_eval/data/`: `BFCL_v4_multi_turn_<cat>.json` (JSON Lines despite
the suffix), `possible_answer/` and `multi_turn_func_doc/`. Two doc renderings:
- `json`: one JSON object per line, exactly the official docs (median ~6.8k tokens per entry);
- `compact`: one line per function, `cd(folder: str) -> Change the current working directory…`, optional
  params as `name: type = default` (median ~635 tokens; what an 8k-context model can afford).

Miss-func entries: as bfcl-eval's `populate_test_cases_with_predefined_functions` does, the docs of
`missed_function[turn]` are withheld from the prompt until that turn; they stay executable.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass, field

from rcgrpo_tasks.env.bfcl import BfclDataError, data_dir, read_data_file

TASK_NAME = "multi_turn"
"""The task's name (`env.tasks`): the `task` of its entries."""
CATEGORIES: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")

# Class -> doc file, as bfcl_eval.constants.executable_backend_config.MULTI_TURN_FUNC_DOC_FILE_MAPPING.
FUNC_DOC_FILES: dict[str, str] = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}

# BFCL's message when held-back functions become available (constants/default_prompts.py).
ADDITIONAL_FUNCTION_PROMPT = "I have updated some more functions you can choose from. What about now?"


@dataclass(frozen=True)
class Entry:
    """One BFCL v4 multi-turn entry with its ground truth."""

    task = TASK_NAME  # class attribute, not a field: `env.tasks.task_of` dispatches on it

    id: str
    category: str
    turns: tuple[tuple[dict, ...], ...]
    """User messages per turn; a miss_func turn is empty (the held-back docs arrive instead)."""
    initial_config: dict
    involved_classes: tuple[str, ...]
    ground_truth: tuple[tuple[str, ...], ...]
    """Gold call strings per turn (BFCL's `possible_answer`)."""
    missed_function: dict[int, tuple[str, ...]] = field(default_factory=dict)
    """Turn index -> function names withheld from the prompt until that turn (miss_func only)."""

    @property
    def numeric_id(self) -> int:
        return numeric_id(self.id)

    @property
    def long_context(self) -> bool:
        return "long_context" in self.category

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "category": self.category,
            "turns": [list(t) for t in self.turns],
            "initial_config": self.initial_config,
            "involved_classes": list(self.involved_classes),
            "ground_truth": [list(t) for t in self.ground_truth],
            "missed_function": {str(k): list(v) for k, v in self.missed_function.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> "Entry":
        return cls(
            id=d["id"],
            category=d["category"],
            turns=tuple(tuple(t) for t in d["turns"]),
            initial_config=d["initial_config"],
            involved_classes=tuple(d["involved_classes"]),
            ground_truth=tuple(tuple(t) for t in d["ground_truth"]),
            missed_function={int(k): tuple(v) for k, v in d.get("missed_function", {}).items()},
        )


def numeric_id(entry_id: str) -> int:
    """`multi_turn_miss_func_17` -> 17."""
    m = re.search(r"_(\d+)$", entry_id)
    if not m:
        raise ValueError(f"not a BFCL entry id: {entry_id!r}")
    return int(m.group(1))


def category_of(entry_id: str) -> str:
    """`multi_turn_miss_func_17` -> `miss_func`."""
    m = re.fullmatch(r"multi_turn_(.+)_\d+", entry_id)
    if not m or m.group(1) not in CATEGORIES:
        raise ValueError(f"not a BFCL v4 multi-turn entry id: {entry_id!r}")
    return m.group(1)


@functools.cache
def _load_category(category: str) -> tuple[Entry, ...]:
    d = data_dir()
    questions = read_data_file(d / f"BFCL_v4_multi_turn_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in read_data_file(d / "possible_answer" / f"BFCL_v4_multi_turn_{category}.json")}
    out = []
    for q in questions:
        if q["id"] not in answers:
            raise BfclDataError(f"{category}: no ground truth for {q['id']}")
        out.append(
            Entry(
                id=q["id"],
                category=category,
                turns=tuple(tuple(t) for t in q["question"]),
                initial_config=q.get("initial_config", {}),
                involved_classes=tuple(q["involved_classes"]),
                ground_truth=tuple(tuple(t) for t in answers[q["id"]]),
                missed_function={int(k): tuple(v) for k, v in q.get("missed_function", {}).items()},
            )
        )
    return tuple(out)


def load_entries(categories: tuple[str, ...] | list[str] = CATEGORIES) -> list[Entry]:
    """All entries of the given categories, in file order."""
    out: list[Entry] = []
    for cat in categories:
        if cat not in CATEGORIES:
            raise ValueError(f"unknown category {cat!r}; expected one of {CATEGORIES}")
        out.extend(_load_category(cat))
    return out


def split_by_numeric_id(entries: list[Entry], test_fraction: float, seed: int) -> dict[str, list]:
    """Seeded split by numeric id; every entry sharing a numeric id lands on the same side (miss_func_17 is a
    variant of base_17: splitting them apart would leak the test question into training). With 10% that is
    20 numeric ids x 4 categories = 80 test entries and 720 train, the paper's scheme (its ids are not
    published)."""
    numeric = sorted({e.numeric_id for e in entries})
    n_test = max(1, round(len(numeric) * test_fraction))
    test_nums = set(random.Random(seed).sample(numeric, n_test))
    train = [e.id for e in entries if e.numeric_id not in test_nums]
    test = [e.id for e in entries if e.numeric_id in test_nums]
    return {"train": train, "test": test, "test_numeric_ids": sorted(test_nums)}


@functools.cache
def entries_by_id() -> dict[str, Entry]:
    return {e.id: e for e in load_entries()}


@functools.cache
def _class_docs(class_name: str) -> tuple[dict, ...]:
    if class_name not in FUNC_DOC_FILES:
        raise BfclDataError(f"no function docs for class {class_name!r}")
    return tuple(read_data_file(data_dir() / "multi_turn_func_doc" / FUNC_DOC_FILES[class_name]))


def entry_docs(entry: Entry) -> tuple[list[dict], dict[int, list[dict]]]:
    """(docs visible from turn 0, turn -> docs revealed at that turn), as BFCL builds them."""
    docs = [d for cls in entry.involved_classes for d in _class_docs(cls)]
    held: dict[int, list[dict]] = {}
    for turn, names in sorted(entry.missed_function.items()):
        for name in names:
            idx = next((i for i, d in enumerate(docs) if d["name"] == name), None)
            if idx is not None:
                held.setdefault(turn, []).append(docs.pop(idx))
    return docs, held


_TYPE_NAMES = {"string": "str", "integer": "int", "float": "float", "number": "float", "boolean": "bool",
               "array": "list", "dict": "dict", "object": "dict", "tuple": "tuple", "any": "any"}


def _short_description(doc: dict) -> str:
    desc = doc.get("description", "")
    # Official descriptions repeat a long class blurb before "Tool description:"; keep the tool's own part.
    if "Tool description:" in desc:
        desc = desc.split("Tool description:", 1)[1]
    return " ".join(desc.split())


def render_compact(doc: dict) -> str:
    """One line: `name(a: str, b: int = 3) -> description`."""
    params = doc.get("parameters", {}) or {}
    props = params.get("properties", {}) or {}
    required = set(params.get("required", []) or [])
    parts = []
    for name, spec in props.items():
        typ = _TYPE_NAMES.get(spec.get("type", "any"), spec.get("type", "any"))
        if name in required:
            parts.append(f"{name}: {typ}")
        else:
            parts.append(f"{name}: {typ} = {spec.get('default', None)!r}")
    return f"{doc['name']}({', '.join(parts)}) -> {_short_description(doc)}"


def render_docs(docs: list[dict], style: str = "compact") -> str:
    """Render function docs for a prompt: `json` (official, one object per line) or `compact`."""
    if style == "json":
        return "\n".join(json.dumps(d) for d in docs)
    if style == "compact":
        return "\n".join(render_compact(d) for d in docs)
    raise ValueError(f"unknown doc style {style!r}; expected 'json' or 'compact'")
