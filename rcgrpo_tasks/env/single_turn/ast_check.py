"""BFCL's AST checker for Python single-turn outputs, reimplemented: bfcl-eval's verdicts without its import.

bfcl-eval's `eval_checker.ast_eval.ast_checker` cannot be imported by the product: it imports
`bfcl_eval.constants.model_config`, which imports every API client bfcl-eval supports (none installed here),
for one per-model flag, `underscore_to_dot`. This module ports the checker's Python path: the same control
flow, error types and messages (tests/test_ast_agreement.py compares them with bfcl-eval's own checker on
hand-built and generated outputs of every category):
- category dispatch: `parallel` in the category -> the order-free parallel checker; `multiple` -> the
  multiple checker (one call, the gold's function); otherwise the simple checker (exactly one call, checked
  against the FIRST function doc, as bfcl-eval does);
- per call (`simple_function_checker`): the name (dots -> underscores under `underscore_to_dot`, as
  bfcl-eval's `convert_func_name` does for models that cannot send dots), required parameters, unexpected
  parameters (absent from the doc or from the gold), types (int accepted for float; a tuple for a `tuple`
  parameter read as a list; one level of nested item types; a value of the gold's own type read as a
  "variable" and compared exactly), values (strings compared lower-cased without spaces and `,./-_*^`;
  lists, dicts and lists of dicts through bfcl-eval's own checkers; anything else by `in`), then gold
  parameters the model left out that are not optional (`""` among the accepted values).

Departure: where bfcl-eval's checker raises on a model value (a list-of-dicts parameter whose items are not
dicts, reached when the nested type check passes vacuously because an accepted value is not a list; a
variable-name gold string indexed as a dict), the run aborts in bfcl-eval; here the call is invalid with
`dict_checker:unclear` (bfcl-eval's own default error type of that checker).

Also here: `verdict_of_text` (the runner's `_evaluate_single_ast_entry` for a prompt-mode output: decode,
format check, check) and `matched_calls` (partial credit: a maximum one-to-one matching of model calls to
gold calls under the per-call check).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rcgrpo_tasks.env import ast_decode
from rcgrpo_tasks.env.single_turn.ast_values import (
    PYTHON_NESTED_TYPE_CHECK_LIST,
    PYTHON_TYPE_MAPPING,
    dict_checker,
    list_checker,
    list_dict_checker,
    string_checker,
    type_checker,
)

DECODER_FAILED = "ast_decoder:decoder_failed"
WRONG_FORMAT = "ast_decoder:decoder_wrong_output_format"


@dataclass(frozen=True)
class AstVerdict:
    """bfcl-eval's verdict on one output: valid, its error type (None when valid) and its messages."""

    valid: bool
    error_type: str | None
    errors: tuple[str, ...] = ()


def _message(error: Any) -> str:
    """bfcl-eval's parallel checker nests per-candidate dicts among its messages; flatten them to text."""
    if isinstance(error, dict):
        return "; ".join(f"{k}: {v.get('sub_error_type')}: {' '.join(map(str, v.get('sub_error', [])))}"
                         if isinstance(v, dict) else f"{k}: {v}" for k, v in error.items())
    return str(error)


def _verdict(result: dict) -> AstVerdict:
    if result["valid"]:
        return AstVerdict(True, None, ())
    return AstVerdict(False, result["error_type"], tuple(_message(e) for e in result["error"]))


def _find_description(functions: list, name: str) -> dict | None:
    for doc in functions:
        if doc["name"] == name:
            return doc
    return None


def _convert_func_name(name: str, underscore_to_dot: bool) -> str:
    if "." in name and underscore_to_dot:
        return re.sub(r"\.", "_", name)
    return name


