"""BFCL v4 for TRL users: the project's tasks as pieces a TRL script takes.

- `single_turn_dataset`, `single_turn_reward` (`bfcl_single_turn`): prompting-mode prompts, scored by the
  pipeline's scorer (bfcl-eval's AST checker semantics, model text never evaluated).
- `install_tool_chat_template` (`chat_template`): a tool-calling ChatML template for SmolLM2-Instruct, whose own
  template cannot express tool calls, with TRL's parser for it.

A layer of its own above the tasks (`env`): it uses the pipeline's tasks, scorers and readers and the `rcgrpo`
library, and nothing of the stages, trainers or the MLOps stack.
"""

from rcgrpo_tasks.integrations.bfcl_single_turn import single_turn_dataset, single_turn_reward
from rcgrpo_tasks.integrations.chat_template import SMOLLM2_TOOL_CHAT_TEMPLATE, install_tool_chat_template

__all__ = ["SMOLLM2_TOOL_CHAT_TEMPLATE", "install_tool_chat_template", "single_turn_dataset", "single_turn_reward"]
