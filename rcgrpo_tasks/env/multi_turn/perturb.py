"""Near-miss perturbations of a ground-truth call script: realistic ways an agent almost succeeds.

A perturbation takes an entry's gold calls (turns -> call strings) and returns a changed script plus a
one-line description of the change. Kinds (`PERTURBATIONS`):

- `wrong_arg_value`: one argument gets a plausible wrong value (another string literal of the same
  entry, a changed file extension, an off-by-one number, a negated flag, a shortened list);
- `wrong_function`: one call goes to a sibling function of the same class, preferring one that accepts
  the same argument names (`mv` -> `cp`, `fillFuelTank` -> `lockDoors`), arguments kept;
- `dropped_call`: one call is left out;
- `extra_call`: one call is added: a repeat of a call, a call borrowed from another turn, or a call made
  in a turn where the gold answer is to make none (miss_param / miss_func turns);
- `stop_early`: the agent stops part-way: the calls after a cut point are gone, later turns included;
- `wrong_turn`: one call is made one turn too late or one turn too early (at a random place there).

These are pure functions of (entry, kind, rng): no execution here. Whether a perturbed script really
fails is decided by replaying it in the environment and scoring it (`generate_trajectories`): many
perturbations are harmless (an extra `ls`, a dropped read-only call) and must not be labelled failures.
"""

from __future__ import annotations

import functools
import inspect
import random
import re
from typing import Any

from rcgrpo_tasks.env.contract import Perturbation, Script
from rcgrpo_tasks.env.multi_turn.calls import Call, CallParseError, parse_call_string
from rcgrpo_tasks.env.multi_turn.entries import Entry
from rcgrpo_tasks.env.multi_turn.environment import env_class, public_methods

PERTURBATIONS: tuple[str, ...] = (
    "wrong_arg_value", "wrong_function", "dropped_call", "extra_call", "stop_early", "wrong_turn",
)


# ----------------------------------------------------------------------------------------------------
# Function catalogue of an entry (names, classes, parameter names), from the bfcl-eval classes.


@functools.cache
def _class_params(class_name: str) -> dict[str, tuple[str, ...]]:
    """Public method -> parameter names (without self), for one environment class."""
    cls = env_class(class_name)
    out = {}
    for name in public_methods(class_name):
        try:
            params = tuple(p for p in inspect.signature(getattr(cls, name)).parameters if p != "self")
        except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
            params = ()
        out[name] = params
    return out


def entry_functions(entry: Entry) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Function name -> (class, parameter names) for every function callable in the entry."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for class_name in entry.involved_classes:
        for name, params in _class_params(class_name).items():
            out[name] = (class_name, params)
    return out


def _parse(call: str) -> Call | None:
    try:
        return parse_call_string(call)
    except CallParseError:
        return None


def _positions(turns: Script) -> list[tuple[int, int]]:
    return [(t, i) for t, calls in enumerate(turns) for i in range(len(calls))]


def _replace(turns: Script, t: int, new_calls: list[str]) -> Script:
    return tuple(tuple(new_calls) if k == t else calls for k, calls in enumerate(turns))


# ----------------------------------------------------------------------------------------------------
# wrong_arg_value


def _entry_strings(turns: Script) -> list[str]:
    """String literals used anywhere in the script: the most realistic wrong values (a mixed-up name)."""
    seen: dict[str, None] = {}
    for calls in turns:
        for text in calls:
            call = _parse(text)
            if call is None:
                continue
            for v in (*call.args, *call.kwargs.values()):
                if isinstance(v, str) and v:
                    seen.setdefault(v, None)
    return list(seen)


