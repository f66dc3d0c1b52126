"""What a failed answer is made of, in three kinds every task shares: the mechanism's reading of a failure.

- `no_call`: the answer holds no call at all (prose, or text that does not decode to calls): a failure of
  format, which any prompt can produce (the base model's prose answers are all of this kind);
- `wrong_function`: it calls, but not the gold's functions: single-turn, the called names as a multiset differ
  from the gold's (a wrong name, a call too many or too few: BFCL's `wrong_func_name` / `wrong_count`);
  multi-turn, some gold function is never called as often as the gold calls it;
- `wrong_arguments`: the right functions, and still a failure: their arguments (or, multi-turn, the state
  they leave) are wrong.
A failure is an answer the paper reward scores 0 (`success` False), whatever reward RL trains on. The kinds
read the answer's calls and the gold's function names only, not the checker's message text, so both tasks
classify alike. Departure from BFCL: its error types are finer (a type error, a missing required parameter
...) and task-specific; these three are the contrast RC-GRPO's low token can carry (format vs content).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

FAILURE_KINDS: tuple[str, ...] = ("no_call", "wrong_function", "wrong_arguments")
WRONG_CALLS: tuple[str, ...] = ("wrong_function", "wrong_arguments")
"""The failures that are calls: a contrast in content, not in format."""

_NAME = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*\(")


def result_calls(result) -> list[str]:
    """The call strings of a BFCL result (turns -> steps -> strings); [] for anything else."""
    if not isinstance(result, list):
        return []
    return [c for turn in result if isinstance(turn, list) for step in turn if isinstance(step, list)
            for c in step if isinstance(c, str) and c.strip()]


def call_names(calls: Iterable[str]) -> Counter:
    """The function names of call strings (`name(...)`) as a multiset; a string that is not call-shaped is left
    out."""
    return Counter(m.group(1) for m in (_NAME.match(c) for c in calls) if m)


def failure_kind(calls: Iterable[str], gold_names: Iterable[str], success: bool, exact: bool) -> str | None:
    """None for a success, else the failure's kind (`FAILURE_KINDS`) from the answer's call strings `calls` and
    the gold's function names: `exact` (single-turn, BFCL's checker wants the gold's calls and no other) the
    names must equal the gold's as multisets, else (multi-turn, extra calls allowed) cover them."""
    if success:
        return None
    have = call_names(calls)
    if not have:
        return "no_call"
    need = Counter(gold_names)
    right = have == need if exact else not (need - have)
    return "wrong_arguments" if right else "wrong_function"


def is_wrong_call(result, success: bool) -> bool:
    """A failure that holds a call (`WRONG_CALLS`: wrong function or wrong arguments), read from the result
    alone (no gold needed): what a content contrast pairs under the low token."""
    return not success and bool(call_names(result_calls(result)))
