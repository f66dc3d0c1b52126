"""BFCL v4 for TRL users: the project's two tasks as a `datasets` table plus a reward function (single-turn)
and as environments for `environment_factory` (multi-turn), usable with `trl.GRPOTrainer` or
`rcgrpo.RCGRPOTrainer` (docs/integrations.md).

- `single_turn_dataset`, `single_turn_reward` (`bfcl_single_turn`): prompting-mode prompts, scored by the
  pipeline's scorer (bfcl-eval's AST checker semantics, model text never evaluated).
- `multi_turn_dataset`, `multi_turn_environments`, `multi_turn_entries` (`bfcl_multi_turn`): the paper
  protocol's merged prompt, the BFCL classes' functions as tools, the paper reward from `get_reward()`, the reward
  goal from `reset()`.
- `install_tool_chat_template` (`chat_template`): a tool-calling ChatML template for SmolLM2-Instruct, whose own
  template cannot express tool calls, with TRL's parser for it.

A layer of its own above the tasks (`env`): it uses the pipeline's tasks, scorers and readers and the `rcgrpo`
library, and nothing of the stages, trainers or the MLOps stack.
"""

from rcgrpo_tasks.integrations.bfcl_multi_turn import (
    BfclToolEnvironment,
    multi_turn_dataset,
    multi_turn_entries,
    multi_turn_environments,
)
from rcgrpo_tasks.integrations.bfcl_single_turn import single_turn_dataset, single_turn_reward
from rcgrpo_tasks.integrations.chat_template import SMOLLM2_TOOL_CHAT_TEMPLATE, install_tool_chat_template

__all__ = [
    "BfclToolEnvironment", "SMOLLM2_TOOL_CHAT_TEMPLATE", "install_tool_chat_template", "multi_turn_dataset",
    "multi_turn_entries", "multi_turn_environments", "single_turn_dataset", "single_turn_reward",
]
