"""BFCL v4 single-turn function calling (the AST categories) from the installed `bfcl-eval` package.

Reads (never imports code from) `bfcl_eval/data/BFCL_v4_<category>.json` (JSON Lines) and its
`possible_answer/` twin. An entry is one question (a user message, for a few live entries preceded by a
system message) with the function docs it may call and the possible answers: per gold call
`{name: {param: [accepted values]}}`, `""` among the values marking an optional parameter that may be left
out (BFCL's convention).

Categories: the Python AST ones, `simple_python`, `multiple`, `parallel`, `parallel_multiple` and their
`live_*` counterparts. Java/JavaScript, irrelevance/relevance (no possible answer) and format sensitivity
are out of scope.

The prompt is BFCL's prompting-mode one (`model_handler.utils.system_prompt_pre_processing_chat_model`,
`ret_fmt=python&tool_call_tag=False&func_doc_fmt=json&prompt_fmt=plaintext&style=classic`): the classic
system prompt with the docs, each description carrying BFCL's Python hint; a live entry's own system
message is appended to it as BFCL does. `doc_style` picks the docs' rendering: `official` (BFCL's exact
`json.dumps(docs, indent=4)`), `json` (one JSON object per line, the same content in ~25% fewer tokens),
`compact` (BFCL's own `func_doc_fmt=python` rendering from its format-sensitivity set: a docstring per
function with typed, described arguments; ~20-30% fewer tokens again). `system_prompt: short` drops the
persona, task and multi-turn paragraphs (the format rule and the docs stay).
"""

from __future__ import annotations

import copy
import functools
import json
import random
from dataclasses import dataclass

from rcgrpo_tasks.env import bfcl
from rcgrpo_tasks.env.bfcl import BfclDataError

TASK_NAME = "single_turn"
CATEGORIES: tuple[str, ...] = (
    "simple_python", "multiple", "parallel", "parallel_multiple",
    "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
)
DEFAULT_CATEGORIES: tuple[str, ...] = CATEGORIES[:4]
"""The non-live categories: shorter prompts (median 375-495 tokens with compact docs) than live_multiple's."""
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
"""bfcl_eval.utils._get_language_specific_hint for Python, appended to every function description."""


@dataclass(frozen=True)
class SingleTurnEntry:
    """One BFCL v4 single-turn entry with its possible answers."""

    id: str
    category: str
    question: tuple[dict, ...]
    """The first (only) turn's messages: a user message, optionally preceded by a system message."""
    functions: tuple[dict, ...]
    """Function docs as the data file holds them (no language hint: the checker reads these)."""
    possible_answer: tuple[dict, ...]
    """Per gold call `{name: {param: [accepted values]}}` (BFCL's `ground_truth`)."""

    task = TASK_NAME

    def to_json(self) -> dict:
        return {"task": TASK_NAME, "id": self.id, "category": self.category, "question": list(self.question),
                "functions": list(self.functions), "possible_answer": list(self.possible_answer)}

    @classmethod
    def from_json(cls, d: dict) -> "SingleTurnEntry":
        if d.get("task") != TASK_NAME:
            raise ValueError(f"not a {TASK_NAME} entry (task {d.get('task')!r})")
        if d["category"] not in CATEGORIES:
            raise ValueError(f"unknown {TASK_NAME} category {d['category']!r}")
        return cls(id=d["id"], category=d["category"], question=tuple(d["question"]),
                   functions=tuple(d["functions"]), possible_answer=tuple(d["possible_answer"]))


def category_of(entry_id: str) -> str:
    """`live_simple_3-2-1` -> `live_simple`; `parallel_multiple_7` -> `parallel_multiple`."""
    for cat in sorted(CATEGORIES, key=len, reverse=True):
        rest = entry_id[len(cat) + 1:]
        if entry_id.startswith(cat + "_") and rest and rest.replace("-", "").isdigit():
            return cat
    raise ValueError(f"not a BFCL v4 single-turn entry id: {entry_id!r}")


