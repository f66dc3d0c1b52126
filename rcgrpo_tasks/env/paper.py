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
    ("rctp-rc_grpo", "RCTP+RC-GRPO"), ("rctp-dynamic", "RCTP+GRPO+DS"),
    ("rctp-notoken", "RCTP, no token"), ("rctp-rc_grpo-notoken", "RCTP+RC-GRPO, no token"),
)
"""Report rows in order; `+DS`: GRPO with dynamic sampling (DAPO's drop-and-refill of zero-variance groups),
which the paper does not run; `no token`: the model evaluated without a reward goal (the paper conditions on
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
