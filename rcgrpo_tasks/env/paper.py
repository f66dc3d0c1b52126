"""The RC-GRPO paper's reference numbers (arXiv 2602.03025, Table 1) and the report's row names; the grid's
vocabulary (`INITS`, `ALGOS`) is `ops.names`.

Qwen2.5-7B-Instruct, BFCL v4 multi-turn, 80 held-out entries, overall accuracy (%). Only the cells the
paper reports; every other row, and every row of another task, is n/a. A reference for the shape of the result, not a target for the
embedded 135M model.
"""

from __future__ import annotations

ROWS: tuple[tuple[str, str], ...] = (
    ("base", "Base"), ("sft", "SFT"), ("rctp", "RCTP"), ("sft-grpo", "SFT+GRPO"),
    ("sft-rc_grpo", "SFT+RC-GRPO"), ("sft-dynamic", "SFT+GRPO+DS"), ("rctp-grpo", "RCTP+GRPO"),
    ("rctp-rc_grpo", "RCTP+RC-GRPO"), ("rctp-rc_anchor", "RCTP+RC-GRPO, low token KL-anchored"),
    ("rctp-rc_frozen", "RCTP+RC-GRPO, token rows frozen"),
    ("rctp-rc_lowmask", "RCTP+RC-GRPO, low out of the loss"), ("rctp-dynamic", "RCTP+GRPO+DS"),
    ("sft-rc_anchor", "SFT+RC-GRPO, low token KL-anchored"), ("sft-rc_frozen", "SFT+RC-GRPO, token rows frozen"), ("sft-rc_lowmask", "SFT+RC-GRPO, low out of the loss"),
    ("rctp-notoken", "RCTP, no token"), ("rctp-rc_grpo-notoken", "RCTP+RC-GRPO, no token"),
)
"""Report rows in order; `+DS`: GRPO with dynamic sampling (DAPO's drop-and-refill of zero-variance groups),
which the paper does not run; `low token KL-anchored`: RC-GRPO's variant that keeps its premise, `token rows
frozen` / `low out of the loss`: RC-GRPO's decompositions (`ops.names.RC_ALGOS`), which it does not run either; `no token`: the model evaluated without a reward goal (the paper conditions on
`<|high_reward|>` and does not say what it used at inference otherwise)."""
NO_TOKEN = "-notoken"
"""Label suffix of a row evaluated without its reward goal; it is compared with the same model's row."""
PAPER_TABLE1_OVERALL: dict[str, float] = {"base": 11.25, "sft-grpo": 48.75, "rctp-grpo": 73.75,
                                          "rctp-rc_grpo": 85.00}
"""The paper's numbers, on BFCL v4 multi-turn (the only task it reports: `Task.paper_table1` of each task,
`env.tasks.paper_overall`)."""


def row_name(label: str) -> str:
    """`rctp-rc_grpo` -> `RCTP+RC-GRPO`; unknown labels as they are."""
    return dict(ROWS).get(label, label)

PAPER_SETUP: dict[str, str] = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "task (categories)": "multi_turn (4)",
    "split train / dev / rl / test": "720 / 0 / 0 / 80",
    "SFT": "2 epochs, batch 16, lr 1e-05, full",
    "RCTP": "5 epochs, batch 16, lr 1e-05, full",
    "RCTP set": "failures on_policy, unpaired",
    "RCTP init": "base",
    "RCTP reward goal": "end of the user message",
    "RCTP objective": "rows balanced, token rows x1, first token x1, unlikelihood 0, loss on completion",
    "RL cells": "sft-grpo, rctp-grpo, rctp-rc_grpo",
    "RL steps x groups": "400 x 256 groups of G=5",
    "RL lr, weights": "1e-06, full",
    "KL beta (to the init)": "0.1",
    "KL per token": "unbounded",
    "PPO clip": "0.2",
    "RC-GRPO P(high), draw": "0.5, iid",
    "RL pool": "every RL prompt",
    "evaluation": "every test entry, greedy",
}
"""The paper's setup in the words of the profiles table (`sweep.profiles`; docs/profiles.md), for the rows it
gives: RCTP-FT of the instruct model on 800 expert and 800 own-failure trajectories (the goal text ending the
first user message, a plain fine-tuning loss) for 5 epochs, SFT 2 epochs, both lr 1e-5 at batch 16 with every
weight trained; GRPO / RC-GRPO for 400 steps of 256 prompts x G = 5 at lr 1e-6, KL beta 0.1 to the RCTP (or
SFT) model, unbounded, PPO clip 0.2, P(high) 0.5 drawn per rollout, every RL prompt; 720 train and 80 test
entries of BFCL v4 multi-turn, greedy accuracy under the high token. Rows it does not give (prompt rendering,
PPO epochs, sampling, seeds) are left blank there."""
