"""Wilson intervals and the exact McNemar test (`rcgrpo.stats`) the report uses."""

from __future__ import annotations

import pytest


def test_wilson_and_exact_mcnemar():
    from rcgrpo.stats import mcnemar_exact
    from rcgrpo_tasks.evaluation.stats import wilson_ci

    lo, hi = wilson_ci(0, 16)
    assert lo == 0.0 and 0.15 < hi < 0.25  # 0/16 is not [0, 0]
    lo, hi = wilson_ci(9, 32)
    assert 0.15 < lo < 0.28125 < hi < 0.46
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)  # 6 discordant pairs all one way: p = 2 x 0.5^6
    assert mcnemar_exact(5, 5) == 1.0


def test_tango_interval_solves_its_score_equation_and_never_collapses():
    import math

    from rcgrpo_tasks.evaluation.stats import paired_binary, tango_paired_ci

    z = 1.959964
    for n in (4, 60, 360):  # no discordant pair: +-z^2 / (n + z^2) in closed form
        lo, hi = tango_paired_ci(0, 0, n)
        assert hi == pytest.approx(z * z / (n + z * z), abs=1e-9) and lo == pytest.approx(-hi, abs=1e-9)
    for b, c, n in ((12, 2, 50), (1, 0, 60), (0, 7, 40), (30, 25, 360)):
        lo, hi = tango_paired_ci(b, c, n)
        assert lo < (b - c) / n < hi
        for delta, sign in ((lo, 1), (hi, -1)):  # the restricted MLE is the likelihood's maximum on the constraint
            grid = [i / 20000 for i in range(1, 20000)]
            s = n - b - c

            def loglik(p21, b=b, c=c, s=s, delta=delta):
                p12 = p21 + delta
                rest = 1 - p12 - p21
                if p12 <= 0 or rest <= 0:
                    return -math.inf
                return b * math.log(p12) + c * math.log(p21) + s * math.log(rest)

            best = max(grid, key=loglik)
            var = n * (2 * best + delta - delta ** 2)
            assert (b - c - n * delta) / math.sqrt(var) == pytest.approx(sign * z, abs=5e-3)
    one_up = paired_binary([1] * 21 + [1] + [0] * 38, [1] * 21 + [0] + [0] * 38)  # 1 entry up, none down
    assert one_up["diff"] == pytest.approx(1 / 60) and one_up["ci"][0] < 0 < one_up["ci"][1]
    assert one_up["only_first"] == 1 and one_up["only_second"] == 0 and one_up["p"] == 1.0
    same = paired_binary([1, 0, 1, 0], [1, 0, 1, 0])
    assert same["diff"] == 0 and same["ci"][0] < 0 < same["ci"][1] and same["p"] == 1.0  # no point interval
    with pytest.raises(ValueError, match="differ in length"):
        paired_binary([1], [1, 0])


def test_exact_tests_agree_with_scipy_and_enumeration():
    from scipy.stats import binomtest

    from rcgrpo.stats import mcnemar_exact
    from rcgrpo_tasks.evaluation.stats import clopper_pearson, sign_summary, z_power

    for up, down in ((10, 1), (3, 0), (7, 9), (0, 12)):
        assert mcnemar_exact(up, down) == pytest.approx(binomtest(up, up + down, 0.5).pvalue)
        r = sign_summary(up, down)
        ci = binomtest(up, up + down, 0.5).proportion_ci(method="exact")
        assert r["p"] == mcnemar_exact(up, down) and r["ci"] == pytest.approx([ci.low, ci.high], abs=1e-9)
    assert clopper_pearson(0, 0) != clopper_pearson(0, 0)  # NaN: no changed unit
    assert z_power() == pytest.approx(2.8016, abs=1e-4)


def test_paired_mean_and_its_minimum_detectable_effect():
    from rcgrpo_tasks.evaluation.stats import paired_mean

    r = paired_mean([0.25, 0.0, 0.0, -0.25, 0.5, 0.0, 0.25, 0.0])
    assert r["diff"] == pytest.approx(0.09375) and r["ci"][0] < r["diff"] < r["ci"][1]
    from statistics import stdev

    from scipy.stats import t as student_t
    from scipy.stats import ttest_1samp

    d = [0.25, 0.0, 0.0, -0.25, 0.5, 0.0, 0.25, 0.0]
    se = stdev(d) / 8 ** 0.5  # the interval, p and MDE of one t model on 7 df
    assert r["ci"] == pytest.approx([r["diff"] - student_t.ppf(0.975, 7) * se, r["diff"] + student_t.ppf(0.975, 7) * se])
    assert r["p"] == pytest.approx(ttest_1samp(d, 0.0).pvalue)
    assert r["mde"] == pytest.approx((student_t.ppf(0.975, 7) + student_t.ppf(0.8, 7)) * se, rel=1e-6)


def test_two_level_bootstrap_widens_with_the_spread_between_seeds():
    from rcgrpo_tasks.evaluation.stats import two_level_bootstrap

    units = [0.1 * ((i * 7) % 5 - 2) for i in range(40)]
    alike = two_level_bootstrap([units, units, units])
    apart = two_level_bootstrap([[u + 0.3 for u in units], units, [u - 0.3 for u in units]])
    assert alike["diff"] == pytest.approx(apart["diff"]) == pytest.approx(sum(units) / 40)
    assert apart["ci"][1] - apart["ci"][0] > 2 * (alike["ci"][1] - alike["ci"][0])
    assert apart["mde"] > alike["mde"] and apart["seeds"] == 3 and apart["n"] == 40
    assert apart["per_seed"] == pytest.approx([sum(units) / 40 + 0.3, sum(units) / 40, sum(units) / 40 - 0.3])
