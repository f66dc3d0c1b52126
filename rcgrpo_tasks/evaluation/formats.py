"""How every table and line of the reports writes a number and an interval, once: nothing is printed as an
interval that is not one, and a missing value is `n/a`."""

from __future__ import annotations

import math
from collections.abc import Sequence


def missing(value) -> bool:
    """None or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def num(value, spec: str = ".3f") -> str:
    """`value` in `spec`; `n/a` where it is missing."""
    return "n/a" if missing(value) else format(value, spec)


def ci(value, interval: Sequence | None, spec: str = "+.3f") -> str:
    """`value [low, high]` in `spec`; `n/a` where the value or either bound is missing."""
    if not interval or len(interval) != 2 or any(missing(x) for x in (value, *interval)):
        return "n/a"
    return f"{format(value, spec)} [{format(interval[0], spec)}, {format(interval[1], spec)}]"
