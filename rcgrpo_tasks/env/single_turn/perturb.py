"""Expert answers and near-miss failures of single-turn BFCL entries, as call scripts (no model).

Expert (`expert_answer`): each possible-answer call with ONE accepted value per parameter: the first
accepted value that is neither `""` nor None; a parameter with no other (`[""]`, `["", None]`: optional,
BFCL accepts omitting it) is left out. Dict parameters resolve their keys the same way, lists of dicts each dict. Whether BFCL's
checker accepts the expert is decided by scoring it (`generate_trajectories` drops experts that fail and
counts them).

Near misses (`PERTURBATIONS`), each a realistic way a function-calling model almost succeeds:
- `wrong_arg_value`: one argument gets a plausible wrong value (a number off by one or doubled, a flipped
  flag, another string of the question or a changed one, a shortened list);
- `missing_param`: one required argument is left out;
- `wrong_function`: one call goes to another function of the entry's docs (`multiple`), else to a
  near-miss name (`math.factorial` -> `factorial`, `get_weather` -> `get_weather_info`);
- `extra_call`: one call too many (a gold call repeated, or another listed function called as well);
- `dropped_call`: one call too few (for a one-call answer: no call at all, `[]`).
Pure functions of (entry, kind, rng); a script equal to the expert's is never returned. Whether a near miss
really fails is decided by scoring its replay (harmless ones, e.g. a wrong value BFCL also accepts, are
rejected there).
"""

from __future__ import annotations

import random
import re
from typing import Any

from rcgrpo_tasks.env.contract import Perturbation
from rcgrpo_tasks.env.single_turn.entries import SingleTurnEntry, render_call

PERTURBATIONS: tuple[str, ...] = ("wrong_arg_value", "missing_param", "wrong_function", "extra_call", "dropped_call")


def _doc(entry: SingleTurnEntry, name: str) -> dict:
    return next((d for d in entry.functions if d["name"] == name), {})


def _first(values: list) -> Any:
    """The first accepted value that is neither the omit marker `""` nor None (None: leave it out)."""
    return next((v for v in values if v != "" and v is not None), None)


def _resolve_dict(answer: dict) -> dict:
    return {k: _first(v) for k, v in answer.items() if isinstance(v, list) and _first(v) is not None}


def _resolve(value: Any, meta: dict) -> Any:
    """One accepted value as the model should write it: dicts and lists of dicts hold accepted-value lists."""
    kind = meta.get("type")
    if kind == "dict" and isinstance(value, dict):
        return _resolve_dict(value)
    items = meta.get("items") or {}
    if kind == "array" and items.get("type") == "dict" and isinstance(value, list):
        return [_resolve_dict(d) if isinstance(d, dict) else d for d in value]
    return value


def expert_answer(entry: SingleTurnEntry) -> list[dict]:
    """The gold calls `[{name: {param: value}}]` with one accepted value per parameter (module docstring)."""
    out = []
    for call in entry.possible_answer:
        for name, params in call.items():
            props = _doc(entry, name).get("parameters", {}).get("properties", {})
            args = {}
            for param, values in params.items():
                value = _first(values)
                if value is not None:
                    args[param] = _resolve(value, props.get(param, {}))
            out.append({name: args})
    return out


def expert_calls(entry: SingleTurnEntry) -> list[str]:
    return [render_call(name, args) for call in expert_answer(entry) for name, args in call.items()]


# ---------------------------------------------------------------------------------------------------- near misses


def _question_strings(entry: SingleTurnEntry) -> list[str]:
    """Quoted or capitalised phrases of the question: the wrong values a model plausibly picks."""
    text = " ".join(str(m.get("content", "")) for m in entry.question if m.get("role") == "user")
    quoted = re.findall(r"'([^']{2,40})'|\"([^\"]{2,40})\"", text)
    words = re.findall(r"\b[A-Z][a-zA-Z]{2,}(?: [A-Z][a-zA-Z]{2,})*\b", text)
    return list(dict.fromkeys([a or b for a, b in quoted] + words))


