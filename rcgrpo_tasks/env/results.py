"""BFCL result files as `bfcl generate` writes them, decoded step by step as `bfcl evaluate` does.

A multi-turn result row is `{"id": ..., "result": turns}`, `turns[t][s]` one model step. What a step holds
depends on the model's handler:
- `calls`: a list of call strings, already decoded (this project's rollouts and trajectories);
- `prompt`: the model's raw text (prompt-mode models, e.g. `"[cd(folder='x')]"`), decoded by bfcl-eval's
  `default_decode_execute_prompting` (literal `ast` parsing, never `eval`);
- `fc`: function-calling models: a list of `{name: "<JSON arguments>"}` objects, decoded by bfcl-eval's
  `convert_to_function_call`; a text reply (a bare string, or a one-element text list) fails to decode.

As bfcl-eval's runner (`_evaluate_single_multi_turn_entry`) does, a step that fails to decode is dropped (one
that decodes to nothing is dropped by the scorer, as every empty step is), and a result that is not a list (`"Error during inference: ..."`) is left as it is, for
the scorer to judge an inference error. `detect` picks the decoding of a whole file from what its steps
hold; a handler with its own decoder (XML or JSON tool-call formats) is out of scope: decode those with
bfcl-eval first and score the call strings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

Decoding = Literal["calls", "prompt", "fc"]
DECODINGS: tuple[str, ...] = ("auto", "calls", "prompt", "fc")


@functools.cache
def _bfcl_decoder(decoding: str) -> Callable[[Any], list[str]]:
    try:
        from bfcl_eval.model_handler import utils
    except ImportError as exc:  # bfcl-eval is installed --no-deps: its handler module needs tree-sitter
        raise RuntimeError(f"decoding {decoding!r} uses bfcl-eval's model_handler.utils, which failed to import "
                           f"({exc}); install the project's pins (tree-sitter, tenacity)") from exc
    return utils.default_decode_execute_prompting if decoding == "prompt" else utils.convert_to_function_call


def _steps(results: Iterable[Any]) -> Iterable[Any]:
    for result in results:
        if isinstance(result, list):
            for turn in result:
                if isinstance(turn, list):
                    yield from turn


def detect(results: Iterable[Any]) -> tuple[Decoding, str]:
    """(decoding, why) for a file's results: `fc` if any step holds a JSON object, else `prompt` if any step
    is text, else `calls`."""
    saw_text = False
    for step in _steps(results):
        if isinstance(step, list) and any(isinstance(c, dict) for c in step) or isinstance(step, dict):
            return "fc", "steps hold {name: arguments} objects (a function-calling model's results)"
        saw_text = saw_text or isinstance(step, str)
    if saw_text:
        return "prompt", "steps are model text (a prompt-mode model's results)"
    return "calls", "steps are lists of call strings"


def decode_result(result: Any, decoding: Decoding) -> Any:
    """`result` as turns -> steps -> call strings (`calls`: unchanged). A non-list result, or a turn that is
    not a list, is returned unchanged for the scorer to reject as bfcl-eval's runner does."""
    if decoding == "calls" or not isinstance(result, list) or not all(isinstance(t, list) for t in result):
        return result
    decode = _bfcl_decoder(decoding)
    turns = []
    for turn in result:
        steps = []
        for step in turn:
            try:
                steps.append(decode(step))
            except Exception:  # bfcl-eval drops a step it cannot decode (text, a malformed call)
                continue
        turns.append(steps)
    return turns
