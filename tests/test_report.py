"""report stage: rows, Wilson intervals, paired differences, the paper column, the three tables, plots, bad
input."""

from __future__ import annotations

import json
import random

import pytest

from rcgrpo.stats import bootstrap_ci
from rcgrpo_tasks.evaluation import report_tables
from rcgrpo_tasks.evaluation import results_table as report
from rcgrpo_tasks.evaluation.plots import accuracy_figure, accuracy_plot, probe_plot
from rcgrpo_tasks.evaluation.stats import paired_bootstrap_ci
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl


def _eval_dir(tmp_path, label, acc_by_cat, n=20, seed=0, side="test"):
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
    write_json(d / "metrics.json", {"settings": {"side": side}})
    return d


def test_bootstrap_ci_brackets_the_mean_and_shrinks_with_n():
    vals = [1.0] * 30 + [0.0] * 70
    lo, hi = bootstrap_ci(vals, seed=1)
    assert lo < 0.3 < hi
    assert 0.18 < lo < 0.26 and 0.34 < hi < 0.42  # ~ +-1.96*sqrt(.3*.7/100) = +-0.09
    lo4, hi4 = bootstrap_ci(vals * 4, seed=1)
    assert hi4 - lo4 < (hi - lo) * 0.7
    assert bootstrap_ci([1.0] * 10) == (1.0, 1.0)


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
    md = report_tables.report_markdown(rows, {}, "test")
    assert "RCTP+RC-GRPO" in md and "85.00" in md and "7B, GPU" in md
    assert md.index("## Outcome") < md.index("## RL") < md.index("## Controllability")
    png = tmp_path / "out" / "acc.png"
    accuracy_plot(rows, png, None, "BFCL v4 multi_turn, held-out split")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_are_clear(tmp_path):
    with pytest.raises(InputError, match="no per-entry results"):
        report.load_eval("x", tmp_path)
    write_jsonl(tmp_path / "results.jsonl", [{"foo": 1}])
    with pytest.raises(InputError, match="entry_id"):
        report.load_eval("x", tmp_path)


def _row(label, acc, ci, partial, paper=None):
    return {"label": label, "n": 80, "overall": {"accuracy": acc, "ci": list(ci)}, "partial_credit": partial,
            "paper_table1_overall": paper}


@pytest.mark.parametrize("acc,ci", [(0.0, (0.0, 0.0)), (85.0, (77.5, 92.5))])
def test_accuracy_plot_is_readable_at_zero_and_at_85(acc, ci):
    """Every bar carries its value (a 0 % bar is labelled, not an empty plot), the axis covers the values
    shown (CI and paper star) and the partial-credit panel sits beside it."""
    import matplotlib.pyplot as plt

    rows = [_row("base", acc, ci, 0.25, paper=11.25), _row("rctp-rc_grpo", acc, ci, 0.5, paper=85.0)]
    fig = accuracy_figure(rows, {"base": "Base"}, "BFCL v4 multi_turn, held-out split")
    ax, bx = fig.axes
    texts = [t.get_text() for t in ax.texts]
    assert texts.count(f"{acc:.1f}%") == 2
    assert ax.get_xlim()[1] >= max(ci[1], 85.0) or ax.get_xlim()[1] == 100.0
    assert [t.get_text() for t in bx.texts] == ["0.500", "0.250"]
    assert any("Base (n=80)" == t.get_text() for t in ax.get_yticklabels())
    plt.close(fig)


def test_paired_bootstrap_ci_keeps_pairs():
    a = [1.0, 1.0, 0.0, 1.0] * 10
    diff, lo, hi = paired_bootstrap_ci(a, a)
    assert (diff, lo, hi) == (0.0, 0.0, 0.0)  # identical arms: no spread at all when paired
    b = [0.0] * 40
    diff, lo, hi = paired_bootstrap_ci(a, b)
    assert diff == 0.75 and 0 < lo <= 0.75 <= hi
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1.0], [1.0, 0.0])


