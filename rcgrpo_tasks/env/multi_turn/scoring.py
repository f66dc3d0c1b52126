"""Scores for one BFCL v4 multi-turn trajectory: the official verdict, the paper reward, partial credit.

Input everywhere is BFCL's result format for one entry: `model_turns[turn][step] -> list of call strings`
(what `rcgrpo score` reads and what the rollout engine writes). Training rewards (generation, RL) and
evaluation all call this module, so they cannot drift apart.

- `official_verdict`: bfcl-eval's `multi_turn_checker` semantics on isolated environments. Wrong turn
  count -> `multi_turn:force_terminated`; per turn with non-empty ground truth: empty model turn ->
  `multi_turn:empty_turn_model_response`; state check (every public attribute of every instance equal)
  -> `multi_turn:instance_state_mismatch`; response check (this turn's gold results an unordered
  sub-multiset of ALL model results so far) -> `multi_turn:execution_response_mismatch`. Empty model
  steps are dropped first, as bfcl-eval's runner drops empty decoded steps.
- `paper_reward`: RC-GRPO's trajectory-level binary reward: 1.0 iff the final state equals the gold
  replay's AND every gold call (arguments bound to parameter names, defaults applied) appears among the
  model's calls (multiset). Turn boundaries are ignored, so it also scores the paper's merged-steps protocol.
- `partial_credit`: fraction of checked turns (non-empty ground truth) that pass all three checks,
  executing every turn instead of stopping at the first failure.

`score_entry` computes all three in one pass over two environments (model, gold), which is what makes it
cheaper than bfcl-eval's checker (bench/score_speed.py).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

from rcgrpo_tasks.env.multi_turn.calls import Call, CallParseError, parse_call_string
from rcgrpo_tasks.env.multi_turn.entries import Entry
from rcgrpo_tasks.env.multi_turn.environment import BfclEnvironment, DefaultsScope
from rcgrpo_tasks.env.rewards import EntryScore

ModelTurns = list[list[list[str]]]  # turns -> steps -> call strings


@dataclass
class _Trace:
    """What one joint execution of model and gold trajectories observed."""

    turns: list[dict] = field(default_factory=list)  # per gold turn: checked, empty, state_ok, resp_ok, ...
    final_state_ok: bool = False
    model_calls: list[Call] = field(default_factory=list)
    model_bound: list[tuple | None] = field(default_factory=list)  # canonical (name, args) per model call
    gold_bound: list[tuple | None] = field(default_factory=list)


def _empty_step(step: list[str]) -> bool:
    """bfcl-eval `is_empty_execute_response`: no calls, or a single empty string."""
    return len(step) == 0 or (len(step) == 1 and len(step[0]) == 0)


@functools.lru_cache(maxsize=65536)
def _parse_cached(text: str) -> Call | str:
    """Parsed call, or the string itself if it does not parse (it then executes to an error observation,
    like a failed `eval` in bfcl-eval). Cached: gold strings recur across rollouts; the environment copies
    mutable arguments before each call, so sharing parsed Calls is safe."""
    try:
        return parse_call_string(text)
    except CallParseError:
        return text


def _parse_all(strings: list[str]) -> list[Call | str]:
    return [_parse_cached(s) for s in strings]


def _states_equal(model_env: BfclEnvironment, gold_env: BfclEnvironment) -> tuple[bool, str | None]:
    """bfcl-eval `state_checker`: every public attribute of each gold instance equals the model's."""
    for class_name, gold in gold_env.instances.items():
        model = model_env.instances[class_name]
        for attr, value in vars(gold).items():
            if not attr.startswith("_") and getattr(model, attr) != value:
                return False, class_name
    return True, None


def _unordered_subset(needed: list[str], have: list[str]) -> list[str]:
    """Items of `needed` missing from `have`, counting multiplicity (bfcl-eval `_is_subsequence_unordered`)."""
    missing = Counter(needed) - Counter(have)
    return list(missing.elements())


