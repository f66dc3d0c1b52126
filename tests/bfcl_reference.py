"""bfcl-eval's own multi-turn checker, wrapped for side-by-side comparison (tests and bench only).

Never used on model output in the pipeline: bfcl-eval `eval`s call strings and caches environment
instances in `multi_turn_utils` module globals keyed by model name + entry id. This wrapper gives each
check a unique model name and deletes the instances it created afterwards, and reproduces what the
official runner (`eval_runner._evaluate_single_multi_turn_entry`) does before calling the checker:
reject non-list results, force-terminate on a wrong turn count, drop empty decoded steps.
"""

from __future__ import annotations

import itertools
import re

from rcgrpo_tasks.env.multi_turn.entries import Entry

_counter = itertools.count()


def _modules():
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils

    return multi_turn_checker, multi_turn_utils


def official_check(entry: Entry, model_turns: list) -> tuple[bool, str | None]:
    """(valid, error_type) exactly as bfcl-eval's runner + `multi_turn_checker` decide."""
    checker, utils = _modules()
    if not isinstance(model_turns, list):
        return False, "multi_turn:inference_error"
    if len(model_turns) != len(entry.ground_truth):
        return False, "multi_turn:force_terminated"
    decoded = [[step for step in turn if not utils.is_empty_execute_response(step)] for turn in model_turns]
    model_name = f"rcgrpo_ref_{next(_counter)}"
    test_entry = {"id": entry.id, "initial_config": entry.initial_config,
                  "involved_classes": list(entry.involved_classes)}
    try:
        result = checker.multi_turn_checker(decoded, [list(t) for t in entry.ground_truth], test_entry,
                                            f"multi_turn_{entry.category}", model_name)
    finally:
        prefix = re.sub(r"[-./:]", "_", model_name)
        for key in [k for k in vars(utils) if k.startswith(prefix)]:
            del vars(utils)[key]
    return bool(result["valid"]), result.get("error_type")


def official_check_raw(entry: Entry, result, decode) -> tuple[bool, str | None]:
    """(valid, error_type) of a `bfcl generate` result whose steps `decode` (a bfcl-eval handler's
    `decode_execute`) turns into call strings, as `eval_runner._evaluate_single_multi_turn_entry` does:
    a non-list result is an inference error, a wrong turn count force-terminates, and a step that fails to
    decode or decodes to nothing is dropped."""
    _, utils = _modules()
    if not isinstance(result, list):
        return False, "multi_turn:inference_error"
    if len(result) != len(entry.ground_truth):
        return False, "multi_turn:force_terminated"
    decoded = []
    for turn in result:
        steps = []
        for step in turn:
            try:
                calls = decode(step)
            except Exception:
                continue
            if not utils.is_empty_execute_response(calls):
                steps.append(calls)
        decoded.append(steps)
    return official_check(entry, decoded)
