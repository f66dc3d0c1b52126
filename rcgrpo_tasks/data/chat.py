"""Chats for fine-tuning: the reward goal on the first user message, and THE assistant-token loss mask.

`assistant_token_mask(tokenizer, messages) -> (input_ids, mask)` is the mask used for SFT and RCTP: 1 on
assistant content tokens and the end-of-turn token that closes them, 0 on system/user/tool text and
template scaffolding (`<|im_start|>assistant\\n`), computed from the chat template's own rendering, so it
works for any prefix-stable template (SmolLM2/Qwen ChatML included). The reward goal text is
`rcgrpo.goal.format_goal`, the same text RL and evaluate put in the prompt.

Where the goal's token sits in the model's input is the model's chat template's business:
`answer_goal_template` wraps a template so that it renders the goal's token as the first token of the first
answer (`sft.reward_goal_place: answer`, saved with the RCTP model, so every stage that prompts it renders
the same); the data keep the paper's form (the goal ends the first user message).
"""

from __future__ import annotations

import json

from rcgrpo.goal import format_goal

TEMPLATE_GOAL_PLACES = ("user", "answer")
"""`user`: the goal ends the first user message (the paper); `answer`: its token opens the first answer."""

_ANSWER_MARK = "{#- rcgrpo: the reward goal's token opens the first answer -#}"
_GOAL_HEAD, _GOAL_TAIL = format_goal("\0").split("\0")


def answer_goal_template(template: str) -> str:
    """`template` wrapped so that a reward goal at the end of the first user message (`format_goal`)
    renders as its bare token right before the first answer: after the first assistant header, or after the
    generation prompt when no answer follows yet. The token sits right before the answer, where it reaches the
    first answer token's prediction through the residual stream; at the end of the user message it sits ~6
    template tokens back and a small model learns the low rows' content under both tokens before it learns to
    route on the token (docs/rl.md "The token's place"). Chats without a goal render exactly as under
    `template`. Departure from the paper, whose goal text stays in the first user message: in multi-turn
    chats the token opens the first answer only. Idempotent."""
    if _ANSWER_MARK in template:
        return template
    head, tail = json.dumps(_GOAL_HEAD), json.dumps(_GOAL_TAIL)
    pre = (
        _ANSWER_MARK
        + "{%- set rg = namespace(goal='', msgs=[], seen=false, answered=false) -%}"
        "{%- for m in messages -%}{%- set c = m['content'] -%}"
        "{%- if m['role'] == 'user' and not rg.seen -%}{%- set rg.seen = true -%}"
        f"{{%- if c is string and {head} in c and c.endswith({tail}) -%}}"
        f"{{%- set rg.goal = c.split({head})[-1][:-{len(_GOAL_TAIL)}] -%}}"
        f"{{%- set c = c[:(c | length) - (rg.goal | length) - {len(_GOAL_HEAD) + len(_GOAL_TAIL)}] -%}}"
        "{%- endif -%}"
        "{%- elif m['role'] == 'assistant' and rg.goal and not rg.answered -%}{%- set rg.answered = true -%}"
        "{%- set c = rg.goal + (c or '') -%}"
        "{%- endif -%}"
        "{%- set rg.msgs = rg.msgs + [dict(m, content=c)] -%}{%- endfor -%}"
        "{%- set messages = rg.msgs -%}"
    )
    post = "{% if add_generation_prompt and rg.goal and not rg.answered %}{{ rg.goal }}{% endif %}"
    return pre + template + post


def goal_place(tokenizer) -> str:
    """Where `tokenizer`'s chat template renders a reward goal (`TEMPLATE_GOAL_PLACES`)."""
    return "answer" if _ANSWER_MARK in (getattr(tokenizer, "chat_template", None) or "") else "user"


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
