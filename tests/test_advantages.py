"""Pure GRPO / RC-GRPO functions on hand-built groups (no model)."""

from __future__ import annotations

import math

import pytest
from helpers import HIGH, LEVELS, LOW

from rcgrpo import draw, group_metrics
from rcgrpo_tasks.train.rl import advantages as adv


def _obedient_rewards(tokens):
    """A reward-conditioned policy that does what its token says: succeeds on high, fails on low."""
    return [1.0 if t == HIGH else 0.0 for t in tokens]


def test_rc_group_split_by_token_has_signal_where_grpo_has_none():
    g = 4
    # GRPO from an RCTP init: every rollout conditioned on high -> this policy always succeeds.
    fixed = draw.sample_reward_tokens(g, "fixed", levels=LEVELS)
    grpo_rewards = _obedient_rewards(fixed)
    grpo_adv = group_metrics.group_advantages(grpo_rewards, g)
    assert all(abs(a) < 1e-9 for a in grpo_adv)
    assert group_metrics.zero_std_fraction(grpo_rewards, g) == 1.0

    # RC-GRPO: the same policy, tokens split within the group -> rewards differ -> non-zero advantages.
    rc = [HIGH, LOW, HIGH, LOW]
    rc_rewards = _obedient_rewards(rc)
    rc_adv = group_metrics.group_advantages(rc_rewards, g)
    assert all(abs(a) > 0.5 for a in rc_adv)
    assert [a > 0 for a in rc_adv] == [t == HIGH for t in rc]
    assert group_metrics.zero_std_fraction(rc_rewards, g) == 0.0
    assert group_metrics.controllability_gap(rc_rewards, rc, levels=LEVELS) == 1.0
    assert group_metrics.advantage_spread(rc_adv) > group_metrics.advantage_spread(grpo_adv)


def test_group_advantage_is_over_whole_group_regardless_of_token():
    # Two groups of 3; advantage of each rollout uses its own group's mean/std, tokens play no part.
    rewards = [1.0, 0.0, 0.0, 0.5, 0.5, 1.0]
    a = group_metrics.group_advantages(rewards, 3)
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert a[0] == pytest.approx((1 - mean) / (std + group_metrics.ADV_EPS))
    assert sum(a[:3]) == pytest.approx(0.0, abs=1e-9)
    assert sum(a[3:]) == pytest.approx(0.0, abs=1e-9)
    assert group_metrics.group_advantages(rewards, 3, scale="none")[0] == pytest.approx(1 - mean)


def test_zero_std_uses_a_tolerance():
    # Float noise below the tolerance still counts as "no signal"; a real difference does not.
    assert group_metrics.zero_std_fraction([0.3, 0.3 + 1e-9, 0.3, 0.3], 4) == 1.0
    assert group_metrics.zero_std_fraction([0.3, 0.3 + 1e-9, 0.3, 0.3], 4, tol=0.0) == 0.0
    assert group_metrics.zero_std_fraction([0.3, 0.4, 0.3, 0.3, 1, 1, 1, 1], 4) == 0.5


def test_token_sampling_frequency_matches_p():
    # Binomial test with a fixed seed: n=20000 draws, |freq - p| within 4 standard errors for every p.
    n = 20_000
    for p in (0.5, 0.2, 0.8):
        tokens = draw.sample_reward_tokens(n, "rc", p=p, seed=1234, levels=LEVELS)
        freq = sum(t == HIGH for t in tokens) / n
        se = math.sqrt(p * (1 - p) / n)
        assert abs(freq - p) < 4 * se, (p, freq)
        assert set(tokens) == {HIGH, LOW}
    # Per-group draws across many seeds (as the trainer makes them): all-high groups occur (i.i.d.).
    groups = [draw.sample_reward_tokens(4, "rc", 0.5, draw.token_seed(0, step), levels=LEVELS) for step in range(400)]
    all_high = sum(all(t == HIGH for t in grp) for grp in groups) / len(groups)
    assert abs(all_high - 1 / 16) < 4 * math.sqrt((1 / 16) * (15 / 16) / 400)


def test_token_draws_are_deterministic_per_step():
    s1, s2 = draw.token_seed(7, 3), draw.token_seed(7, 3)
    assert s1 == s2 and draw.token_seed(7, 4) != s1 and draw.token_seed(7, 3, group=1) != s1
    assert draw.sample_reward_tokens(16, "rc", 0.5, s1, levels=LEVELS) == draw.sample_reward_tokens(16, "rc", 0.5, s2, levels=LEVELS)


