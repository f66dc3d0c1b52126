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
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from rcgrpo_tasks.env import ast_check, ast_decode
from rcgrpo_tasks.env.ast_decode import AstDecodeError
from rcgrpo_tasks.env.scoring import EntryScore
from rcgrpo_tasks.env.single_turn import SingleTurnEntry

Decoding = Literal["calls", "prompt", "fc"]
DECODINGS: tuple[str, ...] = ("auto", "calls", "prompt", "fc")
KIND_WORDS = {"fc": "function-calling {name: arguments} objects", "prompt": "model text with calls",
              "calls": "lists of call strings"}


class MixedDecodingError(ValueError):
    """A file whose rows need different decodings; the message names the first row of each kind."""


# ---------------------------------------------------------------------------------------------- decoders


def _nested_value(value: Any) -> str:
    """bfcl-eval's `parse_nested_value`: a dict of dicts is a nested call `name(k=v)`, else a literal."""
    if isinstance(value, dict):
        if all(isinstance(v, dict) for v in value.values()):
            if not value:
                raise AstDecodeError("an empty dict argument (bfcl-eval reads it as a call without a name)")
            name = next(iter(value))
            return f"{name}({', '.join(f'{k}={_nested_value(v)}' for k, v in value[name].items())})"
        return "{" + ", ".join(f"'{k}': {_nested_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def prompt_calls(text: Any) -> list[str]:
    """Call strings of a multi-turn prompt-mode step (bfcl-eval `default_decode_execute_prompting`)."""
    decoded = ast_decode.decode_prompt(text)
    try:
        return [f"{name}({', '.join(f'{k}={_nested_value(v)}' for k, v in args.items())})"
                for call in decoded for name, args in call.items()]
    except RecursionError:
        raise AstDecodeError("arguments nested too deeply") from None


def fc_calls(step: Any) -> list[str]:
    """Call strings of a multi-turn function-calling step (bfcl-eval `convert_to_function_call`): every
    `{name: arguments}` pair of every object; text (a reply, not a call) fails."""
    if type(step) is dict:
        step = [step]
    if not isinstance(step, (list, str)):
        raise AstDecodeError(f"a function-calling step is a list of objects, got {type(step).__name__}")
    out = []
    for item in step:  # a non-empty string iterates characters and fails here, as in bfcl-eval
        if type(item) is not dict:
            raise AstDecodeError(f"not a {{name: arguments}} object: {str(item)[:60]!r}")
        for name, args in item.items():
            if type(args) is str:
                try:
                    args = json.loads(args)
                except (ValueError, RecursionError) as exc:
                    raise AstDecodeError(f"{name}: arguments are not JSON ({exc})") from None
            if type(args) is not dict:
                raise AstDecodeError(f"{name}: arguments are {type(args).__name__}, expected an object")
            out.append(f"{name}({','.join(f'{k}={v!r}' for k, v in args.items())})")
    return out


def decode_result(result: Any, decoding: Decoding) -> tuple[Any, int]:
    """(`result` as turns -> steps -> call strings, steps dropped because they did not decode) of a
    multi-turn row (`calls`: unchanged). A non-list result, or a turn that is not a list, is returned
    unchanged for the scorer to reject as bfcl-eval's runner does."""
    if decoding == "calls" or not isinstance(result, list) or not all(isinstance(t, list) for t in result):
        return result, 0
    decode = prompt_calls if decoding == "prompt" else fc_calls
    turns, dropped = [], 0
    for turn in result:
        steps = []
        for step in turn:
            try:
                steps.append(decode(step))
            except AstDecodeError:
                dropped += 1
        turns.append(steps)
    return turns, dropped


def single_turn_calls(result: Any, decoding: Decoding) -> list[dict]:
    """`[{name: args}]` of a single-turn row; AstDecodeError where bfcl-eval's decoder fails, ValueError for
    a `calls` result that is not `[[call strings]]` (a malformed trajectory, not a model's output)."""
    if decoding == "prompt":
        return ast_decode.decode_prompt(result)
    if decoding == "fc":
        return ast_decode.decode_fc(result)
    if not (isinstance(result, list) and all(isinstance(t, list) and all(
            isinstance(s, list) and all(isinstance(c, str) for c in s) for s in t) for t in result)):
        raise ValueError("a call-strings result is [[call strings]] (turns -> steps -> strings), got "
                         f"{json.dumps(result)[:80]}")
    return ast_decode.decode_prompt("[" + ", ".join(c for turn in result for step in turn for c in step) + "]")


def score_single_turn(entry: SingleTurnEntry, result: Any, decoding: Decoding,
                      underscore_to_dot: bool = False) -> tuple[EntryScore, int]:
    """(scores, 1 if the output did not decode else 0) of one single-turn row, as `SingleTurnEpisode.score`
    scores an output: `valid`/`error_type` = BFCL's AST verdict, `partial_credit` = gold calls matched one
    to one, `paper_reward` = valid."""
    functions, gold = list(entry.functions), list(entry.possible_answer)
    try:
        decoded = single_turn_calls(result, decoding)
    except AstDecodeError as exc:
        verdict = ast_check.decode_failure(exc)
        return EntryScore(valid=False, error_type=verdict.error_type, error_message=verdict.errors[0][:1000],
                          partial_credit=0.0, paper_reward=0.0, turn_passed=[False]), 1
    verdict = ast_check.check(functions, decoded, gold, entry.category, underscore_to_dot)
    matched = ast_check.matched_calls(functions, decoded, gold, underscore_to_dot)
    partial = matched / len(gold) if gold else float(verdict.valid)
    message = "; ".join(verdict.errors)[:1000] or None
    return EntryScore(valid=verdict.valid, error_type=verdict.error_type, error_message=message, partial_credit=partial,
                      paper_reward=float(verdict.valid), turn_passed=[verdict.valid]), 0


# ---------------------------------------------------------------------------------------------- detection


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


def _steps(result: Any, single_turn: bool) -> Iterable[Any]:
    """A single-turn result is one step; a multi-turn result that is not a list (an inference error) none."""
    if single_turn:
        yield result
        return
    if not isinstance(result, list):
        return
    for turn in result:
        if isinstance(turn, list):
            yield from turn


def row_kind(result: Any, single_turn: bool = False) -> str | None:
    """The decoding a row's result needs (`fc` before `prompt` before `calls` when its steps disagree, as
    a function-calling model's text replies sit beside its calls); None when nothing in it tells."""
    kinds = {_step_kind(step) for step in _steps(result, single_turn)}
    return next((k for k in ("fc", "prompt", "calls") if k in kinds), None)


def detect(results: Iterable[Any]) -> tuple[Decoding, str]:
    """(decoding, why) for results no row of which tells by itself: `fc` if any step holds a JSON object,
    else `prompt` if any step is text, else `calls`."""
    saw_text = False
    for result in results:
        for step in _steps(result, False):
            if isinstance(step, dict) or (isinstance(step, list) and any(isinstance(c, dict) for c in step)):
                return "fc", "steps hold {name: arguments} objects (a function-calling model's results)"
            saw_text = saw_text or isinstance(step, str)
    if saw_text:
        return "prompt", "steps are model text (a prompt-mode model's results)"
    return "calls", "steps are lists of call strings"


def choose_decoding(rows: list[tuple[int, dict]], path: str, single_turn: bool = False) -> tuple[str, str]:
    """(decoding, why) of a whole file of (line number, row); MixedDecodingError if rows need different
    decodings, naming the first row of each kind."""
    first: dict[str, tuple[int, Any]] = {}
    for lineno, row in rows:
        kind = row_kind(row.get("result"), single_turn)
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
    if single_turn:
        return "prompt", "outputs are text without calls (a prompt-mode model's results)"
    return detect(row.get("result") for _, row in rows)