def _single_turn_dir(tmp_path, label, flags, side="test"):
    rows = [{"id": f"simple_python_{i}", "task": "single_turn", "category": "simple_python", "valid": bool(ok),
             "official_valid": bool(ok), "partial_credit": float(ok), "paper_reward": float(ok)}
            for i, ok in enumerate(flags)]
    d = tmp_path / label
    write_jsonl(d / "results.jsonl", rows)
    write_json(d / "metrics.json", {"settings": {"side": side}})
    return d


def test_every_row_says_its_task_and_the_paper_column_is_multi_turn_only(tmp_path):
    evals = [("base", _single_turn_dir(tmp_path, "base", [1, 0, 0, 0])),
             ("rctp-rc_grpo", _single_turn_dir(tmp_path, "rc", [1, 1, 0, 1]))]
    rows = report.build_report(evals, [])
    assert [r["task"] for r in rows] == ["single_turn", "single_turn"]
    assert all(r["paper_table1_overall"] is None for r in rows)  # the paper reports multi-turn only
    md = report_tables.outcome_table(rows)
    assert "| Base | 25.0 [" in md and "| 4 |" in md
    mt = report.build_report([("base", _eval_dir(tmp_path, "mt", {"base": 0.5}))], [])
    assert mt[0]["task"] == "multi_turn" and mt[0]["paper_table1_overall"] == 11.25
    mixed = tmp_path / "mixed"
    write_jsonl(mixed / "results.jsonl", [{"id": "simple_python_1", "valid": True},
                                          {"id": "multi_turn_base_1", "valid": False}])
    with pytest.raises(InputError, match="2 tasks"):
        report.load_eval("base", mixed)


def test_accuracy_intervals_are_wilson_and_never_zero_width_at_zero(tmp_path):
    evals = [("base", _single_turn_dir(tmp_path, "b", [0] * 16)), ("sft", _single_turn_dir(tmp_path, "s", [1] * 9 + [0] * 23))]
    rows = {r["label"]: r for r in report.build_report(evals, [])}
    lo, hi = rows["base"]["overall"]["ci"]
    assert lo == 0.0 and 15.0 < hi < 25.0 and rows["base"]["overall"]["successes"] == 0
    lo, hi = rows["sft"]["overall"]["ci"]
    assert 15.0 < lo < 28.125 < hi < 46.0


def test_rl_rows_carry_the_probe_and_the_rl_table_shows_it(tmp_path):
    evals = [("rctp-grpo", _single_turn_dir(tmp_path, "g", [1, 0]))]
    probe = {"entries": ["a", "b"], "samples": 4, "steps": [0, 5, 10], "reward": [0.25, 0.375, 0.5],
             "change": {"mean": 0.25, "ci_low": 0.125, "ci_high": 0.375, "prompts": 2}, "per_entry": {}}
    rl = tmp_path / "rl.json"
    rl.write_text(json.dumps({"probe": probe, "diverged": None, "mean_frac_zero_std": 0.5,
                              "nonfinite_grad_steps": [3, 7], "resumed_from": "checkpoints/rl/0/x/checkpoint-4"}))
    (row,) = report.build_report(evals, [("rctp-grpo", rl)])
    assert row["rl_probe"]["change"]["mean"] == 0.25
    md = report_tables.rl_table([row], {})
    assert "0.250 -> 0.375 -> 0.500 (steps 0, 5, 10)" in md and "+0.250 [+0.125, +0.375] (2 prompts x 4)" in md
    assert "| no; skipped at steps 3, 7; resumed from checkpoint-4 |" in md
    png = tmp_path / "probe.png"
    probe_plot([row], png, None, "RL: the fixed probe")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rl_rows_are_compared_with_their_init_on_the_same_entries(tmp_path):
    evals = [("rctp", _single_turn_dir(tmp_path, "r", [1, 0, 0, 0, 1, 0])),
             ("rctp-rc_grpo", _single_turn_dir(tmp_path, "rc", [1, 1, 1, 0, 1, 1]))]
    rows = {r["label"]: r for r in report.build_report(evals, [])}
    assert "vs_init" not in rows["rctp"]  # no SFT row to compare RCTP with here
    v = rows["rctp-rc_grpo"]["vs_init"]
    assert v["init"] == "rctp" and v["n"] == 6 and v["diff"] == pytest.approx(50.0)
    # 3 entries up, none down: the exact McNemar p is 0.25 and Tango's interval includes 0 (a percentile
    # bootstrap of these 6 entries never goes below 0)
    assert v["p"] == pytest.approx(0.25) and v["ci"][0] < 0 < 50.0 < v["ci"][1] and (v["up"], v["down"]) == (3, 0)
    assert "| +50.0 [" in report_tables.outcome_table(list(rows.values()))


