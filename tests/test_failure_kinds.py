"""What a failure is made of (`env.failures`): no call, wrong function, wrong arguments, on both tasks' real
entries: the expert answer succeeds, prose has no call, each near-miss kind lands where its change says."""

from __future__ import annotations

import random

import pytest
from helpers import get_entry

from rcgrpo_tasks.env.failures import FAILURE_KINDS, call_names, failure_kind, is_wrong_call, result_calls
from rcgrpo_tasks.env.single_turn import entries as single_turn
from rcgrpo_tasks.env.tasks import task_of


def test_kinds_from_calls_and_gold_names():
    assert failure_kind(["f(a=1)"], ["f"], success=True, exact=True) is None
    assert failure_kind([], ["f"], success=False, exact=True) == "no_call"
    assert failure_kind(["The answer is 4."], ["f"], success=False, exact=True) == "no_call"
    assert failure_kind(["g(a=1)"], ["f"], success=False, exact=True) == "wrong_function"
    assert failure_kind(["f(a=1)", "f(a=2)"], ["f"], success=False, exact=True) == "wrong_function"  # a call too many
    assert failure_kind(["f(a=2)"], ["f"], success=False, exact=True) == "wrong_arguments"
    # multi-turn: extra calls allowed, the gold's must be covered
    assert failure_kind(["ls()", "cd(folder='a')"], ["cd"], success=False, exact=False) == "wrong_arguments"
    assert failure_kind(["ls()"], ["cd", "ls"], success=False, exact=False) == "wrong_function"
    assert call_names(["math.factorial(n=5)", "x = 3", ""]) == {"math.factorial": 1}
    assert result_calls([[["f()"], []], [["g()"]]]) == ["f()", "g()"] and result_calls("oops") == []
    assert is_wrong_call([[["f(a=2)"]]], success=False) and not is_wrong_call([[]], success=False)
    assert not is_wrong_call([[["f(a=1)"]]], success=True)


def _single_turn(entry_id: str):
    category = single_turn.category_of(entry_id)
    return next(e for e in single_turn.load_entries([category]) if e.id == entry_id)


@pytest.mark.parametrize("entry_id", ["simple_python_3", "multiple_5"])
def test_single_turn_answers_classify_as_their_change(entry_id):
    entry = _single_turn(entry_id)
    task = task_of(entry)
    expert = [[list(task.expert_script(entry)[0])]]  # turns -> steps -> call strings
    assert task.score(entry, expert).paper_reward == 1.0
    assert task.failure_kind(entry, expert, success=True) is None
    assert task.failure_kind(entry, [[]], success=False) == "no_call"
    want = {"wrong_arg_value": "wrong_arguments", "missing_param": "wrong_arguments",
            "wrong_function": "wrong_function", "extra_call": "wrong_function", "dropped_call": "no_call"}
    seen = set()
    for kind in task.perturbations:
        p = task.perturb(entry, kind, random.Random(0))
        if p is None:
            continue
        result = [[list(p.turns[0])]] if p.turns else [[]]
        score = task.score(entry, result)
        if score.paper_reward == 1.0:
            continue  # a harmless change (the generate stage rejects these)
        got = task.failure_kind(entry, result, success=False)
        assert got == want[kind] and got in FAILURE_KINDS, (kind, result, score.error_type)
        seen.add(got)
    assert "wrong_arguments" in seen


def test_multi_turn_answers_classify_as_their_change():
    entry = get_entry("multi_turn_base_0")
    task = task_of(entry)
    gold = [list(t) for t in entry.ground_truth]
    assert task.failure_kind(entry, [[t] for t in gold], success=True) is None
    assert task.failure_kind(entry, [[[]] for _ in gold], success=False) == "no_call"
    assert task.failure_kind(entry, [[["ls()"]] for _ in gold], success=False) == "wrong_function"
    first = gold[0][0]
    name = first.split("(")[0]
    wrong_args = [[[f"{name}(zzz='nope')", *gold[0][1:]]], *[[t] for t in gold[1:]]]
    assert task.failure_kind(entry, wrong_args, success=False) == "wrong_arguments"
