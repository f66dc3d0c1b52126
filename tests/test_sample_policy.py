"""sample_policy: sampling in rounds until each entry has a success and a failure (capped), on a scripted
backend whose outcomes per entry are fixed in advance (real engine, real scorer); config and entry choice.
The stage CLI on a tiny model, gated and paired, runs in tests/test_label_rewards.py (`chain`)."""

from __future__ import annotations

import pytest
from helpers import config_from_params

from rcgrpo_tasks.data.onpolicy import SampleConfig, needs_more, pick_entries, sample_policy
from rcgrpo_tasks.env.multi_turn import entries as multi_turn
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops.config import ConfigError


def test_needs_more():
    assert needs_more([], 4) and needs_more([0.0, 0.0], 4) and needs_more([1.0], 4)
    assert not needs_more([0.0, 1.0], 4)  # both outcomes
    assert not needs_more([0.0, 0.0, 0.0, 0.0], 4)  # the cap


@pytest.mark.parametrize("bad", [{"samples_per_entry": 0}, {"samples_per_entry": 3, "max_samples_per_entry": 2},
                                 {"temperature": 0.0}, {"n_entries": 0}, {"categories": ["nope"]}, {"top_p": 0}])
def test_bad_config_rejected(bad):
    with pytest.raises(ConfigError):
        config_from_params(SampleConfig, "sample_policy", **bad)


def test_pick_entries_seeded_in_file_order():
    train = multi_turn.load_entries(["base", "miss_func"])[:20]
    cfg = config_from_params(SampleConfig, "sample_policy", n_entries=5, categories=("base", "miss_func"), seed=1)
    picked = pick_entries(train, cfg)
    assert len(picked) == 5 and picked == [e for e in train if e in picked]  # file order kept
    assert pick_entries(train, cfg) == picked and pick_entries(train, config_from_params(SampleConfig, "sample_policy", n_entries=5, seed=2)) != picked
    assert pick_entries(train, config_from_params(SampleConfig, "sample_policy", n_entries=None, categories=("miss_func",))) == [
        e for e in train if e.category == "miss_func"]
    rl = config_from_params(SampleConfig, "sample_policy", n_entries=5, pool_entries=None, seed=1)  # RL's side: every prompt, whatever n_entries says
    assert pick_entries(train, rl, "rl") == train and len(pick_entries(train, rl, "train")) == 5
    assert len(pick_entries(train, config_from_params(SampleConfig, "sample_policy", n_entries=None, pool_entries=7), "rl")) == 7


def scripted(tok, entries, outcomes: dict[str, str], proto):
    """A backend whose k-th rollout of an entry replays the gold calls iff outcomes[entry][k] == 'S', else
    says nothing (a failure). Keys restart in every session, so a rollout's entry and number are fixed at
    its first step."""
    from rcgrpo_tasks.engine.backend import ScriptedBackend
    from rcgrpo_tasks.engine.rollout import replay_steps

    gold = {e.id: replay_steps(e, proto, e.ground_truth) for e in entries}
    started: dict[str, int] = {}
    plan: dict = {}

    def policy(key, step, ids):
        if step == 0:
            entry = next(e.id for e in entries if e.turns[0][0]["content"][:40] in tok.decode(ids))
            k = started.get(entry, 0)
            started[entry] = k + 1
            plan[key] = gold[entry] if outcomes[entry][k] == "S" else []
        texts = plan[key]
        return texts[step] if step < len(texts) else ""

    return ScriptedBackend(tok, policy), started


