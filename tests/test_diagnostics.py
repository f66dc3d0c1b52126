"""The RC-GRPO mechanism per step on hand-built step rows: averages with bootstrap CIs over steps, the rl
summary carrying them, and the side-by-side plot of GRPO vs RC-GRPO from the same init."""

from __future__ import annotations

import math

import pytest

from rcgrpo import group_metrics
from rcgrpo_tasks.data import rl_steps
from rcgrpo_tasks.evaluation import mechanism
from rcgrpo_tasks.ops.inputs import read_tsv
from rcgrpo_tasks.ops.outputs import write_tsv
from rcgrpo_tasks.train.rl import diagnostics

NAN = float("nan")


def _rows(frac, spread, gap) -> list[dict]:
    return [{"step": i + 1, "frac_zero_std": f, "adv_abs_mean": a, "adv_std": a * 1.1, "controllability_gap": g,
             "reward": 0.25} for i, (f, a, g) in enumerate(zip(frac, spread, gap))]


GRPO = _rows([1.0, 1.0, 0.5, 1.0], [0.0, 0.0, 0.4, 0.0], [NAN] * 4)  # all-high tokens: no gap
RC = _rows([0.5, 0.0, 0.5, 0.25], [0.4, 0.8, 0.4, 0.6], [1.0, 0.5, 0.5, 1.0])


def test_step_summary_means_and_cis():
    grpo, rc = rl_steps.step_summary(GRPO), rl_steps.step_summary(RC)
    assert grpo["frac_zero_std"]["mean"] == pytest.approx(0.875) and rc["frac_zero_std"]["mean"] == pytest.approx(0.3125)
    for s in (grpo, rc):
        for col in ("frac_zero_std", "adv_abs_mean"):
            c = s[col]
            assert c["steps"] == 4 and c["ci_low"] <= c["mean"] <= c["ci_high"]
    assert 0.5 <= grpo["frac_zero_std"]["ci_low"] and grpo["frac_zero_std"]["ci_high"] == 1.0  # within the data
    assert rc["frac_zero_std"]["ci_high"] <= 0.5 < grpo["frac_zero_std"]["ci_low"]  # RC-GRPO: fewer dead groups
    assert grpo["controllability_gap"] == {"mean": None, "ci_low": None, "ci_high": None, "steps": 0}
    assert rc["controllability_gap"]["mean"] == pytest.approx(0.75)
    assert rc["reward"] == {"mean": 0.25, "ci_low": 0.25, "ci_high": 0.25, "steps": 4}  # constant: no spread
    assert rl_steps.step_summary(RC) == rc  # seeded: a rerun states the same CI
    assert rl_steps.step_summary([{"step": 1}])["adv_std"]["steps"] == 0  # a column the TSV lacks


def test_rl_summary_states_the_mechanism_and_keeps_the_means():
    rows = [{c: NAN for c in diagnostics.PLOT_COLUMNS} | r for r in RC]
    out = diagnostics.summarize(rows)
    assert out["mean_frac_zero_std"] == pytest.approx(0.3125) and out["steps"] == 4  # the report reads these
    assert out["mechanism"]["frac_zero_std"]["mean"] == pytest.approx(out["mean_frac_zero_std"])
    assert set(out["mechanism"]) == set(rl_steps.MECHANISM_COLUMNS)
    assert {"adv_abs_mean", "adv_std", "frac_zero_std", "controllability_gap"} <= set(diagnostics.PLOT_COLUMNS)


def test_advantage_std_and_spread():
    a = group_metrics.group_advantages([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], 4)  # one split group, one zero-std
    assert group_metrics.zero_std_fraction([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], 4) == 0.5
    assert group_metrics.advantage_std(a) == pytest.approx(math.sqrt(sum(x * x for x in a) / 7))  # mean 0 here
    assert group_metrics.advantage_spread(a) == pytest.approx(sum(abs(x) for x in a) / 8)
    assert group_metrics.advantage_std([0.0] * 4) == 0.0 and math.isnan(group_metrics.advantage_std([]))


def test_plot_mechanism_draws_grpo_and_rc_grpo_side_by_side(tmp_path):
    tsvs = {}
    for label, rows in (("rctp-grpo", GRPO), ("rctp-rc_grpo", RC), ("sft-grpo", GRPO)):
        tsvs[label] = tmp_path / f"rl_{label}.tsv"
        write_tsv(tsvs[label], rows, diagnostics.PLOT_COLUMNS)
    tsvs["sft-rc_grpo"] = tmp_path / "never_written.tsv"  # a run without steps: an empty line, not a crash
    assert mechanism.run_groups(list(tsvs)) == {"rctp": ["rctp-grpo", "rctp-rc_grpo"],
                                                   "sft": ["sft-grpo", "sft-rc_grpo"]}
    out = mechanism.plot_mechanism(tsvs, tmp_path / "plots" / "mechanism.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list(out.parent.glob(".*tmp*"))

    fig = mechanism.mechanism_figure({k: read_tsv(v) for k, v in tsvs.items()})
    axes = fig.axes
    assert len(axes) == 2 * len(rl_steps.MECHANISM_COLUMNS)  # rows = inits, columns = diagnostics
    first = axes[0]  # rctp: zero-variance share, both runs on the same step axis
    assert "zero-variance" in first.get_title() and len(first.lines) == 2
    assert [list(line.get_xdata()) for line in first.lines] == [[1, 2, 3, 4], [1, 2, 3, 4]]
    labels = [t.get_text() for t in first.get_legend().get_texts()]
    assert labels[0].startswith("rctp-grpo: 0.875 [") and labels[1].startswith("rctp-rc_grpo: 0.312 [")
    gap = axes[rl_steps.MECHANISM_COLUMNS.index("controllability_gap")]
    assert [t.get_text() for t in gap.get_legend().get_texts()][0] == "rctp-grpo: n/a"
