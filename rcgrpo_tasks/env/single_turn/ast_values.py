"""The value checks of BFCL's AST checker (bfcl-eval `ast_checker.py`), ported for `env.single_turn.ast_check`.

Same control flow, error types and messages as bfcl-eval's `type_checker`, `string_checker`,
`list_checker`, `dict_checker` and `list_dict_checker`, quirks included (they decide verdicts):
- `type_checker` checks one level of nested item types, and an accepted value that is not a list (`""`,
  the optional marker, or a variable name) passes the nested check vacuously;
- a value of the gold's own type where the doc says another is a "variable" (compared exactly later);
- strings are compared after `standardize_string` (lower case, no spaces or `,./-_*^`, `'` -> `"`); list
  items and dict values that are strings too, one level deep;
- `list_checker` reads the optional marker `""` as an accepted empty list;
- `dict_checker` keeps checking missing keys after an unexpected or wrong one, so the last failure names
  the error type.

Departure: where bfcl-eval raises on a model value (`dict_checker` given a list item that is not a dict, or
an accepted value that is a variable-name string instead of a dict), its run aborts; here the value is
invalid with `dict_checker:unclear`.
"""

from __future__ import annotations

import re
from typing import Any

PYTHON_TYPE_MAPPING: dict[str, type] = {
    "string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list, "dict": dict,
    "any": str,
}
PYTHON_NESTED_TYPE_CHECK_LIST = ("array", "tuple")
"""Types whose items' type is checked (one level)."""


def get_possible_answer_type(possible_answer: list) -> type | None:
    for answer in possible_answer:
        if answer != "":  # the optional marker says nothing about the type
            return type(answer)
    return None


def _nested_ok(param: str, value: list, possible_answer: list, nested: type) -> bool:
    """Some accepted value whose items all have the nested type (or that is not a list: vacuously)."""
    for item in possible_answer:
        if type(item) is not list:
            return True
        if all(type_checker(param, v, item, str(nested), nested, None)["valid"] for v in value):
            return True
    return False


def type_checker(param: str, value: Any, possible_answer: list, expected_type_description: str,
                 expected_type_converted: type, nested_type_converted: type | None) -> dict:
    """bfcl-eval's type check: `valid`, `is_variable` (a value of the gold's own type, compared as is)."""
    result: dict = {"valid": True, "error": [], "is_variable": False, "error_type": "type_error:simple"}
    answer_type = get_possible_answer_type(possible_answer)
    is_variable = answer_type is not None and answer_type != expected_type_converted
    if type(value) is expected_type_converted:
        if nested_type_converted is None:
            result["is_variable"] = is_variable
            return result
        if _nested_ok(param, value, possible_answer, nested_type_converted):
            return {"valid": True, "error": [], "is_variable": is_variable}
        result["valid"] = False
        result["error"] = [f"Nested type checking failed for parameter {param!r}. Expected outer type "
                           f"{expected_type_description} with inner type {nested_type_converted}. "
                           f"Parameter value: {value!r}."]
        result["error_type"] = "type_error:nested"
    if answer_type is not None and type(value) is answer_type:
        result["is_variable"] = True
        return result  # still invalid after a failed nested check, as in bfcl-eval
    result["valid"] = False
    result["error"].append(f"Incorrect type for parameter {param!r}. Expected type {expected_type_description}, "
                           f"got {type(value).__name__}. Parameter value: {value!r}.")
    result["error_type"] = "type_error:simple"
    return result


def standardize_string(input_string: str) -> str:
    """Lower case without spaces and `,./-_*^`, single quotes as double (`April 1, 2024` == `april 1 2024`)."""
    return re.sub(r"[ \,\.\/\-\_\*\^]", "", input_string).lower().replace("'", '"')


def _standardized(values) -> list:
    return [standardize_string(v) if type(v) is str else v for v in values]


def string_checker(param: str, model_output: str, possible_answer: list) -> dict:
    accepted = [standardize_string(a) for a in possible_answer if type(a) is str]
    if standardize_string(model_output) not in accepted:
        return {"valid": False, "error": [f"Invalid value for parameter {param!r}: {model_output!r}. Expected one "
                                          f"of {possible_answer}. Case insensitive."],
                "error_type": "value_error:string"}
    return {"valid": True, "error": []}


def list_checker(param: str, model_output: list, possible_answer: list) -> dict:
    # Iterating each accepted value makes the optional marker "" an accepted [] (bfcl-eval does the same).
    accepted = [_standardized(answer[j] for j in range(len(answer))) for answer in possible_answer]
    if _standardized(model_output) not in accepted:
        return {"valid": False, "error": [f"Invalid value for parameter {param!r}: {model_output!r}. Expected one "
                                          f"of {possible_answer}."],
                "error_type": "value_error:list/tuple"}
    return {"valid": True, "error": []}


def _check_dict(model_output: dict, possible_answer: dict) -> dict:
    """One accepted dict: bfcl-eval's loop body (an unexpected or wrong key stops the first pass; missing
    keys are still reported after it)."""
    result: dict = {"valid": False, "error": [], "error_type": "dict_checker:unclear"}
    flag = True
    for key, value in model_output.items():
        if key not in possible_answer:
            result["error"].append(f"Unexpected dict key parameter: '{key}'.")
            result["error_type"] = "value_error:dict_key"
            flag = False
            break
        accepted = _standardized(possible_answer[key])
        if (standardize_string(value) if type(value) is str else value) not in accepted:
            result["error"].append(f"Invalid value for parameter {key!r}: {value!r}. Expected one of {accepted}.")
            result["error_type"] = "value_error:dict_value"
            flag = False
            break
    for key, value in possible_answer.items():
        if key not in model_output and "" not in value:
            result["error"].append(f"Missing dict key parameter: '{key}'.")
            result["error_type"] = "value_error:dict_key"
            flag = False
            break
    return {"valid": True, "error": []} if flag else result


def dict_checker(param: str, model_output: dict, possible_answers: list) -> dict:
    """bfcl-eval's dict check: some accepted dict (the optional marker skipped) matches; else the last failure."""
    result: dict = {"valid": False, "error": [], "error_type": "dict_checker:unclear"}
    for possible_answer in possible_answers:
        if possible_answer == "":
            continue
        if type(model_output) is not dict or type(possible_answer) is not dict:
            # bfcl-eval raises here (`.items()` of a non-dict, a string indexed by a key)
            return {"valid": False, "error": [f"Cannot compare {model_output!r} with the accepted value "
                                              f"{possible_answer!r} of parameter {param!r} as dicts."],
                    "error_type": "dict_checker:unclear"}
        result = _check_dict(model_output, possible_answer)
        if result["valid"]:
            return result
    return result


def list_dict_checker(param: str, model_output: list, possible_answers: list) -> dict:
    """bfcl-eval's list-of-dicts check: some accepted list of the same length matches item by item."""
    result: dict = {"valid": False, "error": [], "error_type": "list_dict_checker:unclear"}
    for answer in possible_answers:
        if len(model_output) != len(answer):
            result = {"valid": False, "error": ["Wrong number of dictionaries in the list."],
                      "error_type": "value_error:list_dict_count"}
            continue
        flag = True
        for index, item in enumerate(model_output):
            result = dict_checker(param, item, [answer[index]])
            if not result["valid"]:
                flag = False
                break
        if flag:
            return {"valid": True, "error": []}
    return result