def _mutate(value: Any, pool: list[str], rng: random.Random) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([1, -1, value or 5])
    if isinstance(value, float):
        return round(value * rng.choice([0.5, 2.0]) + 1.0, 4)
    if isinstance(value, str):
        others = [s for s in pool if s.lower() != value.lower()]
        if others and rng.random() < 0.5:
            return rng.choice(others)
        return value[: max(1, len(value) // 2)] if len(value) > 3 else value + "s"
    if isinstance(value, list):
        return value[:-1] if len(value) > 1 else value + value
    if isinstance(value, dict) and value:
        return {k: v for k, v in list(value.items())[:-1]}
    return "none"


def _replace_call(calls: list[dict], i: int, new: dict | None) -> list[dict]:
    return [c for j, c in enumerate(calls) if j != i] if new is None else [new if j == i else c for j, c in enumerate(calls)]


def wrong_arg_value(entry: SingleTurnEntry, calls: list[dict], rng: random.Random):
    slots = [(i, name, p) for i, c in enumerate(calls) for name, args in c.items() for p in args]
    if not slots:
        return None
    i, name, param = rng.choice(slots)
    old = calls[i][name][param]
    new = _mutate(old, _question_strings(entry), rng)
    if new == old:
        return None
    return _replace_call(calls, i, {name: {**calls[i][name], param: new}}), f"{name} argument {param!r}: {old!r} -> {new!r}"


def missing_param(entry: SingleTurnEntry, calls: list[dict], rng: random.Random):
    slots = [(i, name, p) for i, c in enumerate(calls) for name, args in c.items() for p in args
             if p in (_doc(entry, name).get("parameters", {}).get("required") or [])]
    if not slots:
        return None
    i, name, param = rng.choice(slots)
    args = {k: v for k, v in calls[i][name].items() if k != param}
    return _replace_call(calls, i, {name: args}), f"{name}: required argument {param!r} left out"


def _near_name(name: str) -> str:
    if "." in name:
        return name.rsplit(".", 1)[1]
    parts = name.split("_")
    return "_".join(parts[1:]) if len(parts) > 2 else f"{name}_info"


def wrong_function(entry: SingleTurnEntry, calls: list[dict], rng: random.Random):
    i = rng.randrange(len(calls))
    name = next(iter(calls[i]))
    others = sorted(d["name"] for d in entry.functions if d["name"] not in {n for c in calls for n in c})
    new = rng.choice(others) if others else _near_name(name)
    return _replace_call(calls, i, {new: dict(calls[i][name])}), f"{name} -> {new}"


def extra_call(entry: SingleTurnEntry, calls: list[dict], rng: random.Random):
    others = [d for d in entry.functions if d["name"] not in {n for c in calls for n in c}]
    if others and rng.random() < 0.5:
        doc = rng.choice(others)
        src = rng.choice(calls)
        args = {k: v for k, v in next(iter(src.values())).items()
                if k in doc.get("parameters", {}).get("properties", {})}
        extra = {doc["name"]: args}
    else:
        extra = rng.choice(calls)
    at = rng.randint(0, len(calls))
    return calls[:at] + [extra] + calls[at:], f"extra call at {at}: {next(iter(extra))}"


def dropped_call(entry: SingleTurnEntry, calls: list[dict], rng: random.Random):
    i = rng.randrange(len(calls))
    return _replace_call(calls, i, None), f"call {i} dropped: {next(iter(calls[i]))}"


_KINDS = {"wrong_arg_value": wrong_arg_value, "missing_param": missing_param, "wrong_function": wrong_function,
          "extra_call": extra_call, "dropped_call": dropped_call}


def perturb(entry: SingleTurnEntry, kind: str, rng: random.Random) -> Perturbation | None:
    """One near miss of `kind` of the entry's expert answer, as a one-turn script; None if not applicable."""
    if kind not in _KINDS:
        raise ValueError(f"unknown single-turn perturbation {kind!r}; expected one of {PERTURBATIONS}")
    calls = expert_answer(entry)
    if not calls:
        return None
    out = _KINDS[kind](entry, calls, rng)
    if out is None:
        return None
    new_calls, detail = out
    script = (tuple(render_call(n, a) for c in new_calls for n, a in c.items()),)
    if script == (tuple(render_call(n, a) for c in calls for n, a in c.items()),):
        return None
    return Perturbation(kind, script, detail)
