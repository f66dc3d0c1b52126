"""How every table, line and title of the reports writes a number, an interval and the split it measured,
once: nothing is printed as an interval that is not one, a missing value is `n/a`, and a side of the split
is named as `SIDES` says (a dev report never says held-out)."""

from __future__ import annotations

import math
from collections.abc import Sequence

SIDES: dict[str, str] = {"test": "held-out", "dev": "dev"}
"""The sides of the split a measurement may read (`settings.side` of an evaluation, `side` of a
controllability check) and their name in reports: test is held out (what is reported), dev is what designs
are chosen on."""


def side_name(side: str) -> str:
    """`test` -> `held-out`, `dev` -> `dev`; another side is a ValueError (nothing else is measured)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {sorted(SIDES)}, got {side!r}")
    return SIDES[side]


def missing(value) -> bool:
    """None or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def num(value, spec: str = ".3f") -> str:
    """`value` in `spec`; `n/a` where it is missing."""
    return "n/a" if missing(value) else format(value, spec)


def ci(value, interval: Sequence | None, spec: str = "+.3f") -> str:
    """`value [low, high]` in `spec`; `n/a` where the value or either bound is missing; where the interval has
    no width at the printed precision (every unit alike: a bootstrap of equal values) the value and `[no
    spread: no interval]`, since a point is not an interval."""
    if not interval or len(interval) != 2 or any(missing(x) for x in (value, *interval)):
        return "n/a"
    lo, hi = format(interval[0], spec), format(interval[1], spec)
    if lo == hi:  # no width at the printed precision: float noise around a point is not an interval either
        return f"{format(value, spec)} [no spread: no interval]"
    return f"{format(value, spec)} [{lo}, {hi}]"


def split_title(task: str, side: str) -> str:
    """An accuracy plot's title: the benchmark, its task and the side of the split its entries come from."""
    return f"BFCL v4 {task}, {side_name(side)} split"
