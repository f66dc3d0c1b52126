"""Single-turn BFCL result rows scored as `bfcl evaluate` scores them (`env.results` holds what is shared).

A single-turn `result` is one model output: `prompt` (the model's text, decoded as
`default_decode_ast_prompting`), `fc` (a list of `{name: "<JSON arguments>"}`, as a function-calling
handler's `decode_ast`), `calls` (this project's trajectories: `[[call strings]]`, one turn, one step). An
output that fails to decode is `ast_decoder:decoder_failed`.
"""

from __future__ import annotations

import json
from typing import Any

from rcgrpo_tasks.env import ast_decode
from rcgrpo_tasks.env.ast_decode import AstDecodeError
from rcgrpo_tasks.env.results import Decoding
from rcgrpo_tasks.env.rewards import EntryScore
from rcgrpo_tasks.env.single_turn import ast_check
from rcgrpo_tasks.env.single_turn.entries import SingleTurnEntry


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
