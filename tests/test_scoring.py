"""The scorer against bfcl-eval's own checker, side by side, plus the paper reward and partial credit."""

import random

import pytest
from bfcl_reference import official_check
from helpers import get_entry

from rcgrpo_tasks.env.multi_turn import perturb
from rcgrpo_tasks.env.multi_turn.entries import load_entries
from rcgrpo_tasks.env.multi_turn.scoring import score_entry

ENTRIES = load_entries()


def as_result(turns):
    """One step per turn (BFCL result format: turns -> steps -> calls); an empty turn has no steps."""
    return [[list(calls)] if calls else [] for calls in turns]


def split_steps(turns, rng):
    """The same calls with each turn cut into 1..n steps (must not change any verdict)."""
    out = []
    for calls in map(list, turns):
        cuts = sorted(rng.sample(range(1, len(calls)), rng.randint(0, len(calls) - 1))) if len(calls) > 1 else []
        bounds = [0, *cuts, len(calls)]
        out.append([calls[a:b] for a, b in zip(bounds, bounds[1:])] if calls else [])
    return out


def swapped_order(turns, rng):
    multi = [t for t, calls in enumerate(turns) if len(calls) >= 2]
    if not multi:
        return None
    out = [list(c) for c in turns]
    t = rng.choice(multi)
    a, b = rng.sample(range(len(out[t])), 2)
    out[t][a], out[t][b] = out[t][b], out[t][a]
    return out


def empty_turn(turns, rng):
    out = [list(c) for c in turns]
    out[rng.choice([t for t, c in enumerate(out) if c])] = []
    return out


def test_all_800_ground_truths_valid_under_both_scorers():
    assert len(ENTRIES) == 800
    for e in ENTRIES:
        result = as_result(e.ground_truth)
        ours = score_entry(e, result)
        assert (ours.valid, ours.paper_reward, ours.partial_credit) == (True, 1.0, 1.0), (e.id, ours)
        assert official_check(e, result) == (True, None), e.id


def _perturbed_cases(n: int, seed: int = 0):
    rng = random.Random(seed)
    kinds = (*perturb.PERTURBATIONS, "swapped_order", "empty_turn", "split_steps", "wrong_turn_count")
    while n:
        e = rng.choice(ENTRIES)
        kind = rng.choice(kinds)
        gold = [list(t) for t in e.ground_truth]
        if kind == "split_steps":
            result = split_steps(gold, rng)
        elif kind == "wrong_turn_count":
            result = as_result(gold[:-1] if rng.random() < 0.5 else gold + [[]])
        else:
            if kind == "swapped_order":
                p = swapped_order(gold, rng)
            elif kind == "empty_turn":
                p = empty_turn(gold, rng)
            else:
                pert = perturb.perturb(e, kind, rng)
                p = pert and [list(t) for t in pert.turns]
            if p is None:
                continue
            result = split_steps(p, rng) if rng.random() < 0.3 else as_result(p)
        n -= 1
        yield e, kind, result


def test_verdicts_equal_bfcl_eval_on_1200_perturbed_trajectories():
    seen_kinds, seen_errors, mismatches = set(), set(), []
    for e, kind, result in _perturbed_cases(1200):
        ours = score_entry(e, result)
        official = official_check(e, result)
        seen_kinds.add(kind)
        seen_errors.add(ours.error_type)
        if (ours.valid, ours.error_type) != official:
            mismatches.append((e.id, kind, (ours.valid, ours.error_type), official))
    assert not mismatches, mismatches[:5]
    # the sample exercised every perturbation and every verdict class
    assert seen_kinds == {*perturb.PERTURBATIONS, "swapped_order", "empty_turn", "split_steps", "wrong_turn_count"}
    assert {None, "multi_turn:force_terminated", "multi_turn:empty_turn_model_response",
            "multi_turn:instance_state_mismatch", "multi_turn:execution_response_mismatch"} <= seen_errors


def test_paper_reward_binds_positional_and_default_arguments():
    e = get_entry("multi_turn_miss_func_0")
    gold = [list(t) for t in e.ground_truth]
    assert "sort('final_report.pdf')" in gold[3]
    renamed = [[c.replace("sort('final_report.pdf')", "sort(file_name='final_report.pdf')") for c in t] for t in gold]
    s = score_entry(e, as_result(renamed))
    assert s.valid and s.paper_reward == 1.0


def test_paper_reward_ignores_turn_boundaries_but_needs_every_gold_call():
    e = get_entry("multi_turn_base_1")
    flat = [c for t in e.ground_truth for c in t]
    merged = [[flat]]  # the paper protocol: one long episode
    s = score_entry(e, merged)
    assert s.paper_reward == 1.0 and not s.valid and s.error_type == "multi_turn:force_terminated"
    s = score_entry(e, [[flat[:-1]]])
    assert s.paper_reward == 0.0


def test_partial_credit_counts_passing_turns():
    e = next(x for x in ENTRIES if sum(1 for t in x.ground_truth if t) >= 3)
    gold = [list(t) for t in e.ground_truth]
    checked = [i for i, t in enumerate(gold) if t]
    last = checked[-1]
    broken = [list(t) for t in gold]
    broken[last] = []
    s = score_entry(e, as_result(broken))
    assert not s.valid and s.error_type == "multi_turn:empty_turn_model_response"
    assert s.partial_credit == pytest.approx((len(checked) - 1) / len(checked))
    assert s.turn_passed == [True] * (len(checked) - 1) + [False]


@pytest.mark.parametrize("bad", ["not a list", [["cd(folder='x')"]], [[[1, 2]]]])
def test_malformed_results_are_inference_errors(bad):
    s = score_entry(get_entry("multi_turn_base_0"), bad)
    assert not s.valid and s.error_type == "multi_turn:inference_error"