def test_rounds_stop_when_both_outcomes_or_cap(tok):
    """A: F,S (both in round 1); B: F,F,S,F (both in round 2); C: S,S,S,S (never fails: capped at 4).
    Every rollout is kept, in sampling order, with its round and sample index."""
    entries = multi_turn.load_entries(["base"])[:3]
    a, b, c = (e.id for e in entries)
    prompt = config_from_params(PromptConfig, "prompt", system_prompt="bfcl")
    cfg = config_from_params(SampleConfig, "sample_policy", **{"n_entries": None, "samples_per_entry": 2, "max_samples_per_entry": 4,
                                   "max_outputs": 20, "max_new_tokens": 4000, "batch_rows": 4})
    proto = prompt.protocol_config(cfg.decode.max_outputs)
    backend, started = scripted(tok, entries, {a: "FSSS", b: "FFSF", c: "SSSS"}, proto)
    rows, metrics = sample_policy(backend, entries, cfg, proto, "paper_reward", {"model": "m", "adapter": "ad"})
    assert started == {a: 2, b: 4, c: 4}  # only the entries lacking an outcome were sampled again
    got = [(r.entry_id, r.provenance["sample_index"], r.provenance["round"], r.provenance["reward"]) for r in rows]
    assert got == [(a, 0, 0, 0.0), (a, 1, 0, 1.0), (b, 0, 0, 0.0), (b, 1, 0, 0.0), (b, 2, 1, 1.0), (b, 3, 1, 0.0),
                   (c, 0, 0, 1.0), (c, 1, 0, 1.0), (c, 2, 1, 1.0), (c, 3, 1, 1.0)]
    assert [r.trajectory_id for r in rows[:2]] == [f"{a}.on_policy.0", f"{a}.on_policy.1"]
    for r in rows:
        p = r.provenance
        assert (p["source"], p["kind"], p["model"], p["adapter"], p["reward_fn"]) == (
            "policy", "on_policy", "m", "ad", "paper_reward")
        assert p["reward"] == r.score["paper_reward"] and p["sampling"]["temperature"] == cfg.decode.temperature
    seeds = {r.provenance["round"]: r.provenance["sampling"]["seed"] for r in rows if r.entry_id == b}
    assert seeds[0] != seeds[1]  # each round draws from its own stream
    assert metrics["rounds"] == 2 and metrics["samples"] == 10 and metrics["n_entries"] == 3
    assert (metrics["entries_with_both"], metrics["entries_only_success"], metrics["entries_only_failure"]) == (2, 1, 0)
    assert metrics["success_rate_first_round"] == pytest.approx(3 / 6)  # A: 1/2, B: 0/2, C: 2/2
    assert metrics["success_rate_all_samples"] == pytest.approx(6 / 10)


def test_last_round_takes_only_what_the_cap_leaves(tok):
    """samples_per_entry 2, cap 3: round 2 takes one sample per entry still searching."""
    entries = multi_turn.load_entries(["base"])[:1]
    prompt = config_from_params(PromptConfig, "prompt", system_prompt="bfcl")
    cfg = config_from_params(SampleConfig, "sample_policy", **{"samples_per_entry": 2, "max_samples_per_entry": 3, "max_outputs": 20,
                                   "max_new_tokens": 4000})
    proto = prompt.protocol_config(cfg.decode.max_outputs)
    backend, started = scripted(tok, entries, {entries[0].id: "FFFF"}, proto)
    rows, metrics = sample_policy(backend, entries, cfg, proto, "paper_reward")
    assert len(rows) == 3 and started == {entries[0].id: 3} and metrics["entries_only_failure"] == 1
    assert [r.provenance["round"] for r in rows] == [0, 0, 1]


def test_an_rctp_init_is_sampled_under_its_reward_goal(tok):
    """RL's pool from an RCTP init: every rollout carries the reward goal its cells roll with, in its prompt."""
    entries = multi_turn.load_entries(["base"])[:2]
    prompt = config_from_params(PromptConfig, "prompt", system_prompt="bfcl")
    cfg = config_from_params(SampleConfig, "sample_policy", **{"samples_per_entry": 2, "max_samples_per_entry": 2, "max_outputs": 20,
                                   "max_new_tokens": 4000})
    proto = prompt.protocol_config(cfg.decode.max_outputs)
    backend, _ = scripted(tok, entries, {e.id: "SF" for e in entries}, proto)
    rows, _ = sample_policy(backend, entries, cfg, proto, "paper_reward", reward_token="<|high_reward|>")
    assert len(rows) == 4 and all(r.reward_token == "<|high_reward|>" for r in rows)
    assert all(next(m for m in r.messages if m["role"] == "user")["content"].endswith("[Reward Goal: <|high_reward|>]")
               for r in rows)