@functools.cache
def _load_category(category: str) -> tuple[SingleTurnEntry, ...]:
    d = bfcl.data_dir()
    questions = bfcl.read_data_file(d / f"BFCL_v4_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in bfcl.read_data_file(d / "possible_answer" / f"BFCL_v4_{category}.json")}
    out = []
    for q in questions:
        if q["id"] not in answers:
            raise BfclDataError(f"{category}: no possible answer for {q['id']}")
        if len(q["question"]) != 1:
            raise BfclDataError(f"{category}: {q['id']} has {len(q['question'])} turns, expected one")
        out.append(SingleTurnEntry(id=q["id"], category=category, question=tuple(q["question"][0]),
                                   functions=tuple(q["function"]), possible_answer=tuple(answers[q["id"]])))
    return tuple(out)


def load_entries(categories=DEFAULT_CATEGORIES) -> list[SingleTurnEntry]:
    """All entries of the given categories, in file order."""
    out: list[SingleTurnEntry] = []
    for cat in categories:
        if cat not in CATEGORIES:
            raise ValueError(f"unknown {TASK_NAME} category {cat!r}; expected one of {CATEGORIES}")
        out.extend(_load_category(cat))
    return out


def split_ids(entries: list[SingleTurnEntry], test_fraction: float, seed: int) -> dict[str, list[str]]:
    """Seeded split stratified by category: round(n * test_fraction) (>= 1) ids of each category held out.

    Departure from the multi-turn split: there is no numeric-id family to keep together (simple_python_17
    and multiple_17 are unrelated questions), so each category is sampled on its own."""
    by_cat: dict[str, list[str]] = {}
    for e in entries:
        by_cat.setdefault(e.category, []).append(e.id)
    test: set[str] = set()
    for cat, ids in by_cat.items():
        n_test = max(1, round(len(ids) * test_fraction))
        test.update(random.Random(f"{seed}:{cat}").sample(ids, n_test))
    return {"train": [e.id for e in entries if e.id not in test], "test": [e.id for e in entries if e.id in test]}


def render_call(name: str, args: dict) -> str:
    """`name(a=1, b='x')`: one call as prompt-mode text, every value as its Python literal (what a model is
    trained to emit; BFCL's decoder reads it back to the same `{name: args}`)."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


def render_calls(calls: list[dict]) -> list[str]:
    """Decoded calls `[{name: args}]` as call strings, in order."""
    return [render_call(name, args) for call in calls for name, args in call.items()]


# ---------------------------------------------------------------------------------------------------- prompt


def hinted(functions) -> list[dict]:
    """The docs as BFCL shows them to a Python model: each description + the Python hint."""
    docs = copy.deepcopy(list(functions))
    for doc in docs:
        doc["description"] = doc.get("description", "") + PYTHON_HINT
    return docs


def _py_type(meta: dict) -> str:
    t = meta.get("type", "string")
    prim = {"string": "str", "number": "float", "integer": "int", "boolean": "bool"}
    if t in prim:
        return prim[t]
    if t in {"array", "list", "tuple"} and "items" in meta:
        return f"list[{_py_type(meta['items'])}]"
    if t in {"object", "dict"}:
        return f"dict[str, {_py_type(meta['additionalProperties'])}]" if "additionalProperties" in meta else "dict"
    return t


def _param_doc(name: str, meta: dict, depth: int = 0) -> list[str]:
    indent = " " * 8 + " " * 4 * depth
    desc = meta.get("description", "")
    if "enum" in meta:
        desc += f" Enum values: {meta['enum']}."
    default = f", default={meta['default']!r}" if "default" in meta else ""
    lines = [f"{indent}{name} ({_py_type(meta)}{default}): {desc}\n"]
    for child, child_meta in meta.get("properties", {}).items():
        lines += _param_doc(child, child_meta, depth + 1)
    return lines


def python_docs(functions: list[dict]) -> str:
    """BFCL's `func_doc_fmt=python` rendering (`model_handler.utils._generate_function_doc_python`, its
    whitespace included), copied so the prompt does not depend on importing bfcl-eval's handler module
    (tests check it against the package)."""
    docs: list[str] = []
    for doc in functions:
        lines = [f"# Function: {doc['name']}\n", '    """\n', f"    {doc.get('description', '')}\n\n"]
        props = doc.get("parameters", {}).get("properties", {})
        if props:
            lines.append("    Args:\n")
            for name, meta in props.items():
                lines += _param_doc(name, meta)
        lines.append('    """\n')
        docs += ["".join(lines), "\n"]
    return "\n\n".join(docs)


def docs_text(functions: list[dict], style: str) -> tuple[str, str]:
    """(format name as BFCL's prompt names it, rendered docs) for a doc style."""
    if style == "official":
        return "json", json.dumps(functions, indent=4)
    if style == "json":
        return "JSON (one function per line)", "\n".join(json.dumps(f) for f in functions)
    if style == "compact":
        return "python", python_docs(functions)
    raise ValueError(f"unknown doc style {style!r}; expected official, json or compact")
