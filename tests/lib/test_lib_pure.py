"""The library's pure parts: the goal and where it goes, the token draw, the generation metrics, RCTP rows,
the premise statistics. No torch."""

from __future__ import annotations

import random

import pytest

from rcgrpo.controllability import q_stats
from rcgrpo.draw import batch_tokens, group_tokens, sample_reward_tokens, token_seed
from rcgrpo.goal import (
    DEFAULT_LEVELS,
    check_levels,
    check_template,
    check_thresholds,
    format_goal,
    level_of,
    place_goal,
    remove_goal,
)
from rcgrpo.group_metrics import flat_fractions, generation_metrics, group_advantages, zero_std_fraction
from rcgrpo.rctp import label_row, rctp_rows

LOW, HIGH = DEFAULT_LEVELS
CHAT = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": "U2"}]


@pytest.mark.parametrize("place,index", [("first_user", 1), ("last_user", 3), ("system", 0)])
def test_the_goal_goes_to_one_message_and_the_input_is_untouched(place, index):
    goal = format_goal(HIGH)
    before = [dict(m) for m in CHAT]
    out = place_goal(CHAT, goal, place)
    assert CHAT == before
    assert [m["content"].endswith(goal) for m in out] == [i == index for i in range(len(CHAT))]
    assert remove_goal(out, goal) == CHAT  # wherever it went: what reward functions see


def test_removing_the_goal_undoes_every_place_and_shape():
    """Rewards see the user's prompt: `remove_goal` takes back what `place_goal` (or an environment's reset text)
    put in, for chats, plain text, multimodal parts and an inserted system message; another token's goal and an
    empty goal leave the prompt alone."""
    goal = format_goal(LOW)
    for place in ("first_user", "last_user", "system"):
        assert remove_goal(place_goal(CHAT, goal, place), goal) == CHAT
    no_system = CHAT[1:]
    assert remove_goal(place_goal(no_system, goal, "system"), goal) == no_system
    assert remove_goal(place_goal("Add 1 and 2.", goal), goal) == "Add 1 and 2."
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    assert remove_goal(place_goal(parts, goal), goal) == parts
    reset = [*CHAT, {"role": "user", "content": "Observation: ok" + goal}]  # an environment's reset appended it
    assert remove_goal(reset, goal)[-1]["content"] == "Observation: ok"
    other = place_goal(CHAT, format_goal(HIGH), "first_user")
    assert remove_goal(other, goal) == other and remove_goal(other, "") == other


def test_goal_places_of_other_prompt_shapes():
    goal = format_goal(LOW)
    assert place_goal("Q?", goal) == "Q?" + goal == place_goal("Q?", goal, "last_user")
    assert place_goal([{"role": "user", "content": "Q"}], goal, "system")[0] == {"role": "system",
                                                                                 "content": goal.lstrip("\n")}
    parts = place_goal([{"role": "user", "content": [{"type": "text", "text": "Q"}]}], goal)
    assert parts[0]["content"][-1] == {"type": "text", "text": goal}
    assert place_goal(CHAT, goal, "external") == CHAT and place_goal(CHAT, "", "first_user") == CHAT
    with pytest.raises(ValueError, match="no user message"):
        place_goal([{"role": "system", "content": "S"}], goal)
    with pytest.raises(ValueError, match="conversational"):
        place_goal("Q", goal, "system")
    with pytest.raises(ValueError, match="must be one of"):
        place_goal(CHAT, goal, "answer")


def test_level_checks_name_what_is_wrong():
    assert check_levels(["a", "b", "c"]) == ("a", "b", "c")
    for bad in (["a"], ["a", "a"], ["a", "x]"], ["", "b"]):
        with pytest.raises(ValueError, match="reward tokens"):
            check_levels(bad)
    with pytest.raises(ValueError, match="threshold"):
        check_thresholds([0.5], 3)
    with pytest.raises(ValueError, match="ascending"):
        check_thresholds([0.6, 0.5], 3)
    with pytest.raises(ValueError, match="token"):
        check_template("no placeholder")
    assert [level_of(r, [0.5]) for r in (0.0, 0.49, 0.5, 1.0)] == [0, 0, 1, 1]
    assert [level_of(r, [0.3, 0.7]) for r in (0.1, 0.5, 0.9)] == [0, 1, 2]


