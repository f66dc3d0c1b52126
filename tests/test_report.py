"""report stage: table rows, bootstrap CIs, paper column, plot, bad input."""

from __future__ import annotations

import json
import random

import pytest

from rcgrpo_tasks import report
from rcgrpo_tasks.io import InputError, write_jsonl


def _eval_dir(tmp_path, label, acc_by_cat, n=20, seed=0):
    rng = random.Random(seed)
    rows = []
    for cat, acc in acc_by_cat.items():
        k = round(acc * n)
        flags = [1] * k + [0] * (n - k)
        rng.shuffle(flags)
        for i, ok in enumerate(flags):
            # the evaluate stage's results.jsonl row
            rows.append({"id": f"multi_turn_{cat}_{i}", "category": f"multi_turn_{cat}", "valid": bool(ok),
                         "official_valid": bool(ok) and i % 2 == 0, "partial_credit": 0.5 * ok,
                         "paper_reward": float(ok)})
    d = tmp_path / label
    write_jsonl(d / "results.jsonl", rows)
    return d


def test_bootstrap_ci_brackets_the_mean_and_shrinks_with_n():
    vals = [1.0] * 30 + [0.0] * 70
    lo, hi = report.bootstrap_ci(vals, seed=1)
    assert lo < 0.3 < hi
    assert 0.18 < lo < 0.26 and 0.34 < hi < 0.42  # ~ +-1.96*sqrt(.3*.7/100) = +-0.09
    lo4, hi4 = report.bootstrap_ci(vals * 4, seed=1)
    assert hi4 - lo4 < (hi - lo) * 0.7
    assert report.bootstrap_ci([1.0] * 10) == (1.0, 1.0)


def test_report_rows_order_paper_column_and_outputs(tmp_path):
    evals = [("rctp-rc_grpo", _eval_dir(tmp_path, "rcrc", {"base": 0.5, "miss_func": 0.25})),
             ("base", _eval_dir(tmp_path, "base", {"base": 0.1, "miss_func": 0.0})),
             ("sft", _eval_dir(tmp_path, "sft", {"base": 0.2, "miss_func": 0.1}))]
    rl = tmp_path / "rl.json"
    rl.write_text(json.dumps({"mean_frac_zero_std": 0.25, "mean_controllability_gap": 0.4, "steps": 2}))
    rows = report.build_report(evals, [("rctp-rc_grpo", rl)])
    assert [r["label"] for r in rows] == ["base", "sft", "rctp-rc_grpo"]
    top = rows[2]
    assert top["categories"]["base"]["accuracy"] == pytest.approx(50.0)
    assert top["overall"]["accuracy"] == pytest.approx(37.5)
    lo, hi = top["overall"]["ci"]
    assert lo < 37.5 < hi
    assert top["official_accuracy"] < top["overall"]["accuracy"]
    assert top["paper_table1_overall"] == 85.0 and rows[1]["paper_table1_overall"] is None
    assert top["rl_mean_frac_zero_std"] == 0.25
    md = report.markdown_table(rows)
    assert "RCTP+RC-GRPO" in md and "85.00" in md and "n/a" in md and "7B, GPU" in md
    png = tmp_path / "out" / "acc.png"
    report.plot(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_writes_table_json_plot(tmp_path):
    from typer.testing import CliRunner

    d = _eval_dir(tmp_path, "base", {"base": 0.3, "long_context": 0.1})
    out = tmp_path / "r"
    res = CliRunner().invoke(report.app, ["--eval", f"base={d}", "--table", str(out / "t.md"), "--json",
                                          str(out / "r.json"), "--plot", str(out / "p.png"), "--no-track"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "r.json").read_text())
    assert data["rows"]["base"]["categories"]["long_context"]["accuracy"] == pytest.approx(10.0)
    assert (out / "p.png").stat().st_size > 1000


def test_bad_inputs_are_clear(tmp_path):
    with pytest.raises(InputError, match="no per-entry results"):
        report.load_eval("x", tmp_path)
    write_jsonl(tmp_path / "results.jsonl", [{"foo": 1}])
    with pytest.raises(InputError, match="entry_id"):
        report.load_eval("x", tmp_path)
