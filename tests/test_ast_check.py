"""env.ast_decode / env.single_turn.ast_check beyond agreement: the documented departures from bfcl-eval (refusals where
it would run model text or blow up, verdicts where it raises), the bounds, function-calling decoding, and
partial credit (`matched_calls`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
from bfcl_ast_reference import official_decode, official_outcome

from rcgrpo_tasks.env.ast_decode import AstDecodeError, decode_fc, decode_prompt, is_call_list
from rcgrpo_tasks.env.single_turn import ast_check
from rcgrpo_tasks.env.single_turn import entries as single_turn

DOC = {"name": "f", "description": "", "parameters": {"type": "dict", "properties": {
    "x": {"type": "integer"}, "rows": {"type": "array", "items": {"type": "dict"}}}, "required": ["x"]}}
GOLD = [{"f": {"x": [6], "rows": ["", [{"k": [1]}]]}}]


@pytest.mark.parametrize("text", ["f(x=abs(-3) * 2)", "f(x=len('abcdef') + 0)", "f(x='%d' % 6)", "f(x=2 ** 5000)"])
def test_arithmetic_beyond_literals_is_refused_where_bfcl_eval_evaluates_it(text):
    official_decode(text)  # bfcl-eval evaluates these (its module namespace, unbounded integers)
    verdict, decoded = ast_check.verdict_of_text([DOC], GOLD, "simple_python", text)
    assert decoded is None and verdict.error_type == "ast_decoder:decoder_failed" and "refused" in verdict.errors[0]


@pytest.mark.parametrize("text", ["f(x=__import__('os').system('touch {m}') + 1)",
                                  "f(x=open('{m}', 'w').write('x') * 1)", "f(x=(lambda: open('{m}', 'w'))())",
                                  "f(x=[exec('open(\"{m}\", \"w\")')] * 1)", "f(x=-__import__('os').system('touch {m}'))"])
def test_model_text_is_never_run(tmp_path, text):
    marker = tmp_path / "ran"
    try:
        decoded = decode_prompt(text.format(m=marker))
    except AstDecodeError:
        decoded = None
    assert not marker.exists()
    if decoded is not None:  # a call without keywords is kept as its source text, as bfcl-eval keeps it
        assert decoded == [{"f": {"x": text.format(m=marker)[4:-1]}}]


@pytest.mark.parametrize("text", ["f(x=9 ** 9 ** 9)", "f(x=1 << 10 ** 9)", "f(x=[0] * 10 ** 9)", "f(x='a' * 10 ** 9)",
                                  "f(x=[[0] * 9999] * 9999)", "f(x=(2 ** 4000) * (2 ** 4000))",
                                  "f(x=" + "1 + " * 250 + "1)", "f(x='" + "a" * 200_000 + "')",
                                  "[" + ", ".join(["f(x=[1, 2])"] * 3000) + "]"])
def test_bombs_are_refused_before_they_are_built(text):
    """Refused from the text, nothing of the bomb computed: what the decoder allocates stays small (a built bomb
    holds gigabytes). The CPU seconds: bench/refusals.py."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(AstDecodeError, match="refused|invalid syntax"):
            decode_prompt(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak


def test_arithmetic_within_bounds_matches_python():
    rng = random.Random(0)
    ops = ["+", "-", "*", "/", "//", "%", "**", "<<", ">>", "&", "|", "^"]
    for _ in range(400):
        a, b = rng.choice([rng.randint(-50, 50), round(rng.uniform(-9, 9), 3), True, "ab", [1], (2,)]), \
            rng.choice([rng.randint(-6, 6), 2.5, False, "c", [3], (4,)])
        text = f"f(x={a!r} {rng.choice(ops)} {b!r})"
        try:
            expected = ("ok", official_decode(text))
        except Exception:
            expected = ("error",)
        try:
            got = ("ok", decode_prompt(text))
        except AstDecodeError:
            got = ("error",)
        assert got == expected, text


def test_list_of_dicts_with_items_that_are_not_dicts_is_invalid_where_bfcl_eval_raises():
    text = "f(x=6, rows=[1])"  # the optional marker "" makes the nested type check pass vacuously
    with pytest.raises(AttributeError):
        official_outcome([DOC], GOLD, "simple_python", text)
    verdict, _ = ast_check.verdict_of_text([DOC], GOLD, "simple_python", text)
    assert not verdict.valid and verdict.error_type == "dict_checker:unclear"


def test_decode_fc():
    assert decode_fc([{"f": json.dumps({"x": 6})}, {"g": {"y": [1]}}]) == [{"f": {"x": 6}}, {"g": {"y": [1]}}]
    assert decode_fc([{"f": "[1]"}]) == [{"f": [1]}] and not is_call_list([{"f": [1]}])  # wrong format, later
    assert decode_fc([]) == []
    for bad in ["text", {"f": "{}"}, [{}], ["f"], [{"f": "{\"x\": "}], [{"f": 3}], [{"f": "1" * 5000}], None]:
        with pytest.raises(AstDecodeError):
            decode_fc(bad)


def test_is_call_list():
    assert is_call_list([]) and is_call_list([{"f": {}}, {"g": {"a": 1}}])
    for bad in [(), [{"f": {}, "g": {}}], [{"f": []}], ["f()"], {"f": {}}, [{}], None]:
        assert not is_call_list(bad)


def test_check_takes_only_call_lists_and_names_unknown_types():
    assert ast_check.check([DOC], "f(x=6)", GOLD, "simple_python").error_type == \
        "ast_decoder:decoder_wrong_output_format"
    doc = {**DOC, "parameters": {**DOC["parameters"], "properties": {"x": {"type": "object"}}}}
    with pytest.raises(ValueError, match="'f': parameter 'x' has type 'object'"):
        ast_check.check([doc], [{"f": {"x": 6}}], GOLD, "simple_python")
    verdict = ast_check.check([DOC], [{"f": {"x": 6}}], GOLD, "simple_python")
    assert verdict == ast_check.AstVerdict(True, None, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdict.valid = False


# ------------------------------------------------------------------------------------------ matched_calls


def _brute_force(ok: list[list[bool]]) -> int:
    n_gold, n_model = len(ok), len(ok[0]) if ok else 0
    best = 0
    for k in range(min(n_gold, n_model), 0, -1):
        for golds in itertools.combinations(range(n_gold), k):
            for models in itertools.permutations(range(n_model), k):
                if all(ok[g][m] for g, m in zip(golds, models)):
                    return k
    return best


def test_matched_calls_is_a_maximum_matching_where_bfcl_evals_greedy_checker_may_fail():
    doc = {"name": "f", "description": "", "parameters": {"type": "dict", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}
    gold = [{"f": {"x": [1, 2]}}, {"f": {"x": [1]}}]
    decoded = [{"f": {"x": 1}}, {"f": {"x": 2}}]
    assert ast_check.matched_calls([doc], decoded, gold) == 2
    # bfcl-eval gives gold 0 the first model call that fits, then finds none left for gold 1
    verdict = ast_check.check([doc], decoded, gold, "parallel")
    assert verdict.error_type == "parallel_function_checker_no_order:cannot_find_match"
    assert ast_check.matched_calls([doc], decoded[:1], gold) == 1  # one model call answers one gold call
    assert ast_check.matched_calls([doc], decoded[1:] * 3, gold) == 1  # x=2 answers gold 0 only
    assert ast_check.matched_calls([doc], "f(x=1)", gold) == 0


def test_matched_calls_equals_brute_force_on_real_parallel_entries():
    rng = random.Random(1)
    entries = [e for e in single_turn.load_entries(("parallel", "parallel_multiple", "live_parallel"))
               if 2 <= len(e.possible_answer) <= 4]
    for entry in rng.sample(entries, 30):
        gold = list(entry.possible_answer)
        calls = []
        for g in gold:
            (name, params), = g.items()
            args = {p: next(v for v in vs if v != "") for p, vs in params.items() if any(v != "" for v in vs)}
            calls.append({name: args})
            calls.append({name: {**args, **{p: "zz" for p in list(args)[:1]}}})
        decoded = rng.sample(calls, rng.randint(1, len(calls)))
        ok = [[ast_check.simple_function_checker(next(f for f in entry.functions if f["name"] == next(iter(g))),
                                                 c, g)["valid"] for c in decoded] for g in gold]
        assert ast_check.matched_calls(list(entry.functions), decoded, gold) == _brute_force(ok), entry.id