def test_each_process_share_of_the_draw_is_its_slice_of_the_whole_batch():
    """Groups straddle processes (8 rows, G=3): every process's share equals its slice of one process's draw."""
    whole = batch_tokens(24, 3, "rc", 0.5, seed=7, step=2, levels=DEFAULT_LEVELS)
    for procs in (2, 3, 4):
        rows = 24 // procs
        parts = [t for p in range(procs) for t in batch_tokens(rows, 3, "rc", 0.5, seed=7, step=2,
                                                                levels=DEFAULT_LEVELS, first_row=p * rows)]
        assert parts == whole
    assert whole[:3] == group_tokens(3, "rc", 0.5, 7, 2, 0, levels=DEFAULT_LEVELS)
    assert whole[:3] == sample_reward_tokens(3, "rc", 0.5, token_seed(7, 2, 0), levels=DEFAULT_LEVELS, g=3)
    assert batch_tokens(24, 3, "rc", 0.5, seed=7, step=3, levels=DEFAULT_LEVELS) != whole


def test_the_draw_modes():
    draws = [t for s in range(400) for t in sample_reward_tokens(5, "rc", 0.3, s, levels=DEFAULT_LEVELS)]
    assert abs(draws.count(HIGH) / len(draws) - 0.3) < 0.03
    strat = sample_reward_tokens(40, "rc", 0.5, 1, levels=DEFAULT_LEVELS, draw="stratified", g=4)
    assert all(set(strat[i:i + 4]) == {LOW, HIGH} for i in range(0, 40, 4))
    assert sample_reward_tokens(4, "fixed", levels=DEFAULT_LEVELS) == [HIGH] * 4
    assert sample_reward_tokens(4, "none", levels=DEFAULT_LEVELS) == [None] * 4
    three = ("<|low|>", "<|mid|>", "<|top|>")
    assert set(sample_reward_tokens(50, "rc", 0.5, 0, levels=three)) == {"<|low|>", "<|top|>"}


def test_generation_metrics_by_hand():
    """G=2, four groups: (1, 1) high/high flat at success, (0, 0) low/low flat at failure, (1, 0) high/low,
    (0.5, 0.5) with no token... counted by hand."""
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.4, 0.4]
    tokens = [HIGH, HIGH, LOW, LOW, HIGH, LOW, HIGH, LOW]
    adv = group_advantages(rewards, 2)
    m = generation_metrics(rewards, tokens, adv, 2, levels=DEFAULT_LEVELS, thresholds=[0.5])
    assert m["rc/frac_zero_std"] == 0.75 == zero_std_fraction(rewards, 2)
    assert (m["rc/frac_flat_fail"], m["rc/frac_flat_success"]) == (0.5, 0.25) == flat_fractions(rewards, 2)
    assert m["rc/reward_high"] == pytest.approx((1 + 1 + 1 + 0.4) / 4)
    assert m["rc/reward_low"] == pytest.approx(0.4 / 4)
    assert m["rc/success_high"] == 0.75 and m["rc/success_low"] == 0.0
    assert m["rc/controllability_gap"] == pytest.approx(3.4 / 4 - 0.1)
    assert m["rc/nonzero_adv_high"] == 1.0 and m["rc/nonzero_adv_low"] == 1.0
    assert m["rc/token_frac_high"] == 0.5


def test_rctp_rows_label_and_pair():
    rows = [{"prompt": "p1", "completion": "good", "reward": 1.0}, {"prompt": "p1", "completion": "bad", "reward": 0.0},
            {"prompt": "p1", "completion": "good2", "reward": 1.0}, {"prompt": "p2", "completion": "bad", "reward": 0.2},
            {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}],
             "reward": 0.9, "extra": 3}]
    out = rctp_rows(rows, seed=1)
    assert len(out) == 5
    pairs = [r for r in out if r["pair"] is not None]
    assert len(pairs) == 2 and out.index(pairs[1]) == out.index(pairs[0]) + 1
    assert {(r["completion"], r["reward_token"]) for r in pairs} == {("good", HIGH), ("bad", LOW)}
    assert all(r["prompt"].endswith(format_goal(r["reward_token"])) for r in out if isinstance(r["prompt"], str))
    chat = next(r for r in out if not isinstance(r["prompt"], str))
    assert chat["prompt"][0]["content"] == "q" + format_goal(HIGH) and chat["extra"] == 3
    assert len(rctp_rows(rows, unpaired="drop")) == 2
    assert rctp_rows(rows, seed=1) == out
    with pytest.raises(ValueError, match="'reward'"):
        label_row({"prompt": "p", "completion": "c"})


def test_q_by_hand():
    pairs = {"a": [(1, 0), (1, 1), (0, 0)], "b": [(1, 0), (0, 1)]}
    s = q_stats(pairs, n_boot=200)
    assert s["q"] == pytest.approx(2 / 3) and s["high_successes"] == 3
    assert (s["high_only"], s["low_only"], s["pairs"]) == (2, 1, 5)
    assert s["q_ci"][0] <= s["q"] <= s["q_ci"][1]
    random.seed(0)