def test_no_token_rows_rc_versus_grpo_paired_by_group_and_the_margin_columns(tmp_path):
    """A `-notoken` row is compared with the same model under its token; RC-GRPO against GRPO from the same
    init: zero-variance groups paired by step and slot (exact McNemar), held-out accuracy paired; an
    evaluation's margin (overall and without the empty answer) reaches the controllability table."""
    flags = {"rctp": [1, 1, 0, 0] * 5, "rctp-grpo": [1, 0, 0, 0] * 5, "rctp-rc_grpo": [1, 1, 1, 0] * 5,
             "rctp-rc_grpo-notoken": [1, 0, 0, 0] * 5}
    evals = [(label, _single_turn_dir(tmp_path, label, f)) for label, f in flags.items()]
    (tmp_path / "rctp-rc_grpo" / "metrics.json").write_text(json.dumps(
        {"margin": {"margin": 0.5, "ci": [0.25, 0.75], "n_entries": 20, "share_positive": 0.8,
                    "realistic": {"margin": 0.125, "ci": [0.0625, 0.25], "n_entries": 20, "share_positive": 0.6}},
         "token_rows": {"ratio": 0.6}, "settings": {"side": "test"}}))
    rl = tmp_path / "rl.json"
    rl.write_text(json.dumps({"mean_frac_zero_std": 0.5, "mean_frac_flat_fail": 0.125,
                              "mean_frac_flat_success": 0.375}))
    rows = report.build_report(evals, [("rctp-grpo", rl)])
    by = {r["label"]: r for r in rows}
    assert [r["label"] for r in rows][-1] == "rctp-rc_grpo-notoken"
    assert by["rctp-rc_grpo-notoken"]["vs_init"]["init"] == "rctp-rc_grpo"
    assert by["rctp-rc_grpo-notoken"]["vs_init"]["diff"] == pytest.approx(-50.0)
    assert by["rctp-rc_grpo"]["vs_init"]["init"] == "rctp" and by["rctp-rc_grpo"]["vs_grpo"]["diff"] == 50.0
    assert by["rctp-rc_grpo"]["ctl_margin_realistic"]["gap"] == 0.125
    ctl = report_tables.controllability_table(rows)
    assert "+0.500 [+0.250, +0.750] (20 entries)" in ctl and "+0.125 [+0.062, +0.250]" in ctl
    # 40 paired groups: GRPO flat in 30 (at success), RC-GRPO in 12 of those and in 2 others
    grpo = [{"step": i // 2, "group": i % 2, "entry_id": f"e{i}", "flat": "success" if i < 30 else None}
            for i in range(40)]
    rc = [{**g, "flat": ("success" if i < 12 else None) if i < 30 else ("fail" if i < 32 else None)}
          for i, g in enumerate(grpo)]
    rc.append({"step": 99, "group": 0, "entry_id": "x", "flat": None})  # unpaired: left out
    contrast = report.rc_versus_grpo(rows, {"rctp-grpo": grpo, "rctp-rc_grpo": rc})
    z = contrast["rctp-rc_grpo"]["zero_std_paired"]  # keyed by the RC-family cell, against its init's GRPO
    assert contrast["rctp-rc_grpo"]["versus"] == "rctp-grpo" and set(contrast) == {"rctp-rc_grpo"}
    assert (z["groups"], z["both"], z["only_grpo"], z["only_cell"]) == (40, 12, 18, 2)
    assert z["grpo"] == 0.75 and z["cell"] == 0.35 and z["mcnemar_p"] < 0.001
    assert z["cell_flat"] == {"fail": 2, "success": 12}
    assert contrast["rctp-rc_grpo"]["accuracy"]["diff"] == 50.0
    md = report_tables.rl_table(rows, contrast)
    assert "0.35 vs GRPO 0.75 (40 groups; only GRPO flat 18, only this cell flat 2; McNemar p = " in md
    ablation = report.rc_versus_grpo(rows, {"rctp-grpo": grpo, "rctp-rc_frozen": rc})  # an ablation is an RC cell
    assert ablation["rctp-rc_frozen"]["zero_std_paired"]["only_cell"] == 2


def test_rctp_is_compared_with_sft_on_the_same_entries(tmp_path):
    """RCTP under its high token against the SFT baseline, paired over the entries both evaluated: whether
    the token costs accuracy."""
    evals = [("sft", _single_turn_dir(tmp_path, "s", [1, 1, 0, 0])), ("rctp", _single_turn_dir(tmp_path, "r", [1, 0, 0, 0]))]
    rows = {r["label"]: r for r in report.build_report(evals, [])}
    v = rows["rctp"]["vs_init"]
    assert v["init"] == "sft" and v["n"] == 4 and v["diff"] == pytest.approx(-25.0) and "vs_init" not in rows["sft"]
    assert "vs SFT (0 up, 1 down, p = 1) |" in report_tables.outcome_table(list(rows.values()))


def test_pass_at_1_rows_and_paired_differences(tmp_path):
    """pass@1 per row (bootstrap CI over entries) and paired to the init; greedy's up / down counts."""
    def folder(label, greedy, pass1):
        rows = [{"id": f"simple_python_{i}", "category": "simple_python", "valid": bool(g), "official_valid": bool(g),
                 "partial_credit": 0.0, "paper_reward": float(g), "pass1": p} for i, (g, p) in enumerate(zip(greedy, pass1))]
        write_jsonl(tmp_path / label / "results.jsonl", rows)
        write_json(tmp_path / label / "metrics.json", {"settings": {"side": "test"}})
        return label, tmp_path / label

    rows = {r["label"]: r for r in report.build_report(
        [folder("sft", [1, 0, 0, 1], [0.5, 0.0, 0.25, 1.0]), folder("sft-grpo", [1, 1, 0, 0], [0.75, 0.5, 0.25, 1.0])], [])}
    assert rows["sft"]["overall"]["pass1"]["accuracy"] == pytest.approx(43.75)
    lo, hi = rows["sft"]["overall"]["pass1"]["ci"]
    assert lo <= 43.75 <= hi and hi - lo > 0
    vs = rows["sft-grpo"]["vs_init"]
    assert vs["pass1"]["diff"] == pytest.approx(25.0 * (0.25 + 0.5) / 1)  # (0.25 + 0.5) / 4 entries, in %
    assert (vs["diff"], vs["up"], vs["down"]) == (pytest.approx(0.0), 1, 1)
    md = report_tables.report_markdown(list(rows.values()), {}, "test")
    assert "+18.8" in md and "simple_python: greedy / pass@1 %" in md
    plain = report.build_report([("sft", _eval_dir(tmp_path, "plain", {"base": 0.5}))], [])[0]
    assert plain["overall"]["pass1"] is None and "| n/a |" in report_tables.outcome_table([plain])


@pytest.mark.parametrize("side,name", [("dev", "dev"), ("test", "held-out")])
def test_an_explicit_report_and_an_evaluation_name_their_split(tmp_path, monkeypatch, side, name):
    """The dev sweep's report (`--eval` one by one) and an evaluation's report.md and plot say the split their
    entries come from: on dev nothing says held-out. A report over two sides fails naming them, writes nothing."""
    from typer.testing import CliRunner

    from rcgrpo_tasks.evaluation import accuracy
    from rcgrpo_tasks.stages import report as report_stage

    titles = []
    real = report_stage.accuracy_plot
    monkeypatch.setattr(report_stage, "accuracy_plot", lambda *a: (titles.append(a[3]), real(*a)))
    dirs = {label: _single_turn_dir(tmp_path, label, [1, 0, 1, 0], side) for label in ("rctp", "rctp-grpo")}
    out = tmp_path / "out"
    args = [*(a for label, d in dirs.items() for a in ("--eval", f"{label}={d}")), "--table", str(out / "t.md"),
            "--json", str(out / "r.json"), "--plot", str(out / "a.png"), "--no-track"]
    res = CliRunner().invoke(report_stage.app, args)
    assert res.exit_code == 0, res.output
    text = (out / "t.md").read_text() + (out / "r.json").read_text() + titles[0]
    assert ("held-out" in text) == (side == "test") and "held out" not in text
    assert f"on the {name} entries" in text and titles == [f"BFCL v4 single_turn, {name} split"]
    md = accuracy.report_markdown({"label": "x", "task": "single_turn", "protocol": "paper", "categories": {},
                                   "overall": {"n": 0, "accuracy": 0.0, "ci": [0.0, 0.0], "partial_credit": 0.0,
                                               "paper_reward": 0.0}, "partial_credit_kind": "k", "terminations": {},
                                   "mean_steps": 1.0, "n_model_tokens": 0, "wall_time_s": 0.0,
                                   "model_tokens_per_s": 0.0, "rollouts_per_s": 0.0}, {"side": side}, None)
    assert f"## {name.capitalize()} split" in md and ("held-out" in md.lower()) == (side == "test")
    other = _single_turn_dir(tmp_path, "other", [1, 1, 1, 1], "dev" if side == "test" else "test")
    res = CliRunner().invoke(report_stage.app, [*args[:2], "--eval", f"sft={other}", *args[4:]])
    assert res.exit_code == 2 and "a report reads one side of the split" in res.output
    assert f"{side} (rctp)" in res.output and "(sft)" in res.output


def test_an_evaluation_that_does_not_say_its_split_is_refused(tmp_path):
    d = _single_turn_dir(tmp_path, "x", [1, 0])
    write_json(d / "metrics.json", {"settings": {}})
    with pytest.raises(InputError, match=r"metrics.json: settings.side must be one of \['dev', 'test'\], got None"):
        report.load_eval("x", d)
    (d / "metrics.json").unlink()
    with pytest.raises(InputError, match="metrics.json: not found"):
        report.load_eval("x", d)


@pytest.mark.parametrize("value,interval", [(None, [0.1, 0.2]), (0.1, None), (0.1, [float("nan"), 0.2]),
                                            (float("nan"), [0.1, 0.2]), (0.1, [0.1]), (0.1, [])])
def test_nothing_is_printed_as_an_interval_that_is_not_one(value, interval):
    from rcgrpo_tasks.evaluation.formats import ci, num

    assert ci(value, interval) == "n/a"
    assert ci(0.25, [0.125, 0.5]) == "+0.250 [+0.125, +0.500]" and ci(25.0, (12.5, 50.0), ".1f") == "25.0 [12.5, 50.0]"
    assert num(None) == num(float("nan")) == "n/a" and num(0.5, ".2f") == "0.50"
    # a point is not an interval: a bootstrap of equal values prints the value alone, never "[+0.000, +0.000]"
    assert ci(0.0, [0.0, 0.0]) == "+0.000 [no spread: no interval]" and "[+0.000, +0.000]" not in ci(0.0, (0.0, 0.0))
