"""The prompt vocabulary every task and stage shares: the prompt settings (`PromptConfig`, params.yaml
`prompt`), the episode settings (`ProtocolConfig`), BFCL's classic prompting-mode templates, and the reward
tokens with the `[Reward Goal: <token>]` suffix that conditions a prompt on one.

Protocols (`ProtocolConfig.protocol`): `official` (BFCL's turn-by-turn prompting mode) and `paper` (RC-GRPO's
merged steps + `done()`); what each means for a task is that task's episode (`env.multi_turn.episode`,
`env.single_turn.episode`).
Reward slot: with a reward token, `"\n\n[Reward Goal: <token>]"` is appended to the first user message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rcgrpo.goal import DEFAULT_LEVELS, check_levels

BFCL_MAX_STEPS_PER_TURN = 20  # bfcl_eval.constants.default_prompts.MAXIMUM_STEP_LIMIT
# BFCL's classic style, copied from bfcl_eval.constants.default_prompts.PROMPT_STYLE_TEMPLATES["classic"]
# (that module is import-light, but copying keeps the engine independent of bfcl-eval's release churn;
# tests/test_protocols.py checks the copy against the installed package).
BFCL_CLASSIC = {
    "persona": "You are an expert in composing functions.",
    "task": "You are given a question and a set of possible functions. Based on the question, you will need to make one or more function/tool calls to achieve the purpose. If none of the functions can be used, point it out. If the given question lacks the parameters required by the function, also point it out.",
    "tool_call_no_tag": "You should only return the function calls in your response.\n\nIf you decide to invoke any of the function(s), you MUST put it in the format of {output_format}. {param_types} You SHOULD NOT include any other text in the response.",
    "multiturn_behavior": "At each turn, you should try your best to complete the tasks requested by the user within the current turn. Continue to output functions to call until you have fulfilled the user's request to the best of your ability. Once you have no more functions to call, the system will consider the current turn complete and proceed to the next turn or task.",
    "available_tools": "Here is a list of functions in {format} format that you can invoke.\n{functions}\n",
}
BFCL_OUTPUT_FORMAT = "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
# bfcl's plaintext template: note there is no space between persona and task (sic, as BFCL sends it).
BFCL_PLAINTEXT = "{persona}{task}\n\n{tool_call_format}\n\n{multiturn_behavior}\n\n{available_tools}"


@dataclass(frozen=True)
class PromptConfig:
    """params.yaml `prompt`: how every stage renders an entry (generate, evaluate, controllability, rl,
    sample_policy read this ONE section, so training and evaluation cannot see different prompts)."""

    protocol: Literal["official", "paper"]
    """`official`: BFCL's turn-by-turn prompting mode; `paper`: RC-GRPO's merged steps + done()."""
    doc_style: Literal["compact", "json", "official"]
    """Function docs in the system prompt: compact one-liners, one JSON object per line, or BFCL's exact JSON."""
    system_prompt: Literal["bfcl", "short"]
    """`bfcl`: BFCL's classic instructions; `short`: format rule + docs only (fewer tokens for tiny models)."""

    def protocol_config(self, max_outputs: int) -> "ProtocolConfig":
        """THE way to the episode settings: this section with a stage's output budget, per episode (`paper`:
        `max_outputs`) or per turn (`official`: `max_steps_per_turn`); the limit the protocol does not read
        keeps BFCL's 20, so a trajectory's recorded protocol (`ProtocolConfig.record`) is the same whatever
        stage wrote it."""
        paper = self.protocol == "paper"
        return ProtocolConfig(protocol=self.protocol, doc_style=self.doc_style, system_prompt=self.system_prompt,
                              max_outputs=max_outputs if paper else BFCL_MAX_STEPS_PER_TURN,
                              max_steps_per_turn=BFCL_MAX_STEPS_PER_TURN if paper else max_outputs)


@dataclass(frozen=True)
class ProtocolConfig(PromptConfig):
    """The episode settings: the `prompt` section's fields (inherited, no defaults) plus one stage's output
    budget; built by `PromptConfig.protocol_config`."""

    max_steps_per_turn: int
    """official: force-terminate once a turn has executed more than this many steps (BFCL: 20)."""
    max_outputs: int
    """paper: model outputs per episode before `step_limit`."""

    def __post_init__(self) -> None:
        if self.max_steps_per_turn < 1 or self.max_outputs < 1:
            raise ValueError("max_steps_per_turn and max_outputs must be >= 1")

    def record(self) -> dict:
        """The trajectory schema v1 form (`provenance.protocol`): the file format keeps its v1 key
        `max_steps` for `max_outputs`, so records written before the rename stay byte-identical."""
        return {"protocol": self.protocol, "doc_style": self.doc_style,
                "max_steps_per_turn": self.max_steps_per_turn, "max_steps": self.max_outputs,
                "system_prompt": self.system_prompt}


GOAL_RESERVE = 32
"""Tokens kept free for the `[Reward Goal: <token>]` suffix (about 12 tokens with SmolLM2's tokenizer)."""


def reward_tokens(params: dict) -> tuple[str, ...]:
    """THE reward tokens of a pipeline (`label_rewards.tokens` of a params mapping), lowest first."""
    return check_levels((params.get("label_rewards") or {}).get("tokens") or DEFAULT_LEVELS)
