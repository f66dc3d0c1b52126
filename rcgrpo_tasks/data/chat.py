"""Chats for fine-tuning: the reward goal on the first user message, and THE assistant-token loss mask.

`assistant_token_mask(tokenizer, messages) -> (input_ids, mask)` is the mask used for SFT and RCTP: 1 on
assistant content tokens and the end-of-turn token that closes them, 0 on system/user/tool text and
template scaffolding (`<|im_start|>assistant\\n`), computed from the chat template's own rendering, so it
works for any prefix-stable template (SmolLM2/Qwen ChatML included). The reward goal text is
`env.prompt.format_reward_goal`, the same text RL and evaluate put in the prompt.
"""

from __future__ import annotations

import copy

from rcgrpo_tasks.env.prompt import format_reward_goal


def strip_reward_goal(messages: list[dict], reward_token: str | None) -> list[dict]:
    """A copy of the chat without the reward goal a conditioned policy was given (if any)."""
    out = copy.deepcopy(messages)
    suffix = format_reward_goal(reward_token)
    if suffix:
        first = next(m for m in out if m["role"] == "user")
        if first["content"].endswith(suffix):
            first["content"] = first["content"][: -len(suffix)]
    return out


def with_reward_goal(messages: list[dict], token: str) -> list[dict]:
    """A copy of the chat with `[Reward Goal: <token>]` appended to the first user message."""
    out = copy.deepcopy(messages)
    first = next((m for m in out if m["role"] == "user"), None)
    if first is None:
        raise ValueError("trajectory has no user message to attach the reward goal to")
    first["content"] += format_reward_goal(token)
    return out


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered chat, character spans of each assistant reply incl. the template's end-of-turn text)."""
    text = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("a chat cannot start with an assistant message")
        head = _render(tokenizer, messages[:i], generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(head) and text.startswith(upto) and len(upto) > len(head)):
            raise ValueError("chat template is not prefix-stable; cannot locate assistant tokens")
        spans.append((len(head), len(upto)))
    return text, spans


def assistant_token_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids of the rendered chat, mask): 1 exactly on assistant content + its end-of-turn token.

    Tokens of system/user/tool messages, the `<|im_start|>assistant\\n` header and the newline after
    `<|im_end|>` get 0. `input_ids` equal `apply_chat_template(messages, tokenize=True)`.
    """
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    eos = tokenizer.eos_token_id
    mask = [0] * len(ids)
    j = 0
    for start, end in spans:
        while j < len(ids) and offsets[j][0] < start:
            j += 1
        while j < len(ids) and offsets[j][1] <= end:
            if offsets[j][1] > offsets[j][0]:
                mask[j] = 1
            j += 1
            if ids[j - 1] == eos:  # the reply's end-of-turn token is learned; what follows is template
                break
    return ids, mask