def _execute(entry: Entry, model_turns: ModelTurns) -> _Trace:
    # One defaults scope for both: bfcl-eval's model and gold instances share mutable defaults within an
    # entry (environment.DefaultsScope), and no entry sees another's.
    scope = DefaultsScope()
    model_env, gold_env = BfclEnvironment(entry, scope), BfclEnvironment(entry, scope)
    trace = _Trace()
    all_results: list[str] = []
    n = max(len(entry.ground_truth), len(model_turns))
    for t in range(n):
        steps = [s for s in (model_turns[t] if t < len(model_turns) else []) if not _empty_step(s)]
        turn_results: list[str] = []
        for step in steps:
            parsed = _parse_all(step)
            trace.model_calls.extend(c for c in parsed if isinstance(c, Call))
            turn_results.extend(model_env.execute_step(parsed))
        all_results.extend(turn_results)
        gold_calls = entry.ground_truth[t] if t < len(entry.ground_truth) else ()
        gold_results = gold_env.execute_step(list(gold_calls))
        if not gold_calls:
            trace.turns.append({"checked": False})
            continue
        state_ok, bad_class = _states_equal(model_env, gold_env)
        trace.turns.append({
            "checked": True,
            "empty": not steps,
            "state_ok": state_ok,
            "bad_class": bad_class,
            "missing": _unordered_subset(gold_results, all_results),
        })
    trace.final_state_ok = _states_equal(model_env, gold_env)[0]
    trace.model_bound = [model_env.bind(c) for c in trace.model_calls]
    trace.gold_bound = [gold_env.bind(_parse_cached(c)) for t in entry.ground_truth for c in t]
    return trace


def _turn_passes(turn: dict) -> bool:
    return turn["checked"] and not turn["empty"] and turn["state_ok"] and not turn["missing"]


def _verdict(entry: Entry, model_turns: ModelTurns, trace: _Trace) -> tuple[bool, str | None, str | None]:
    if len(model_turns) != len(entry.ground_truth):
        return False, "multi_turn:force_terminated", (
            f"Model was force-terminated during inference phase. The length of the model result turns "
            f"({len(model_turns)}) does not match the length of the ground truth turns ({len(entry.ground_truth)}).")
    for t, turn in enumerate(trace.turns):
        if not turn["checked"]:
            continue
        if turn["empty"]:
            return False, "multi_turn:empty_turn_model_response", f"Model response list is empty for turn {t}"
        if not turn["state_ok"]:
            return False, "multi_turn:instance_state_mismatch", (
                f"Model instance for {turn['bad_class']} does not match the state with ground truth instance.")
        if turn["missing"]:
            return False, "multi_turn:execution_response_mismatch", (
                f"Model response execution results so far does not contain all the ground truth response "
                f"execution results for turn {t}.")
    return True, None, None


def _paper(trace: _Trace) -> float:
    if not trace.final_state_ok:
        return 0.0
    have = Counter(b for b in trace.model_bound if b is not None)
    need = Counter(trace.gold_bound)
    return 1.0 if not (need - have) else 0.0


def _partial(trace: _Trace) -> tuple[float, list[bool]]:
    passed = [_turn_passes(t) for t in trace.turns if t["checked"]]
    return (sum(passed) / len(passed) if passed else 1.0), passed


def _check_shape(model_turns: ModelTurns) -> str | None:
    if not isinstance(model_turns, list):
        return "result is not a list of turns"
    for t, turn in enumerate(model_turns):
        if not isinstance(turn, list):
            return f"turn {t} is not a list of steps"
        for s, step in enumerate(turn):
            if not isinstance(step, list) or not all(isinstance(c, str) for c in step):
                return f"turn {t} step {s} is not a list of call strings"
    return None


def score_entry(entry: Entry, model_turns: ModelTurns) -> EntryScore:
    """All scores of one trajectory in one joint execution."""
    problem = _check_shape(model_turns)
    if problem:
        # bfcl-eval: a result that is not a list of model responses is an inference error.
        return EntryScore(False, "multi_turn:inference_error", problem, 0.0, 0.0, [])
    trace = _execute(entry, model_turns)
    valid, error_type, message = _verdict(entry, model_turns, trace)
    partial, passed = _partial(trace)
    return EntryScore(valid, error_type, message, partial, _paper(trace), passed)


def call_recall(entry: Entry, result: ModelTurns) -> float:
    """Fraction of gold calls (multiset, arguments bound to parameter names, defaults applied) found among the
    model's calls: the paper protocol's partial credit (it has no turn boundaries, so per-turn credit is
    undefined there)."""
    env = BfclEnvironment(entry)

    def bound(strings) -> Counter:
        out = []
        for s in strings:
            try:
                out.append(env.bind(parse_call_string(s)))
            except CallParseError:
                continue
        return Counter(b for b in out if b is not None)

    need = bound([c for turn in entry.ground_truth for c in turn])
    have = bound([c for turn in result for step in turn for c in step])
    return sum((need & have).values()) / sum(need.values()) if need else 1.0
