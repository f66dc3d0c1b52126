"""GRPO with dynamic sampling (algo `dynamic`: zero-variance groups dropped and refilled, as DAPO) and
stratified RC-GRPO reward tokens: the rollout function on hand-built rewards (no model), then two real
TRL steps on the tiny model (kept groups train; a step with none makes no update)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
from helpers import HIGH, LEVELS, LOW, capture_trainer, compute_from_params, config_from_params
from test_rl import PROTOCOL, TEST_RL, _spec, _weights

from rcgrpo import draw, group_metrics
from rcgrpo_tasks.ops.inputs import read_tsv
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import rollout as rl_rollout
from rcgrpo_tasks.train.rl import run as rl_run

# ------------------------------------------------------------------ stratified reward tokens


@pytest.mark.parametrize("g", range(2, 9))
def test_stratified_tokens_put_both_tokens_in_every_group_at_rate_p(g):
    n_groups = 4000
    tokens = draw.sample_reward_tokens(g * n_groups, "rc", 0.5, seed=g, levels=LEVELS, draw="stratified", g=g)
    groups = [tokens[i : i + g] for i in range(0, len(tokens), g)]
    assert all(HIGH in grp and LOW in grp for grp in groups)
    share = tokens.count(HIGH) / len(tokens)
    assert share == pytest.approx(0.5, abs=0.02)
    iid = draw.sample_reward_tokens(g * n_groups, "rc", 0.5, seed=g, levels=LEVELS)
    single = sum(len(set(iid[i : i + g])) == 1 for i in range(0, len(iid), g)) / n_groups
    assert single == pytest.approx(2 * 0.5**g, abs=0.03)  # the paper's i.i.d. draw leaves single-token groups


def test_iid_draw_is_unchanged_and_stratified_needs_whole_groups():
    rng = random.Random(7)
    expected = [HIGH if rng.random() < 0.3 else LOW for _ in range(10)]
    assert draw.sample_reward_tokens(10, "rc", 0.3, seed=7, levels=LEVELS) == expected
    with pytest.raises(ValueError, match="whole groups"):
        draw.sample_reward_tokens(7, "rc", 0.5, seed=0, levels=LEVELS, draw="stratified", g=5)
    counts = [draw.stratified_count(5, 0.5, random.Random(s)) for s in range(2000)]
    assert set(counts) == {2, 3} and sum(counts) / len(counts) == pytest.approx(2.5, abs=0.1)


# ------------------------------------------------------------------ the rollout function on scripted rewards


class FakeTrainer:
    def __init__(self):
        self.state = SimpleNamespace(global_step=0)
        self.accelerator = SimpleNamespace(process_index=0, is_main_process=True)
        self.model = SimpleNamespace(training=True, eval=lambda: None, train=lambda mode: None)
        self.metrics: dict[str, list[float]] = {}

    def record_metric(self, name, value):
        self.metrics.setdefault(name, []).append(value)


def _traj(entry_id, token, reward, i):
    return SimpleNamespace(
        entry_id=entry_id, reward_token=token, score={"paper_reward": reward, "valid": bool(reward),
                                                      "partial_credit": reward},
        token_ids=[1, 2, 3, 4, 5], prompt_len=2, completion_mask=[0, 0, 1, 1, 0], logprobs=[0.0, 0.0, -1.0, -2.0, 0.0],
        n_model_tokens=2 + i, result=[[["ls()"]]], n_steps=1, messages=[], termination="stop")


def _rollout(monkeypatch, rule, n_entries=6, **cfg):
    """EngineRollout whose groups get rewards rule(entry_id, i) instead of a model's; returns (rollout, calls)."""
    from rcgrpo_tasks.engine import rollout as engine

    calls = []

    def group(entry, reward_tokens, sampling):
        calls.append(entry.id)
        return [_traj(entry.id, reward_tokens[i], rule(entry.id, i), i) for i in range(len(reward_tokens))]

    monkeypatch.setattr(engine, "run_seeded_groups", lambda backend, groups, *a, **k: [group(*g) for g in groups])
    monkeypatch.setattr(rl_rollout.EngineRollout, "backend", lambda self, trainer: None)
    monkeypatch.setattr(rl_rollout, "task_of", lambda entry: SimpleNamespace(  # the entries are stand-ins
        failure_kind=lambda e, result, success: None if success else "wrong_arguments"))
    config = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "max_entries": None, "num_generations": 4, "batch_size": 8,
                                       "micro_batch_size": 4, **cfg})
    entries = {f"e{i}": SimpleNamespace(id=f"e{i}") for i in range(n_entries)}
    tok = SimpleNamespace(eos_token_id=0)
    return rl_rollout.EngineRollout(config, PROTOCOL, "fixed", LEVELS, entries, tok, dynamic=True), calls


