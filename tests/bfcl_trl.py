"""Helpers of the tests of BFCL for TRL users (`rcgrpo_tasks/integrations/`): entry samples, the tools TRL
takes from an environment, BFCL call strings as a function-calling model sends them, a one-step GRPO config."""

from __future__ import annotations

import inspect
import random

from rcgrpo_tasks.env.multi_turn.calls import parse_call_string
from rcgrpo_tasks.env.multi_turn.environment import method_signature, public_methods


def sample(entries: list, per_category: int, seed: int = 0) -> list:
    """`per_category` entries of each category, drawn with a fixed seed (every category represented)."""
    by_cat: dict[str, list] = {}
    for e in entries:
        by_cat.setdefault(e.category, []).append(e)
    rng = random.Random(seed)
    return [e for cat in sorted(by_cat) for e in rng.sample(by_cat[cat], min(per_category, len(by_cat[cat])))]


def calls_text(calls) -> str:
    return "[" + ", ".join(calls) + "]"


def tools_of(env) -> dict:
    """The tools TRL takes from an environment: its public methods but `reset` and `get_reward`."""
    return {n: getattr(env, n) for n, _ in inspect.getmembers(type(env), inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")}


def keyword_call(entry, call_string: str) -> tuple[str, dict]:
    """(name, arguments by name) of a BFCL call string, as a function-calling model sends it."""
    call = parse_call_string(call_string)
    owner = next(c for c in entry.involved_classes if call.name in public_methods(c))
    return call.name, dict(method_signature(owner, call.name).bind(*call.args, **call.kwargs).arguments)


def replay(env, entry, calls) -> list[str]:
    """Send BFCL call strings through an environment's tools the way TRL does (arguments by name)."""
    tools = tools_of(env)
    return [tools[name](**args) for name, args in (keyword_call(entry, c) for c in calls)]


def grpo_args(cls, out, **kw):
    """One CPU step of G=2 rollouts of 2 prompts, no logging or saving (`kw` overrides)."""
    base = dict(max_steps=1, num_generations=2, per_device_train_batch_size=4, max_completion_length=8,
                report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", disable_tqdm=True,
                seed=0, learning_rate=1e-3, beta=0.0)  # no reference model: full fine-tuning of a tiny model
    return cls(str(out), **{**base, **kw})