def test_modes_and_bad_values():
    assert draw.sample_reward_tokens(3, "none", levels=LEVELS) == [None, None, None]
    assert draw.sample_reward_tokens(2, "fixed", levels=LEVELS) == [HIGH, HIGH]
    for p in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="in \\(0, 1\\)"):
            draw.sample_reward_tokens(4, "rc", p=p, levels=LEVELS)
    with pytest.raises(ValueError, match="mode"):
        draw.sample_reward_tokens(4, "sometimes", levels=LEVELS)
    with pytest.raises(ValueError, match="groups of 4"):
        group_metrics.group_advantages([1.0, 0.0, 1.0], 4)
    assert adv.conditioning_for("sft", "grpo") == "none"
    assert adv.conditioning_for("rctp", "grpo") == "fixed"
    assert adv.conditioning_for("sft", "rc_grpo") == adv.conditioning_for("rctp", "rc_grpo") == "rc"


def test_reward_by_token_and_gap():
    rewards = [1.0, 0.0, 1.0, 1.0]
    tokens = [HIGH, LOW, LOW, HIGH]
    assert group_metrics.reward_by_token(rewards, tokens, levels=LEVELS) == {"high": 1.0, "low": 0.5}
    assert group_metrics.controllability_gap(rewards, tokens, levels=LEVELS) == 0.5
    assert math.isnan(group_metrics.controllability_gap(rewards, [HIGH] * 4, levels=LEVELS))


def test_trajectory_fields_mask_env_tokens():
    # prompt (4 tokens, incl. the reward token) | model 3 | tool result 2 | model 2
    token_ids = [10, 11, 99, 12, 20, 21, 22, 30, 31, 23, 24]
    mask = [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    logprobs = [0.0] * 4 + [-0.1, -0.2, -0.3] + [0.0, 0.0] + [-0.4, -0.5]
    p, c, env, lp = adv.trajectory_fields(token_ids, 4, mask, logprobs)
    assert p == [10, 11, 99, 12]
    assert c == [20, 21, 22, 30, 31, 23, 24]
    assert env == [1, 1, 1, 0, 0, 1, 1]
    assert lp == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    with pytest.raises(ValueError, match="inside the prompt"):
        adv.trajectory_fields(token_ids, 5, mask, logprobs)
    with pytest.raises(ValueError, match="lengths differ"):
        adv.trajectory_fields(token_ids, 4, mask[:-1], logprobs)


def test_levels_are_label_rewards_tokens_and_rl_uses_their_ends():
    three = ("<|low_reward|>", "<|mid_reward|>", "<|high_reward|>")
    assert adv.reward_levels(three) == ("<|low_reward|>", "<|high_reward|>")
    assert set(draw.sample_reward_tokens(64, "rc", 0.5, 3, levels=three)) == {"<|low_reward|>", "<|high_reward|>"}
    assert draw.sample_reward_tokens(1, "fixed", levels=("<a>", "<b>")) == ["<b>"]
    assert group_metrics.reward_by_token([1.0, 0.0], ["<b>", "<a>"], levels=("<a>", "<b>")) == {"high": 1.0, "low": 0.0}
    for bad in ((), ("<a>",), ("<a>", "<a>")):
        with pytest.raises(ValueError, match="distinct"):
            adv.reward_levels(bad)


def test_a_rollout_the_model_ended_stops_at_its_end_of_turn():
    # model 3 (the last one the end-of-turn id 2) | template tail 2: cut after the model's end-of-turn
    c, env, lp = [20, 21, 2, 13, 198], [1, 1, 1, 0, 0], [-0.1, -0.2, -0.3, 0.0, 0.0]
    assert adv.end_at_stop(c, env, lp, {2}) == ([20, 21, 2], [1, 1, 1], [-0.1, -0.2, -0.3])
    # the last model token is not an end-of-turn (an output cut at the token cap): unchanged, TRL sees a tail
    assert adv.end_at_stop([20, 21, 5, 13], [1, 1, 1, 0], [-0.1] * 3 + [0.0], {2}) == (
        [20, 21, 5, 13], [1, 1, 1, 0], [-0.1] * 3 + [0.0])
    assert adv.end_at_stop([7, 8], [0, 0], [0.0, 0.0], {2}) == ([7, 8], [0, 0], [0.0, 0.0])  # no model token