def _param_types(details: dict, param: str, function: str) -> tuple[str, type, type | None]:
    """(type as the doc spells it, its Python type, the item type of an array/tuple)."""
    spelt = details[param]["type"]
    if spelt not in PYTHON_TYPE_MAPPING:
        raise ValueError(f"function {function!r}: parameter {param!r} has type {spelt!r}, which BFCL's checker "
                         f"does not know (expected one of {sorted(PYTHON_TYPE_MAPPING)})")
    nested = None
    if spelt in PYTHON_NESTED_TYPE_CHECK_LIST:
        item_type = details[param]["items"]["type"]
        if item_type not in PYTHON_TYPE_MAPPING:
            raise ValueError(f"function {function!r}: parameter {param!r} has item type {item_type!r}, which "
                             "BFCL's checker does not know")
        nested = PYTHON_TYPE_MAPPING[item_type]
    return spelt, PYTHON_TYPE_MAPPING[spelt], nested


def _check_value(param: str, value: Any, accepted: list, details: dict, function: str) -> dict | None:
    """None if one parameter's value passes, else bfcl-eval's failing result."""
    spelt, expected, nested = _param_types(details, param, function)
    if spelt == "tuple" and type(value) is tuple:
        value = list(value)
    if spelt == "float" and type(value) is int:
        value = float(value)
    typed = type_checker(param, value, accepted, spelt, expected, nested)
    if not typed["valid"]:
        return typed
    if not typed["is_variable"]:
        if expected is dict:
            checked = dict_checker(param, value, accepted)
        elif expected is list and nested is dict:
            checked = list_dict_checker(param, value, accepted)
        elif expected is str:
            checked = string_checker(param, value, accepted)
        elif expected is list:
            checked = list_checker(param, value, accepted)
        else:
            checked = None
        if checked is not None:
            return None if checked["valid"] else checked
    if value not in accepted:
        return {"valid": False, "error": [f"Invalid value for parameter {param!r}: {value!r}. Expected one of "
                                          f"{accepted}."], "error_type": "value_error:others"}
    return None


def _fail(message: str, error_type: str) -> dict:
    return {"valid": False, "error": [message], "error_type": error_type}


def simple_function_checker(doc: dict, call: dict, gold: dict, underscore_to_dot: bool = False) -> dict:
    """bfcl-eval's check of one model call `{name: params}` against one gold call `{name: {param: [values]}}`
    with the function's doc."""
    accepted_by_param = list(gold.values())[0]
    details = doc["parameters"]["properties"]
    func_name = _convert_func_name(doc["name"], underscore_to_dot)
    if func_name not in call:
        return _fail(f"Function name {func_name!r} not found in model output.",
                     "simple_function_checker:wrong_func_name")
    params = call[func_name]
    for param in doc["parameters"]["required"]:
        if param not in params:
            return _fail(f"Missing required parameter: {param!r}.", "simple_function_checker:missing_required")
    for param, value in params.items():
        if param not in details or param not in accepted_by_param:
            return _fail(f"Unexpected parameter: {param!r}.", "simple_function_checker:unexpected_param")
        failed = _check_value(param, value, accepted_by_param[param], details, doc["name"])
        if failed is not None:
            return failed
    for param, accepted in accepted_by_param.items():
        if param not in params and "" not in accepted:
            return _fail(f"Optional parameter {param!r} not provided and not marked as optional.",
                         "simple_function_checker:missing_optional")
    return {"valid": True, "error": []}


def _parallel_no_order(functions: list, calls: list, gold: list, underscore_to_dot: bool) -> dict:
    if len(calls) != len(gold):
        return _fail("Wrong number of functions.", "parallel_function_checker_no_order:wrong_count")
    matched: list[int] = []
    for i, gold_call in enumerate(gold):
        doc = _find_description(functions, next(iter(gold_call)))
        all_errors: list = []
        result: dict = {"valid": False}
        for index, call in enumerate(calls):
            if index in matched:
                continue
            result = simple_function_checker(doc, call, gold_call, underscore_to_dot)
            if result["valid"]:
                matched.append(index)
                break
            all_errors.append({f"Model Result Index {index}": {
                "sub_error": result["error"], "sub_error_type": result["error_type"],
                "model_output_item": call, "possible_answer_item": gold_call}})
        if not result["valid"]:
            considered = [k for k in range(len(calls)) if k not in matched]
            all_errors.insert(0, f"Could not find a matching function among index {considered} of model output "
                                 f"for index {i} of possible answers.")
            return {"valid": False, "error": all_errors,
                    "error_type": "parallel_function_checker_no_order:cannot_find_match"}
    return {"valid": True, "error": []}


