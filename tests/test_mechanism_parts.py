"""The mechanism's parts in RL's own log: each rollout's failure kind, each token's failures per step, the
rollouts with a learning signal per token, per group and per run, pool learning on equal samples, and the
ablation that keeps the low token out of the loss (on the rollout function, scripted rewards, no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import HIGH, LEVELS, LOW
from test_dynamic_sampling import FakeTrainer, _rollout

from rcgrpo_tasks.train.rl import diagnostics as diag
from rcgrpo_tasks.train.rl import rollout as rl_rollout


def _rec(step, group, token, reward, failure=None, advantage=0.0, entry="e0"):
    return {"step": step, "group": group, "entry_id": entry, "reward_token": token, "failure": failure,
            "rewards": {"paper_reward": reward}, "advantage": advantage}


def test_failure_counts_shares_and_signal_per_token():
    records = [_rec(0, 0, HIGH, 1.0, advantage=0.5), _rec(0, 0, HIGH, 0.0, "wrong_arguments", -0.5),
               _rec(0, 0, LOW, 0.0, "no_call", -0.5), _rec(0, 0, LOW, 0.0, "no_call", -0.5),
               _rec(0, 1, LOW, None, None), _rec(0, 1, None, 0.0, "wrong_function")]
    counts = diag.failure_counts(records, LEVELS)
    assert counts["high"] == {"rollouts": 2, "success": 1, "unscored": 0, "no_call": 0, "wrong_function": 0,
                              "wrong_arguments": 1}
    assert counts["low"]["no_call"] == 2 and counts["low"]["unscored"] == 1 and counts["low"]["rollouts"] == 3
    assert counts["none"]["wrong_function"] == 1
    shares = diag.failure_shares(records, LEVELS)
    assert shares["rc/fail_no_call_low"] == pytest.approx(2 / 3) and shares["rc/fail_wrong_arguments_high"] == 0.5
    assert diag.nonzero_advantages(records, LEVELS) == {"high": 2, "low": 2, "none": 0}
    assert set(diag.FAILURE_COLUMNS) <= set(diag.PLOT_COLUMNS)
    row = diag.diagnostics_row({"rc/fail_no_call_low": 0.25, "rc/nonzero_adv_high": 3.0}, 1)
    assert row["fail_no_call_low"] == 0.25 and row["nonzero_adv_high"] == 3.0


def test_group_flags_carry_each_tokens_rollouts_and_signal():
    records = [_rec(0, 0, HIGH, 1.0, advantage=0.87), _rec(0, 0, LOW, 0.0, "no_call", -0.87),
               _rec(0, 1, HIGH, 1.0), _rec(0, 1, HIGH, 1.0)]
    flags = diag.group_flags(records, "paper_reward", LEVELS)
    assert [f["flat"] for f in flags] == [None, "success"]
    assert flags[0]["rollouts"] == {"high": 1, "low": 1} and flags[0]["nonzero_adv"] == {"high": 1, "low": 1}
    assert flags[1]["nonzero_adv"] == {"high": 0}
    assert "rollouts" not in diag.group_flags(records, "paper_reward")[0]  # without levels: as before


def test_pool_learning_on_equal_samples_per_visit():
    # GRPO reads 4 samples a visit, RC-GRPO 2 (its high-token half): per_visit=2 reads both on the first two.
    grpo = [_rec(s, 0, HIGH, r) for s, rs in ((0, (0, 0, 1, 1)), (5, (1, 1, 0, 0))) for r in rs]
    assert diag.pool_learning(grpo, "paper_reward")["up"] == 0  # 0.5 -> 0.5 on all four
    equal = diag.pool_learning(grpo, "paper_reward", per_visit=2)
    assert (equal["up"], equal["down"], equal["per_visit"]) == (1, 0, 2)  # 0.0 -> 1.0 on the first two
    rc = [_rec(0, 0, HIGH, 0.0), _rec(0, 0, LOW, 0.0), _rec(5, 0, HIGH, 1.0)]  # one high sample at step 5
    assert diag.pool_learning(rc, "paper_reward", HIGH, per_visit=2)["prompts"] == 0  # too few to compare
    assert diag.pool_learning(rc, "paper_reward", HIGH, per_visit=1)["up"] == 1


def test_the_low_token_out_of_the_loss_keeps_its_advantage(monkeypatch):
    """`mask_low` (algo rc_lowmask): every rollout's advantage is the group's, the low ones carry no loss."""
    rollout, _ = _rollout(monkeypatch, lambda eid, i: float(i % 2))
    rollout.dynamic, rollout.mode, rollout.mask_low = False, "rc", True
    trainer = FakeTrainer()
    tokens = [HIGH, LOW, LOW, HIGH, LOW, HIGH, HIGH, LOW]
    trainer.reward_tokens = tokens
    out = rollout(["e0"] * 4 + ["e1"] * 4, trainer)
    assert out["reward_token"] == tokens
    assert [sum(m) > 0 for m in out["env_mask"]] == [t == HIGH for t in tokens]
    assert [r["trained"] for r in rollout.records] == [t == HIGH for t in tokens]
    assert [r["failure"] for r in rollout.records] == [None if i % 2 else "wrong_arguments" for i in range(8)]
    m = {k: v[-1] for k, v in trainer.metrics.items()}
    assert m["rc/rollouts_trained"] == 4 and m["rc/fail_wrong_arguments_low"] == 0.5
    rollout.mask_low = False
    assert all(sum(m) > 0 for m in rollout(["e0"] * 4 + ["e1"] * 4, trainer)["env_mask"])


def test_a_failure_is_a_paper_reward_of_0_whatever_rl_trains_on(monkeypatch):
    seen = []
    monkeypatch.setattr(rl_rollout, "task_of", lambda e: SimpleNamespace(
        failure_kind=lambda entry, result, success: seen.append(success) or "wrong_function"))
    rollout = SimpleNamespace(entries={"e0": SimpleNamespace(id="e0")})
    t = SimpleNamespace(entry_id="e0", result=[[]], score={"paper_reward": 0.0, "partial_credit": 1.0, "valid": True})
    assert rl_rollout.EngineRollout.failure(rollout, t) == "wrong_function" and seen == [False]
    assert rl_rollout.EngineRollout.failure(rollout, SimpleNamespace(entry_id="e0", score=None)) is None


def test_a_runs_steps_by_thirds():
    from rcgrpo_tasks.data.rl_steps import thirds

    rows = [{"step": s, "gap": 0.3 if s <= 10 else 0.1, "low": float("nan") if s > 25 else 0.2} for s in range(30, 0, -1)]
    parts = thirds(rows, ("gap", "low"))
    assert [p["steps"] for p in parts] == [[1, 10], [11, 20], [21, 30]]
    assert [p["gap"] for p in parts] == pytest.approx([0.3, 0.1, 0.1]) and parts[2]["low"] == pytest.approx(0.2)
    assert [len(range(a, b + 1)) for a, b in (p["steps"] for p in thirds([{"step": s} for s in range(1, 8)], ()))] == [3, 2, 2]
    assert thirds([], ("gap",)) == [] and thirds([{"step": 1, "gap": float("nan")}], ("gap",))[0]["gap"] is None