def test_zero_variance_groups_are_dropped_and_refilled(monkeypatch):
    # e0 always fails (no spread); every other entry alternates success within its group.
    rollout, calls = _rollout(monkeypatch, lambda eid, i: 0.0 if eid == "e0" else float(i % 2))
    trainer = FakeTrainer()
    out = rollout(["e0"] * 4 + ["e1"] * 4, trainer)
    assert calls[:2] == ["e0", "e1"] and len(calls) == 3 and calls[2] not in ("e0", "e1")  # one refill
    assert rollout.last_kept == [True, True]
    assert [t.entry_id for t in rollout.last] == [calls[2]] * 4 + ["e1"] * 4  # the slot keeps its place
    assert all(sum(m) == 2 for m in out["env_mask"])  # every rollout trained on
    m = {k: v[-1] for k, v in trainer.metrics.items()}
    assert (m["rc/rollouts_generated"], m["rc/rollouts_trained"], m["rc/groups_dropped"], m["rc/useful_groups"],
            m["rc/gen_rounds"]) == (12, 8, 1, 2, 2)
    assert m["rc/gen_tokens_per_useful_group"] == pytest.approx(3 * (2 + 3 + 4 + 5) / 2)
    assert m["rc/frac_zero_std_generated"] == pytest.approx(1 / 3)
    # what the trainer will score (the library's `rc/frac_zero_std`): the refilled batch has no flat group
    assert group_metrics.zero_std_fraction([r["rewards"]["paper_reward"] for r in rollout.records], 4) == 0.0


def test_the_round_cap_masks_what_is_still_flat_and_an_empty_step_says_so(monkeypatch, capsys):
    rollout, calls = _rollout(monkeypatch, lambda eid, i: 1.0, dynamic_max_rounds=3)  # every group flat
    trainer = FakeTrainer()
    out = rollout(["e0"] * 4 + ["e1"] * 4, trainer)
    assert len(calls) == 6 and len(set(calls)) == 6  # 3 rounds of 2 groups, fresh entries each time
    assert rollout.last_kept == [False, False] and all(sum(m) == 0 for m in out["env_mask"])
    m = {k: v[-1] for k, v in trainer.metrics.items()}
    assert (m["rc/rollouts_generated"], m["rc/rollouts_trained"], m["rc/groups_dropped"], m["rc/useful_groups"],
            m["rc/gen_rounds"]) == (24, 0, 6, 0, 3)
    assert math.isnan(m["rc/gen_tokens_per_useful_group"])
    assert "no group with reward spread after 3 generation round(s)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dynamic_max_rounds"):
        config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "dynamic_max_rounds": 0})


def test_plain_grpo_keeps_every_group_and_prices_it(monkeypatch):
    rollout, calls = _rollout(monkeypatch, lambda eid, i: 0.0 if eid == "e0" else float(i % 2))
    rollout.dynamic = False
    trainer = FakeTrainer()
    out = rollout(["e0"] * 4 + ["e1"] * 4, trainer)
    assert calls == ["e0", "e1"] and all(sum(m) == 2 for m in out["env_mask"])
    m = {k: v[-1] for k, v in trainer.metrics.items()}
    assert (m["rc/rollouts_generated"], m["rc/rollouts_trained"], m["rc/groups_dropped"], m["rc/useful_groups"]) \
        == (8, 8, 0, 1)


# ------------------------------------------------------------------ through TRL on the tiny model


@pytest.fixture
def entry_rewards(monkeypatch):
    """The real engine and scorer, then the paper reward replaced by `rule[entry_id](i)` (default: flat 0)."""
    from rcgrpo_tasks.engine import rollout as engine

    real, rule = engine.run_seeded_groups, {}

    def run_seeded_groups(backend, groups, protocol_cfg, provenance=None):
        out = real(backend, groups, protocol_cfg, provenance)
        for (entry, _, _), trajs in zip(groups, out):
            for i, t in enumerate(trajs):
                t.score = {**t.score, "paper_reward": rule.get(entry.id, lambda i: 0.0)(i)}
        return out

    monkeypatch.setattr(engine, "run_seeded_groups", run_seeded_groups)
    return rule


def test_dynamic_trains_on_kept_groups_and_skips_a_step_with_none(rl_env, entry_rewards, monkeypatch):
    root, model_dir = rl_env
    box = capture_trainer(monkeypatch)
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "max_steps": 1})
    flat = _spec(root, model_dir, "sft-dynamic-flat", "sft", "dynamic")
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, flat, compute=compute_from_params())  # every group flat: nothing to train on
    assert summary["total_step_skipped"] == 1 and summary["total_useful_groups"] == 0
    before, after = _weights(model_dir), _weights(flat.out)
    assert all(before[k].equal(after[k]) for k in before if k in after)  # no update at all
    for eid in box["rollout"].entries:  # now every entry's group splits: the first round keeps it
        entry_rewards[eid] = lambda i: float(i % 2)
    spread = _spec(root, model_dir, "sft-dynamic-spread", "sft", "dynamic")
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spread, compute=compute_from_params())
    assert summary["total_step_skipped"] == 0 and summary["rollouts_per_useful_group"] == cfg.num_generations
    after = _weights(spread.out)
    assert any(not before[k].equal(after[k]) for k in before if k in after)
    rewards = [t.score["paper_reward"] for t in box["rollout"].last]
    assert list(box["trainer"].last_generation.advantages) == pytest.approx(group_metrics.group_advantages(rewards, cfg.num_generations), abs=1e-4)
    rows = read_tsv(spread.plots)
    assert rows[0]["rollouts_generated"] == 2 and rows[0]["useful_groups"] == 1 and rows[0]["step_skipped"] == 0