def _multiple(functions: list, calls: list, gold: list, underscore_to_dot: bool) -> dict:
    if len(calls) != len(gold):
        return _fail("Wrong number of functions.", "multiple_function_checker:wrong_count")
    doc = _find_description(functions, next(iter(gold[0])))
    return simple_function_checker(doc, calls[0], gold[0], underscore_to_dot)


def check(functions: list, decoded: list, possible_answer: list, category: str,
          underscore_to_dot: bool = False) -> AstVerdict:
    """bfcl-eval's `ast_checker` verdict for Python: `decoded` = `[{name: {param: value}}]` (a decoder's
    output; anything else is `ast_decoder:decoder_wrong_output_format`, as the runner says before checking),
    `possible_answer` = the entry's ground truth, `category` picks the checker as bfcl-eval does."""
    if not ast_decode.is_call_list(decoded):
        return AstVerdict(False, WRONG_FORMAT, ("Did not output in the specified format. Note: the model_result is "
                                                "wrapped in a string to ensure json serializability.",))
    functions, possible_answer = list(functions), list(possible_answer)
    if "parallel" in category:
        return _verdict(_parallel_no_order(functions, decoded, possible_answer, underscore_to_dot))
    if "multiple" in category:
        return _verdict(_multiple(functions, decoded, possible_answer, underscore_to_dot))
    if len(decoded) != 1:
        return AstVerdict(False, "simple_function_checker:wrong_count", ("Wrong number of functions.",))
    return _verdict(simple_function_checker(functions[0], decoded[0], possible_answer[0], underscore_to_dot))


def decode_failure(exc: Exception) -> AstVerdict:
    """The runner's verdict on an output its decoder cannot read."""
    return AstVerdict(False, DECODER_FAILED, (f"Invalid syntax. Failed to decode AST. {exc}",))


def verdict_of_text(functions: list, possible_answer: list, category: str, text: str,
                    underscore_to_dot: bool = False) -> tuple[AstVerdict, list[dict] | None]:
    """(verdict, decoded calls) of a prompt-mode output as bfcl-eval's runner judges it: decode
    (`ast_decode.decode_prompt`; a failure or a refusal -> `ast_decoder:decoder_failed`, decoded None),
    format check, then `check`."""
    try:
        decoded = ast_decode.decode_prompt(text)
    except ast_decode.AstDecodeError as exc:
        return decode_failure(exc), None
    return check(functions, decoded, possible_answer, category, underscore_to_dot), decoded


def matched_calls(functions: list, decoded: list, possible_answer: list, underscore_to_dot: bool = False) -> int:
    """Size of a maximum one-to-one matching of model calls to gold calls, a pair matching iff the per-call
    check passes (partial credit: every gold call of a parallel entry a model call answers). 0 for output
    that is not a call list."""
    if not ast_decode.is_call_list(decoded):
        return 0
    functions = list(functions)
    edges = []
    for gold_call in possible_answer:
        doc = _find_description(functions, next(iter(gold_call)))
        edges.append([j for j, call in enumerate(decoded)
                      if doc is not None and simple_function_checker(doc, call, gold_call, underscore_to_dot)["valid"]])
    owner: dict[int, int] = {}  # model call -> gold call it answers

    def augment(i: int, seen: set[int]) -> bool:
        for j in edges[i]:
            if j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return sum(augment(i, set()) for i in range(len(edges)))
