"""bfcl-eval's own single-turn AST checker and prompt decoder, for side-by-side comparison (tests only).

`bfcl_eval.eval_checker.ast_eval.ast_checker` imports `bfcl_eval.constants.model_config`, which imports
every API client bfcl-eval supports; none is installed. The checker reads that module only for
`MODEL_CONFIG_MAPPING[model].underscore_to_dot`, so a stand-in module with two models (`plainmodel`,
`dotmodel`) is put in `sys.modules` before the import. The decoder `eval`s arithmetic in model text: only
hand-built and generated strings go through it, here.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

PLAIN, DOT = "plainmodel", "dotmodel"  # no "_": bfcl-eval maps "_" to "/" before the lookup


@dataclass(frozen=True)
class _Config:
    underscore_to_dot: bool


def _install_model_config() -> None:
    name = "bfcl_eval.constants.model_config"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.MODEL_CONFIG_MAPPING = {PLAIN: _Config(False), DOT: _Config(True)}
        sys.modules[name] = stub


def _modules():
    _install_model_config()
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import default_decode_ast_prompting
    from bfcl_eval.utils import is_function_calling_format_output

    return Language, ast_checker, default_decode_ast_prompting, is_function_calling_format_output


def official_decode(text):
    """bfcl-eval's prompt-mode decoder (raises where it fails)."""
    return _modules()[2](text)


def official_fc_decode(result):
    """The OpenAI FC handler's `decode_ast` (copied: the handler module imports the `openai` client)."""
    decoded = []
    for invoked_function in result:
        name = list(invoked_function.keys())[0]
        decoded.append({name: json.loads(invoked_function[name])})
    return decoded


def official_result(functions, decoded, possible_answer, category, underscore_to_dot=False) -> dict:
    """bfcl-eval's runner after decoding: the format check, then `ast_checker`'s result dict."""
    language, ast_checker, _, is_call_list = _modules()
    if not is_call_list(decoded):
        return {"valid": False, "error_type": "ast_decoder:decoder_wrong_output_format",
                "error": ["Did not output in the specified format. Note: the model_result is wrapped in a string to "
                          "ensure json serializability."]}
    return ast_checker(list(functions), decoded, list(possible_answer), language.PYTHON, category,
                       DOT if underscore_to_dot else PLAIN)


def official_check_decoded(functions, decoded, possible_answer, category, underscore_to_dot=False):
    """(valid, error_type) of bfcl-eval's runner after decoding."""
    result = official_result(functions, decoded, possible_answer, category, underscore_to_dot)
    return bool(result["valid"]), (None if result["valid"] else result["error_type"])


def official_outcome(functions, possible_answer, category, result, underscore_to_dot=False, decode=None):
    """(valid, error_type, messages) as `eval_runner._evaluate_single_ast_entry` decides for one model
    result, `decode` being the handler's `decode_ast` (default: prompt mode)."""
    try:
        decoded = (decode or official_decode)(result)
    except Exception:
        return False, "ast_decoder:decoder_failed", []
    out = official_result(functions, decoded, possible_answer, category, underscore_to_dot)
    return bool(out["valid"]), (None if out["valid"] else out["error_type"]), out.get("error", [])


def official_verdict(functions, possible_answer, category, result, underscore_to_dot=False, decode=None):
    """(valid, error_type) as bfcl-eval's runner decides."""
    return official_outcome(functions, possible_answer, category, result, underscore_to_dot, decode)[:2]
