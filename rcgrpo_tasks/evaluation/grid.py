"""What the pipeline runs and reports: params.yaml `grid`, read by DVC (dvc.yaml's `rl` and `evaluate` stages
are `foreach` over it) and by the report and the promotion gate, so the three cannot list different models.

- `rl`: the RL cells, `<init>-<algo>` -> {init, algo}. The default is the paper's comparison: SFT+GRPO,
  RCTP+GRPO, RCTP+RC-GRPO. `rcgrpo params --profile full-grid` adds SFT+RC-GRPO and GRPO with dynamic
  sampling from either init.
- `evaluate`: the evaluated models, label -> {model, adapter, dep, reward_token, flags} (the evaluate stage's
  arguments: `dep` is what DVC tracks when the model folder alone does not name the model; `flags`: more
  options). Every RL cell is evaluated under its own label; the full grid adds the RCTP-based models with no
  reward goal (which token to use at inference: the paper does not say).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rcgrpo_tasks.env.paper import ALGOS, INITS

EVAL_KEYS = ("model", "adapter", "dep", "reward_token", "flags")
HIGH = "<|high_reward|>"


def _cell(init: str, algo: str) -> dict:
    return {"init": init, "algo": algo}


def _model(model: str, adapter: str = "", token: str = "", flags: str = "") -> dict:
    return {"model": model, "adapter": adapter, "dep": adapter or model, "reward_token": token, "flags": flags}


DEFAULT_RL = {"sft-grpo": _cell("sft", "grpo"), "rctp-grpo": _cell("rctp", "grpo"),
              "rctp-rc_grpo": _cell("rctp", "rc_grpo")}
DEFAULT_EVALUATE = {
    "base": _model("models/base", flags="--no-pass1"),
    "sft": _model("models/base", "models/sft/sft"),
    "rctp": _model("models/base", "models/sft/rctp", HIGH, "--no-margin"),
    "sft-grpo": _model("models/rl/sft-grpo"),
    "rctp-grpo": _model("models/rl/rctp-grpo", token=HIGH),
    "rctp-rc_grpo": _model("models/rl/rctp-rc_grpo", token=HIGH),
}
"""The committed grid (params.yaml `grid`): the paper's comparison."""


@dataclass(frozen=True)
class GridConfig:
    rl: dict = field(default_factory=lambda: dict(DEFAULT_RL))
    """RL cells: `<init>-<algo>` -> {init, algo}."""
    evaluate: dict = field(default_factory=lambda: dict(DEFAULT_EVALUATE))
    """Evaluated models: label -> {model, adapter, dep, reward_token, flags}; every RL cell is one of them."""

    def __post_init__(self) -> None:
        for cell, item in self.rl.items():
            if not isinstance(item, dict) or set(item) != {"init", "algo"}:
                raise ValueError(f"rl.{cell}: expected {{init, algo}}, got {item!r}")
            if item["init"] not in INITS or item["algo"] not in ALGOS or cell != f"{item['init']}-{item['algo']}":
                raise ValueError(f"rl.{cell}: a cell is <init>-<algo> with init in {INITS} and algo in {ALGOS}, "
                                 f"got {item!r}")
        for label, item in self.evaluate.items():
            if not isinstance(item, dict) or set(item) != set(EVAL_KEYS):
                raise ValueError(f"evaluate.{label}: expected keys {list(EVAL_KEYS)}, got {item!r}")
            if not label.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"evaluate.{label}: a label names folders: letters, digits, '-' and '_' only")
        missing = sorted(set(self.rl) - set(self.evaluate))
        if missing:
            raise ValueError(f"RL cells {missing} have no evaluation: add them to grid.evaluate")

    @property
    def cells(self) -> list[str]:
        return list(self.rl)

    @property
    def labels(self) -> list[str]:
        return list(self.evaluate)
