"""Wilson intervals and the exact McNemar test (`ops.stats`) the report uses."""

from __future__ import annotations

import pytest


def test_wilson_and_exact_mcnemar():
    from rcgrpo_tasks.ops.stats import mcnemar_exact, wilson_ci

    lo, hi = wilson_ci(0, 16)
    assert lo == 0.0 and 0.15 < hi < 0.25  # 0/16 is not [0, 0]
    lo, hi = wilson_ci(9, 32)
    assert 0.15 < lo < 0.28125 < hi < 0.46
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)  # 6 discordant pairs all one way: p = 2 x 0.5^6
    assert mcnemar_exact(5, 5) == 1.0
