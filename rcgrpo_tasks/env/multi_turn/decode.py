"""BFCL v4 multi-turn result rows decoded as `bfcl evaluate` decodes them (`env.results` holds what is shared).

A multi-turn `result` is `turns[t][s]`, one model step each: `calls` (a list of call strings, already
decoded: this project's rollouts and trajectories), `prompt` (the model's raw text, `"[cd(folder='x')]"`,
decoded as bfcl-eval's `default_decode_execute_prompting`), `fc` (a function-calling model's list of
`{name: "<JSON arguments>"}`, decoded as bfcl-eval's `convert_to_function_call`; a text reply fails). As
bfcl-eval's runner does, a step that fails to decode is dropped, and a result that is not a list (`"Error
during inference: ..."`) is left for the scorer to judge an inference error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from rcgrpo_tasks.env import ast_decode
from rcgrpo_tasks.env.ast_decode import AstDecodeError
from rcgrpo_tasks.env.results import Decoding


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


def result_steps(result: Any) -> Iterable[Any]:
    """The steps of a multi-turn result; a result that is not a list (an inference error) has none."""
    if not isinstance(result, list):
        return
    for turn in result:
        if isinstance(turn, list):
            yield from turn


def detect(results: Iterable[Any]) -> tuple[Decoding, str]:
    """(decoding, why) for results no row of which tells by itself: `fc` if any step holds a JSON object,
    else `prompt` if any step is text, else `calls`."""
    saw_text = False
    for result in results:
        for step in result_steps(result):
            if isinstance(step, dict) or (isinstance(step, list) and any(isinstance(c, dict) for c in step)):
                return "fc", "steps hold {name: arguments} objects (a function-calling model's results)"
            saw_text = saw_text or isinstance(step, str)
    if saw_text:
        return "prompt", "steps are model text (a prompt-mode model's results)"
    return "calls", "steps are lists of call strings"
