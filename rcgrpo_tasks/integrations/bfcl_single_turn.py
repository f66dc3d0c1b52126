"""BFCL v4 single-turn (the AST categories) for TRL: a `datasets.Dataset` of prompts and a reward function,
usable with `trl.GRPOTrainer` or `rcgrpo.RCGRPOTrainer` as they are.

- `single_turn_dataset(...)`: one row per entry: `prompt` (conversational: the task's own `initial_messages`,
  BFCL's prompting-mode system prompt with the entry's function docs, then the question; no reward goal, which
  `RCGRPOTrainer` places), `entry_id`, `category`.
- `single_turn_reward(reward)`: `f(completions, entry_id, **kwargs) -> list[float]`, each completion's text scored
  as the pipeline scores a single-turn output (`env.single_turn.episode.score_text`): decoded by the project's
  safe decoder the way bfcl-eval's `default_decode_ast_prompting` decodes, checked with bfcl-eval's AST checker
  semantics (`env.single_turn.ast_check`). Model text is data: it is parsed with `ast`, never evaluated
  (arithmetic over literals is folded where bfcl-eval's decoder `eval`s it; bfcl-eval's decoders are not used).

The model answers in BFCL's prompting mode (`[func(a=1), g(b='x')]` as text), as the pipeline's single-turn
task does; no tool-calling chat template is needed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path

from datasets import Dataset

from rcgrpo_tasks.env.prompt import PromptConfig, ProtocolConfig
from rcgrpo_tasks.env.rewards import REWARDS, reward_value
from rcgrpo_tasks.env.single_turn.entries import CATEGORIES, DEFAULT_CATEGORIES, TASK_NAME, load_entries
from rcgrpo_tasks.env.single_turn.episode import initial_messages, score_text
from rcgrpo_tasks.integrations.sources import task_entries

DEFAULT_PROMPT = PromptConfig(protocol="official", doc_style="compact", system_prompt="bfcl")
"""The prompt without a choice: compact docs, BFCL's system prompt (one question: the protocol does not enter)."""


def protocol_of(prompt: PromptConfig | ProtocolConfig | None) -> ProtocolConfig:
    """The episode settings a prompt is rendered with: the pipeline's `PromptConfig` (params.yaml `prompt`), a
    `ProtocolConfig`, or None (`DEFAULT_PROMPT`)."""
    if prompt is None:
        prompt = DEFAULT_PROMPT
    if isinstance(prompt, PromptConfig):
        return prompt.protocol_config(1)  # the output budget does not enter a prompt
    if isinstance(prompt, ProtocolConfig):
        return prompt
    raise TypeError(f"prompt must be a PromptConfig, a ProtocolConfig or None, got {type(prompt).__name__}")


def single_turn_dataset(categories: Iterable[str] | None = DEFAULT_CATEGORIES, side: str | None = None,
                        entries_path: str | Path | None = None, split_path: str | Path | None = None,
                        prompt: PromptConfig | ProtocolConfig | None = None) -> Dataset:
    """A TRL prompt dataset of single-turn entries (`sources.task_entries` says which): columns `prompt`
    (system + user messages, as the pipeline's episodes start), `entry_id`, `category`."""
    cfg = protocol_of(prompt)
    chosen = task_entries(TASK_NAME, categories, side, entries_path, split_path)
    return Dataset.from_list([{"prompt": initial_messages(e, cfg), "entry_id": e.id, "category": e.category}
                              for e in chosen])


@functools.cache
def installed_entries() -> dict:
    """Every single-turn entry of the installed bfcl-eval data, by id (read once)."""
    return {e.id: e for e in load_entries(CATEGORIES)}


def completion_text(completion, entry_id: str) -> str:
    """The model's output: a plain-text completion, or a conversational one's first assistant message (TRL's
    `[{"role": "assistant", "content": ...}]`; the single-turn episode takes one output)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        message = next((m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"), None)
        if message is not None and isinstance(message.get("content"), str):
            return message["content"]
    raise TypeError(f"{entry_id}: a completion is text or a list of messages with an assistant message whose "
                    f"content is text, got {str(completion)[:120]}")


def single_turn_reward(reward: str = "paper_reward", entries: Iterable | None = None) -> Callable[..., list[float]]:
    """A TRL reward function scoring single-turn completions with the pipeline's scorer, named `reward` (TRL's
    logs: `rewards/<reward>/mean`). `reward`: `paper_reward` or `official_verdict` (both BFCL's AST verdict, 1.0
    or 0.0) or `partial_credit` (the fraction of gold calls matched one to one). `entries`: the entries the
    dataset's `entry_id`s name (None: every single-turn entry of the installed bfcl-eval data). The function
    takes TRL's `completions` and the dataset's `entry_id` column; other columns are ignored."""
    if reward not in REWARDS:
        raise ValueError(f"unknown reward {reward!r}; expected one of {REWARDS}")
    given = {e.id: e for e in entries} if entries is not None else None

    def score(completions: list, entry_id: list[str], **_) -> list[float]:
        pool = given if given is not None else installed_entries()
        missing = [i for i in entry_id if i not in pool]
        if missing:
            raise ValueError(f"entry_id {missing[0]!r} is not a single-turn entry the reward knows "
                             f"({len(missing)} unknown in this batch)")
        return [reward_value(score_text(pool[i], completion_text(c, i)), reward)
                for c, i in zip(completions, entry_id, strict=True)]

    score.__name__ = score.__qualname__ = reward
    return score
