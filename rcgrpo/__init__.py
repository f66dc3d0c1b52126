"""rcgrpo: Reward-Conditioned GRPO (RC-GRPO, arXiv 2602.03025) on TRL.

    from rcgrpo import RCGRPOConfig, RCGRPOTrainer      # drop-in for trl.GRPOConfig / trl.GRPOTrainer

- `RCGRPOConfig`, `RCGRPOTrainer`: TRL's GRPO where every rollout draws its own reward token (docs/library.md).
- `add_reward_tokens`, `reward_token_lora_config`, `reward_token_indices`: the tokens in a tokenizer and model,
  their embedding rows trainable under LoRA; `expose_head_bias`: the shim TRL's fused LM head needs under PEFT's
  trainable tokens (call it on an `SFTTrainer`'s model for RCTP; `RCGRPOTrainer` applies it itself).
- `rctp_rows`, `label_row`: (prompt, completion, reward) rows as reward-token-labelled SFT rows (RCTP-FT).
- `measure_controllability`, `q_stats`, `gap_stats`: does the model read its token (RC-GRPO's premise)?
- `format_goal`, `place_goal`, `DEFAULT_LEVELS`, `GOAL_TEMPLATE`: the goal text and where it goes.

Names load on first use: `import rcgrpo` imports no torch, TRL or PEFT until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("rcgrpo")
except PackageNotFoundError:  # a source tree on sys.path, not installed
    __version__ = "0+unknown"

_WHERE = {
    "RCGRPOConfig": "rcgrpo.config",
    "RCGRPOTrainer": "rcgrpo.trainer",
    "add_reward_tokens": "rcgrpo.tokens",
    "reward_token_indices": "rcgrpo.tokens",
    "reward_token_lora_config": "rcgrpo.tokens",
    "expose_head_bias": "rcgrpo.tokens",
    "rctp_rows": "rcgrpo.rctp",
    "label_row": "rcgrpo.rctp",
    "measure_controllability": "rcgrpo.controllability",
    "q_stats": "rcgrpo.controllability",
    "gap_stats": "rcgrpo.controllability",
    "format_goal": "rcgrpo.goal",
    "place_goal": "rcgrpo.goal",
    "DEFAULT_LEVELS": "rcgrpo.goal",
    "GOAL_TEMPLATE": "rcgrpo.goal",
}
__all__ = [
    "RCGRPOConfig", "RCGRPOTrainer", "add_reward_tokens", "reward_token_indices", "reward_token_lora_config",
    "expose_head_bias",
    "rctp_rows", "label_row", "measure_controllability", "q_stats", "gap_stats", "format_goal", "place_goal",
    "DEFAULT_LEVELS", "GOAL_TEMPLATE", "__version__",
]
assert set(__all__) == {*_WHERE, "__version__"}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rcgrpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from rcgrpo.config import RCGRPOConfig
    from rcgrpo.controllability import gap_stats, measure_controllability, q_stats
    from rcgrpo.goal import DEFAULT_LEVELS, GOAL_TEMPLATE, format_goal, place_goal
    from rcgrpo.rctp import label_row, rctp_rows
    from rcgrpo.tokens import add_reward_tokens, expose_head_bias, reward_token_indices, reward_token_lora_config
    from rcgrpo.trainer import RCGRPOTrainer
