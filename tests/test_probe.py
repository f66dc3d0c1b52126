"""The fixed probe (`train.rl.probe`): the same prompts and seeds at every checkpoint and in every cell of an init,
points at step 0 / middle / end, the paired change over prompts; GRPO and RC-GRPO from one init draw the same
prompts and sampling seeds per step."""

from __future__ import annotations

import pytest
from helpers import HIGH, LEVELS, config_from_params
from test_rl import PROTOCOL, TEST_RL, _spec, scripted_rewards  # noqa: F401  (fixture)

from rcgrpo_tasks.ops.inputs import read_jsonl
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import run as rl_run
from rcgrpo_tasks.train.rl.grpo import ROLLOUTS_FILE
from rcgrpo_tasks.train.rl.probe import probe_ids, probe_summary


def test_probe_ids_do_not_depend_on_the_pool_order():
    pool = [f"e{i}" for i in range(20)]
    assert probe_ids(pool, 5, 0) == probe_ids(list(reversed(pool)), 5, 0)
    assert len(set(probe_ids(pool, 5, 0))) == 5 and probe_ids(pool, 5, 0) != probe_ids(pool, 5, 1)


def test_probe_summary_pairs_prompts_between_step_zero_and_the_end():
    pts = [{"step": 0, "entries": ["a", "b", "c", "d"], "rewards": [0.0, 0.25, 0.5, 0.0], "samples": 4},
           {"step": 5, "entries": ["a", "b", "c", "d"], "rewards": [0.25, 0.5, 0.75, 0.25], "samples": 4},
           {"step": 10, "entries": ["a", "b", "c", "d"], "rewards": [0.5, 0.5, 0.75, 0.25], "samples": 4}]
    s = probe_summary(pts)
    assert s["steps"] == [0, 5, 10] and s["reward"][0] == pytest.approx(0.1875)
    ch = s["change"]
    assert ch["mean"] == pytest.approx(0.3125) and ch["prompts"] == 4
    assert 0.0 < ch["ci_low"] <= ch["mean"] <= ch["ci_high"]  # every prompt rose: the paired CI excludes 0
    assert probe_summary(pts[1:]) is None and probe_summary(pts[:1]) is None


def test_cells_of_one_init_probe_the_same_prompts_and_seeds_and_share_the_steps_draws(rl_env, scripted_rewards):  # noqa: F811
    """rctp-grpo and rctp-rc_grpo: probe points at 0 / 1 / 2; step 0's probe rollouts token-identical (the same
    policy, prompts, token and seeds); each step trains on the same entries with the same sampling seeds
    (only the reward tokens differ: the seeds derive from (run seed, step, slot), `EngineRollout.group_specs`)."""
    from rcgrpo_tasks.engine.compute import ComputeConfig

    root, model_dir = rl_env
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "probe_entries": 2, "probe_samples": 3,
                                    "probe_transfer_entries": 1, "temperature": 1.0})
    probes, logs, summaries = {}, {}, {}
    for algo in ("grpo", "rc_grpo"):
        start = len(scripted_rewards)
        spec = _spec(root, model_dir, f"probe-{algo}", "rctp", algo)
        summaries[algo] = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, track=False, compute=config_from_params(ComputeConfig, "compute", device="cpu"))
        groups = scripted_rewards[start:]
        probes[algo] = [[t.token_ids for t in g] for g in groups if len(g) == 3]  # S = 3, G = 2
        logs[algo] = read_jsonl(spec.checkpoints / ROLLOUTS_FILE)
        assert all(t.reward_token == HIGH for g in groups if len(g) == 3 for t in g)
    for algo in ("grpo", "rc_grpo"):
        p = summaries[algo]["probe"]
        assert p["steps"] == [0, 1, 2] and len(p["entries"]) == 2 and p["samples"] == 3
        assert len(p["transfer"]["entries"]) == 1 and not set(p["transfer"]["entries"]) & set(summaries[algo]["pool"]["ids"])
        assert set(p["entries"]) <= set(summaries[algo]["pool"]["ids"])
    assert summaries["grpo"]["probe"]["entries"] == summaries["rc_grpo"]["probe"]["entries"]
    assert summaries["grpo"]["probe"]["transfer"]["entries"] == summaries["rc_grpo"]["probe"]["transfer"]["entries"]
    assert len(probes["grpo"]) == 9 and probes["grpo"][:3] == probes["rc_grpo"][:3]  # step 0: identical rollouts
    key = [(r["step"], r["group"], r["entry_id"]) for r in logs["grpo"]]
    assert key == [(r["step"], r["group"], r["entry_id"]) for r in logs["rc_grpo"]]
    assert {r["reward_token"] for r in logs["grpo"]} == {HIGH} and len({r["reward_token"] for r in logs["rc_grpo"]}) == 2
