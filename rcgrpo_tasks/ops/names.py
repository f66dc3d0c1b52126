"""The pipeline's names, one per thing: the RL grid's vocabulary (its inits, algorithms and cells) and the DVC
stage that runs a stage module on one model, which is also the name of that stage's MLflow run, so the MLflow
UI, `dvc.yaml` and `dvc status` say the same (`rctp@0`, `rl_rctp@0-rc_grpo`, `evaluate_rl_rctp@0-rc_grpo`).

Below every layer that names a run or a cell (the training wings, evaluation, the report, the dev sweep), so
each reads the one list. tests/test_run_names.py expands `dvc.yaml` and checks `stage_name` against every
stage that trains or measures a model.
"""

from __future__ import annotations

INITS: tuple[str, ...] = ("sft", "rctp")
"""The models RL starts from: the SFT and the RCTP fine-tunes (the `sft` stage's variants)."""
ALGOS: tuple[str, ...] = ("grpo", "rc_grpo", "dynamic", "rc_anchor", "rc_frozen", "rc_lowmask")
"""The RL algorithms: GRPO, RC-GRPO, and GRPO with DAPO's dynamic sampling (zero-variance groups dropped and
refilled: `train.rl.rollout.EngineRollout`), which the paper does not run; a variant of RC-GRPO built so that
its premise survives RL and two decompositions of RC-GRPO (`RC_ALGOS`). An RL cell is `<init>-<algo>`."""
RC_ALGOS: tuple[str, ...] = ("rc_grpo", "rc_anchor", "rc_frozen", "rc_lowmask")
"""The algorithms that condition each rollout on its own token (RC-GRPO's groups, its advantage): RC-GRPO;
`rc_anchor`, RC-GRPO whose low-token rollouts carry the KL coefficient `rl.beta_low` (`train.rl.anchor`: the
low-conditioned policy trains but stays near the init, where it fails); `rc_frozen`, RC-GRPO whose RL LoRA
trains no reward-token row (the rows stay the init's; what the tokens mean can still move through the LoRA on
every layer, and did: a negative control); `rc_lowmask`, RC-GRPO whose low-token rollouts count in their
group's mean and spread but carry no loss (RL never trains the low-conditioned policy directly; the shared
weights still carry the high token's gradient to it, as under GRPO; for the evaluated policy it is GRPO with
half the high-token samples: a decomposition, not a fix)."""
SEEDED_MODELS: tuple[str, ...] = ("rctp",)
"""Models below the RL cells that are trained once per grid seed (their evaluation label)."""


def split_cell(label: str) -> tuple[str, str] | None:
    """`rctp-rc_grpo` -> ('rctp', 'rc_grpo'); None for a label that is not an RL cell."""
    init, _, algo = label.partition("-")
    return (init, algo) if init in INITS and algo in ALGOS else None


def stage_name(stage: str, model: str, seed: int | None = None) -> str:
    """The `dvc.yaml` stage (foreach / matrix expanded) in which stage module `stage` trains or measures `model`
    for grid seed `seed` (None: a model every seed shares, or a run outside the grid):

    - `sft`: the variant `sft` -> `sft`; `rctp` -> `rctp@<seed>`;
    - `rl`: the cell `<init>-<algo>` -> `rl_<init>@<seed>-<algo>`;
    - `evaluate`: a seeded model -> `evaluate_rctp@<seed>`, an RL cell -> `evaluate_rl_<init>@<seed>-<algo>`,
      a model evaluated once (no seed) -> `evaluate@<label>`;
    - `controllability` (each seed's RCTP model) -> `controllability@<seed>`; an RL cell (its policy after RL)
      -> `controllability_rl_<init>@<seed>-<algo>`;
    - any other module -> `<stage>@<model>`.

    Without a seed a seeded stage keeps its key without it (`rl_rctp@rc_grpo`, `rctp`): the stage the run
    stands for, outside the grid."""
    at = "" if seed is None else f"{seed}"
    cell = split_cell(model)
    if stage == "sft":
        return "sft" if model == "sft" else f"{model}@{at}" if at else model
    if stage == "rl" and cell:
        return f"rl_{cell[0]}@{at + '-' if at else ''}{cell[1]}"
    if stage == "evaluate" and seed is not None and model in SEEDED_MODELS:
        return f"evaluate_{model}@{at}"
    if stage == "evaluate" and seed is not None and cell:
        return f"evaluate_rl_{cell[0]}@{at}-{cell[1]}"
    if stage == "controllability" and cell:
        return f"controllability_rl_{cell[0]}@{at + '-' if at else ''}{cell[1]}"
    if stage == "controllability":
        return f"controllability@{at}" if at else "controllability"
    return f"{stage}@{model}"
