"""Loaded at start-up by every Python process of a multi-process test (the test puts this folder on
PYTHONPATH, so the stage's launcher and each of its processes import it): with RCGRPO_TEST_SCRIPTED_REWARDS
set, the real engine and scorer run, then the paper reward is replaced by the rule of `test_rl`'s
`scripted_rewards` (a random tiny model never succeeds, so every group would be flat and nothing would be
compared). The rule depends only on the entry, the rollout's reward token and its index in the group,
never on the process decoding it."""

import os

if os.environ.get("RCGRPO_TEST_SCRIPTED_REWARDS"):
    from rcgrpo_tasks.engine import rollout as _engine

    _real = _engine.run_seeded_groups
    _HIGH = "<|high_reward|>"

    def _scripted(backend, groups, protocol_cfg, provenance=None):
        out = _real(backend, groups, protocol_cfg, provenance)
        for (entry, tokens, _), trajs in zip(groups, out):
            mixed = len(set(tokens or [])) > 1
            # "flat-even": entries whose id ends in an even digit fail in every rollout (a flat group for
            # dynamic sampling to drop and refill).
            flat = os.environ["RCGRPO_TEST_SCRIPTED_REWARDS"] == "flat-even" and int(entry.id[-1]) % 2 == 0
            for i, t in enumerate(trajs):
                r = 0.0 if flat else float(t.reward_token == _HIGH) if mixed else float(i % 2 == 0)
                t.score = {**t.score, "paper_reward": r}
        return out

    _engine.run_seeded_groups = _scripted
