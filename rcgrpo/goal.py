"""The reward goal: which tokens name the reward levels, the text that carries one, and where it goes in a
prompt. Pure functions of strings and chat messages (no torch, no TRL).

The paper's form: `\\n\\n[Reward Goal: <|high_reward|>]` (R = 1) or `<|low_reward|>` (R = 0) appended to the FIRST
user message, at RCTP fine-tuning and in every RC-GRPO rollout; evaluation conditions on the highest level.
Departures the library offers (`GOAL_PLACES`, each an explicit setting, the paper's the default): the last user
message, the system message, or nowhere (`external`: a rollout function or an environment's `reset()` places it).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

DEFAULT_LEVELS: tuple[str, ...] = ("<|low_reward|>", "<|high_reward|>")
"""The paper's two reward tokens, lowest first."""

GOAL_TEMPLATE = "\n\n[Reward Goal: {token}]"
"""The paper's goal text; `{token}` is replaced by the level's token."""

GOAL_PLACES: tuple[str, ...] = ("first_user", "last_user", "system", "external")
"""Where a goal goes: the first user message (the paper), the last one (TRL's environment `reset()` convention),
the system message (one is added at the front if the prompt has none), or nowhere (`external`)."""


def check_levels(levels: Sequence[str]) -> tuple[str, ...]:
    """THE check of a list of reward tokens (lowest level first): at least 2, distinct, non-empty strings without
    `]` (it would close the `[Reward Goal: ...]` text). Returns them as a tuple; ValueError naming the list."""
    levels = tuple(levels)
    if len(levels) < 2 or len(set(levels)) != len(levels):
        raise ValueError(f"reward tokens: need >= 2 distinct tokens, lowest first, got {list(levels)}")
    if any(not isinstance(t, str) or not t.strip() or "]" in t for t in levels):
        raise ValueError(f"reward tokens must be non-empty and must not contain ']' (it closes the reward goal), "
                         f"got {list(levels)}")
    return levels


def check_template(template: str) -> str:
    """A goal template must contain `{token}` exactly once and nothing else in braces."""
    if template.count("{token}") != 1 or template.replace("{token}", "").count("{") \
            or template.replace("{token}", "").count("}"):
        raise ValueError(f"reward goal template must contain '{{token}}' exactly once and no other braces, "
                         f"got {template!r}")
    return template


def format_goal(token: str | None, template: str = GOAL_TEMPLATE) -> str:
    """The goal text of `token` ('' without one)."""
    return template.replace("{token}", token) if token else ""


def level_of(reward: float, thresholds: Sequence[float]) -> int:
    """The level index of a reward: how many of the ascending `thresholds` it reaches (reward >= t). With the
    paper's 0/1 reward and one threshold in (0, 1]: 0 = failure (low token), 1 = success (high token)."""
    return sum(reward >= t for t in thresholds)


def check_thresholds(thresholds: Sequence[float], n_levels: int) -> tuple[float, ...]:
    """`n_levels - 1` strictly ascending, finite thresholds."""
    thresholds = tuple(float(t) for t in thresholds)
    if len(thresholds) != n_levels - 1:
        raise ValueError(f"{n_levels} reward levels need {n_levels - 1} threshold(s), got {list(thresholds)}")
    if any(b <= a for a, b in zip(thresholds, thresholds[1:])) or any(t != t or abs(t) == float("inf")
                                                                       for t in thresholds):
        raise ValueError(f"reward thresholds must be finite and strictly ascending, got {list(thresholds)}")
    return thresholds


def _append(content: Any, text: str) -> Any:
    """Message content + text: a string grows; a list of parts (multimodal) gets a text part."""
    if isinstance(content, str):
        return content + text
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    raise TypeError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def place_goal(prompt: str | list[dict], goal: str, place: str = "first_user") -> str | list[dict]:
    """A copy of `prompt` carrying `goal` at `place` (`GOAL_PLACES`); the input is not modified.

    A plain-text prompt is one user message: the goal is appended to its end for `first_user` / `last_user`
    and refused for `system`. Conversational prompts (TRL's list of `{"role", "content"}`): appended to the
    first / last message whose role is `user`, or to the system message (`system`: one is inserted first when
    the prompt has none). `external` and an empty goal return the prompt unchanged. ValueError for a chat
    without a user message or an unknown place."""
    if place not in GOAL_PLACES:
        raise ValueError(f"reward goal place must be one of {GOAL_PLACES}, got {place!r}")
    if not goal or place == "external":
        return copy.deepcopy(prompt)
    if isinstance(prompt, str):
        if place == "system":
            raise ValueError("reward goal place 'system' needs a conversational prompt (a list of messages)")
        return prompt + goal
    out = copy.deepcopy(list(prompt))
    if place == "system":
        i = next((k for k, m in enumerate(out) if m.get("role") == "system"), None)
        if i is None:
            return [{"role": "system", "content": goal.lstrip("\n")}, *out]
    else:
        users = [k for k, m in enumerate(out) if m.get("role") == "user"]
        if not users:
            raise ValueError("the prompt has no user message to carry the reward goal")
        i = users[0] if place == "first_user" else users[-1]
    out[i] = {**out[i], "content": _append(out[i]["content"], goal)}
    return out


def remove_goal(prompt: str | list[dict], goal: str) -> str | list[dict]:
    """A copy of `prompt` without the goal text `goal` wherever it was placed (`place_goal`, or an environment's
    reset text appended to a message): its last occurrence in a plain-text prompt and in each message's text
    (a string content, or a text part), and a system message that holds nothing but the goal (the one
    `place_goal` inserts) dropped. An empty goal returns the prompt unchanged."""
    def cut(text: str) -> str:
        i = text.rfind(goal)
        return text if i < 0 else text[:i] + text[i + len(goal):]

    if not goal:
        return copy.deepcopy(prompt)
    if isinstance(prompt, str):
        return cut(prompt)
    out = []
    for m in prompt:
        content = m.get("content")
        if m.get("role") == "system" and content == goal.lstrip("\n"):
            continue
        if isinstance(content, str):
            content = cut(content)
        elif isinstance(content, list):
            content = [{**p, "text": cut(p["text"])} if p.get("type") == "text" and isinstance(p.get("text"), str)
                       else p for p in content]
            content = [p for p in content if not (p.get("type") == "text" and p.get("text") == "")]
        out.append({**copy.deepcopy(m), "content": content} if "content" in m else copy.deepcopy(m))
    return out
