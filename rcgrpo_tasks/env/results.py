"""BFCL result files as `bfcl generate` writes them, decoded as `bfcl evaluate` decodes them, never run.

A row is `{"id": ..., "result": ...}`. What `result` holds depends on the task and the model's handler:
- multi-turn: `turns[t][s]`, one model step each: `calls` (a list of call strings, already decoded: this
  project's rollouts and trajectories), `prompt` (the model's raw text, `"[cd(folder='x')]"`, decoded as
  bfcl-eval's `default_decode_execute_prompting`), `fc` (a function-calling model's list of
  `{name: "<JSON arguments>"}`, decoded as bfcl-eval's `convert_to_function_call`; a text reply fails);
- single-turn: `prompt` (the model's text, decoded as `default_decode_ast_prompting`), `fc` (a list of
  `{name: "<JSON arguments>"}`, as a function-calling handler's `decode_ast`), `calls` (this project's
  trajectories: `[[call strings]]`, one turn, one step).

Text is decoded by `env.ast_decode` (bfcl-eval's decoder `eval`s arithmetic in model text; this one computes
literal arithmetic only and refuses the rest, see its departures), function-calling arguments with `json`.
As bfcl-eval's runners do, a multi-turn step that fails to decode is dropped (one that decodes to nothing
is dropped by the scorer, as every empty step is), a multi-turn result that is not a list (`"Error during
inference: ..."`) is left for the scorer to judge an inference error, and a single-turn output that fails to
decode is `ast_decoder:decoder_failed`. Both count as undecodable.

The decoding is one per file: `row_kind` says what a row's steps need (`fc` if any holds a
`{name: arguments}` object, `prompt` if any text decodes to calls, `calls` if any list holds a call string;
prose and empty steps need nothing), and `choose_decoding` refuses a file whose rows need different ones
(two runs concatenated: one decoding would silently drop the other's calls). A handler with its own
decoder (XML or JSON tool-call formats) is out of scope: decode those with bfcl-eval first and score the
call strings.

What differs by task lives in the task's package (`Task.result_steps`, `Task.undetected_decoding`,
`Task.score_result`): multi-turn decoding in `env.multi_turn.decode`, single-turn in `env.single_turn.scoring`.
"""

from __future__ import annotations

from typing import Any, Literal

from rcgrpo_tasks.env import ast_decode
from rcgrpo_tasks.env.ast_decode import AstDecodeError
from rcgrpo_tasks.env.contract import Task

Decoding = Literal["calls", "prompt", "fc"]
DECODINGS: tuple[str, ...] = ("auto", "calls", "prompt", "fc")
KIND_WORDS = {"fc": "function-calling {name: arguments} objects", "prompt": "model text with calls",
              "calls": "lists of call strings"}


class MixedDecodingError(ValueError):
    """A file whose rows need different decodings; the message names the first row of each kind."""



def _decodes(text: Any) -> bool:
    """The text decodes to at least one call (prose and `[]` do not)."""
    try:
        return bool(ast_decode.decode_prompt(text))
    except AstDecodeError:
        return False


def _step_kind(step: Any) -> str | None:
    if isinstance(step, dict) or (isinstance(step, list) and any(isinstance(c, dict) for c in step)):
        return "fc"
    if isinstance(step, str):
        return "prompt" if _decodes(step) else None  # prose: any decoding drops it
    if isinstance(step, list) and any(isinstance(c, list) for c in step):
        return "calls"  # a single-turn trajectory's [[call strings]] seen as one step
    if isinstance(step, list) and any(isinstance(c, str) and _decodes(c) for c in step):
        return "calls"  # a text reply in a one-element list (function-calling handlers) holds no call
    return None


def row_kind(result: Any, task: Task) -> str | None:
    """The decoding a row's result needs (`fc` before `prompt` before `calls` when its steps disagree, as
    a function-calling model's text replies sit beside its calls); None when nothing in it tells."""
    kinds = {_step_kind(step) for step in task.result_steps(result)}
    return next((k for k in ("fc", "prompt", "calls") if k in kinds), None)


def choose_decoding(rows: list[tuple[int, dict]], path: str, task: Task) -> tuple[str, str]:
    """(decoding, why) of a whole file of (line number, row); MixedDecodingError if rows need different
    decodings, naming the first row of each kind."""
    first: dict[str, tuple[int, Any]] = {}
    for lineno, row in rows:
        kind = row_kind(row.get("result"), task)
        if kind is not None and kind not in first:
            first[kind] = (lineno, row.get("id"))
    if len(first) > 1:
        kinds = "; ".join(f"{path}:{lineno} ({entry_id}) holds {KIND_WORDS[k]}" for k, (lineno, entry_id) in
                          sorted(first.items(), key=lambda kv: kv[1][0]))
        raise MixedDecodingError(f"{path}: rows need different decodings: {kinds}. One decoding would drop the "
                                 "others' calls; split the file, or pass --decoding to score every row one way")
    if first:
        (kind, (lineno, _)), = first.items()
        return kind, f"rows hold {KIND_WORDS[kind]}, first at line {lineno}"
    return task.undetected_decoding(row.get("result") for _, row in rows)