def _mutate_str(value: str, pool: list[str], rng: random.Random) -> str:
    others = [s for s in pool if s != value]
    if others and rng.random() < 0.5:
        return rng.choice(others)
    m = re.fullmatch(r"(.+)\.([A-Za-z0-9]+)", value)
    if m:
        ext = rng.choice([e for e in ("txt", "pdf", "csv", "md", "log", "json") if e != m.group(2)])
        return f"{m.group(1)}.{ext}"
    if value.isupper() and len(value) > 1:  # codes: airports, tickers, ids
        return value[:-1] + ("A" if value[-1] != "A" else "B")
    if len(value) > 3 and rng.random() < 0.5:
        return value[: max(1, len(value) // 2)]
    return value + rng.choice(["s", "_old", "2"])


def _mutate(value: Any, pool: list[str], rng: random.Random) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([1, -1, 10, value if value else 5])
    if isinstance(value, float):
        return round(value * rng.choice([0.5, 2.0, 1.1]) + rng.choice([0.0, 1.0]), 4) if value else 1.0
    if isinstance(value, str):
        return _mutate_str(value, pool, rng)
    if isinstance(value, list):
        return value[:-1] if value else ["item"]
    if isinstance(value, dict):
        return {k: v for k, v in list(value.items())[:-1]} if value else {"key": "value"}
    return "none" if value is None else None


def wrong_arg_value(entry: Entry, turns: Script, rng: random.Random) -> Perturbation | None:
    slots = []
    for t, i in _positions(turns):
        call = _parse(turns[t][i])
        if call is not None and (call.args or call.kwargs):
            slots.append((t, i, call))
    if not slots:
        return None
    t, i, call = rng.choice(slots)
    keys: list[int | str] = list(range(len(call.args))) + list(call.kwargs)
    key = rng.choice(keys)
    old = call.args[key] if isinstance(key, int) else call.kwargs[key]
    new = _mutate(old, _entry_strings(turns), rng)
    if new == old and type(new) is type(old):
        return None
    if isinstance(key, int):
        args = list(call.args)
        args[key] = new
        changed = Call(call.name, tuple(args), dict(call.kwargs))
    else:
        changed = Call(call.name, call.args, {**call.kwargs, key: new})
    calls = list(turns[t])
    calls[i] = changed.to_string()
    return Perturbation("wrong_arg_value", _replace(turns, t, calls),
                        f"turn {t} call {i}: {call.name} argument {key!r}: {old!r} -> {new!r}")


# ----------------------------------------------------------------------------------------------------
# wrong_function


def _sibling(entry: Entry, call: Call, rng: random.Random) -> str | None:
    """A different function of the same class, preferring one that accepts the call's argument names."""
    funcs = entry_functions(entry)
    if call.name not in funcs:
        return None
    cls, _ = funcs[call.name]
    siblings = sorted(n for n, (c, _) in funcs.items() if c == cls and n != call.name)
    if not siblings:
        return None
    wanted = set(call.kwargs)
    accepting = [n for n in siblings if wanted and wanted <= set(funcs[n][1])]
    sharing = [n for n in siblings if wanted & set(funcs[n][1])]
    for tier in (accepting, sharing, siblings):
        if tier:
            return rng.choice(tier)
    return None


def wrong_function(entry: Entry, turns: Script, rng: random.Random) -> Perturbation | None:
    positions = _positions(turns)
    rng.shuffle(positions)
    for t, i in positions:
        call = _parse(turns[t][i])
        name = _sibling(entry, call, rng) if call is not None else None
        if name is None:
            continue
        calls = list(turns[t])
        calls[i] = Call(name, call.args, dict(call.kwargs)).to_string()
        return Perturbation("wrong_function", _replace(turns, t, calls),
                            f"turn {t} call {i}: {call.name} -> {name}")
    return None


# ----------------------------------------------------------------------------------------------------
# dropped_call / extra_call / stop_early / wrong_turn


def dropped_call(entry: Entry, turns: Script, rng: random.Random) -> Perturbation | None:
    positions = _positions(turns)
    if not positions:
        return None
    t, i = rng.choice(positions)
    calls = list(turns[t])
    dropped = calls.pop(i)
    return Perturbation("dropped_call", _replace(turns, t, calls), f"turn {t} call {i} dropped: {dropped}")


def extra_call(entry: Entry, turns: Script, rng: random.Random) -> Perturbation | None:
    positions = _positions(turns)
    if not positions:
        return None
    empty_turns = [t for t, calls in enumerate(turns) if not calls]
    options = ["repeat"] + (["borrow"] if len({t for t, _ in positions}) > 1 else [])
    options += ["unwanted"] if empty_turns else []
    how = rng.choice(options)
    src_t, src_i = rng.choice(positions)
    extra = turns[src_t][src_i]
    if how == "repeat":
        t, at = src_t, src_i + 1
    elif how == "borrow":
        t = rng.choice(sorted({p for p, _ in positions} - {src_t}))
        at = rng.randint(0, len(turns[t]))
    else:
        t, at = rng.choice(empty_turns), 0
    calls = list(turns[t])
    calls.insert(at, extra)
    return Perturbation("extra_call", _replace(turns, t, calls),
                        f"turn {t}: extra call ({how}) at {at}: {extra}")


def stop_early(entry: Entry, turns: Script, rng: random.Random) -> Perturbation | None:
    with_calls = [t for t, calls in enumerate(turns) if calls]
    if not with_calls:
        return None
    t = rng.choice(with_calls)
    keep = rng.randrange(len(turns[t]))
    new = tuple(calls if k < t else (calls[:keep] if k == t else ()) for k, calls in enumerate(turns))
    return Perturbation("stop_early", new, f"stopped in turn {t} after {keep} of {len(turns[t])} calls")


def wrong_turn(entry: Entry, turns: Script, rng: random.Random) -> Perturbation | None:
    """Move one call into the previous or next turn, at a random place there.

    Only a move that changes the global call order (or crosses a turn whose gold answer is to do
    nothing) can fail the paper reward, which ignores turn boundaries; the scorer sorts that out.
    """
    moves = [(t, d) for t in range(len(turns)) for d in (-1, 1) if turns[t] and 0 <= t + d < len(turns)]
    if not moves:
        return None
    t, d = rng.choice(moves)
    i = rng.randrange(len(turns[t]))
    src, dst = list(turns[t]), list(turns[t + d])
    moved = src.pop(i)
    at = rng.randint(0, len(dst))
    dst.insert(at, moved)
    new = tuple(src if k == t else (dst if k == t + d else calls) for k, calls in enumerate(turns))
    when = "late" if d > 0 else "early"
    return Perturbation("wrong_turn", new, f"{moved} moved from turn {t} to turn {t + d} at {at} ({when})")


_KINDS = {
    "wrong_arg_value": wrong_arg_value,
    "wrong_function": wrong_function,
    "dropped_call": dropped_call,
    "extra_call": extra_call,
    "stop_early": stop_early,
    "wrong_turn": wrong_turn,
}


def perturb(entry: Entry, kind: str, rng: random.Random, turns: Script | None = None) -> Perturbation | None:
    """One perturbation of `kind` of the entry's gold script (or of `turns`); None if not applicable.

    The result always differs from the input script (a no-op perturbation returns None).
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown perturbation {kind!r}; expected one of {PERTURBATIONS}")
    base: Script = tuple(tuple(t) for t in (entry.ground_truth if turns is None else turns))
    out = _KINDS[kind](entry, base, rng)
    if out is None:
        return None
    turns = tuple(tuple(t) for t in out.turns)
    return None if turns == base else Perturbation(out.kind, turns, out.detail)
