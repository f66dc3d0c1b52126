"""The dev sweep (ops.sweep runs it, evaluation.design judges it): its spec is checked before anything runs, candidates are params files the stages
load, every evaluation reads the dev side, and the design table is built from the report stage's own JSON."""

import json

import pytest
import yaml

from rcgrpo_tasks.evaluation import design
from rcgrpo_tasks.ops import sweep
from rcgrpo_tasks.ops.config import ConfigError


def _spec(tmp_path, body: dict):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.mark.parametrize("body,needle", [
    ({"cells": ["rctp-ppo"], "candidates": {"a": {}}}, "cells"),
    ({"cells": [], "candidates": {"a": {}}}, "cells"),
    ({"cells": ["rctp-grpo"], "candidates": {}}, "candidates"),
    ({"cells": ["rctp-grpo"], "candidates": {"a/b": {}}}, "folder-safe"),
    ({"cells": ["rctp-grpo"], "candidates": {"a": {}}, "extra": 1}, "unknown key"),
])
def test_a_bad_spec_names_its_file_and_field(tmp_path, body, needle):
    with pytest.raises(ConfigError, match=needle):
        sweep.read_spec(_spec(tmp_path, body))


def test_the_committed_spec_loads_into_the_rl_stage_config():
    from rcgrpo_tasks.ops.config import from_dict, read_params
    from rcgrpo_tasks.train.grpo import RLConfig

    spec = sweep.read_spec(sweep.Path("configs/sweeps/rl-dev.yaml"))
    base = read_params("params.yaml")
    for name in spec.candidates:
        params = sweep.candidate_params(base, spec, name, sweep.Path("spec.yaml"))
        from_dict(RLConfig, params["rl"], where=f"candidate {name}")
        assert params["evaluate"]["margin"] is False


def test_candidate_params_merge_common_then_own_and_refuse_unknown_sections(tmp_path):
    spec = sweep.Spec(("rctp-grpo",), {"rl": {"max_steps": 3}}, {"a": {"rl": {"learning_rate": 1.0}}, "b": {"nope": {}}})
    base = {"rl": {"max_steps": 10, "learning_rate": 0.1, "beta": 0.1}, "evaluate": {}}
    assert sweep.candidate_params(base, spec, "a", tmp_path)["rl"] == {"max_steps": 3, "learning_rate": 1.0, "beta": 0.1}
    assert base["rl"]["max_steps"] == 10
    with pytest.raises(ConfigError, match="nope"):
        sweep.candidate_params(base, spec, "b", tmp_path)


def test_commands_are_the_stages_own_and_evaluate_reads_the_dev_side(tmp_path):
    rl = sweep.rl_command(tmp_path / "p.yaml", "rctp-rc_grpo", tmp_path / "c")
    assert rl[:2] == ["rcgrpo", "rl"] and rl[rl.index("--algo") + 1] == "rc_grpo"
    assert rl[rl.index("--adapter-dir") + 1] == "models/sft/rctp"
    ev = sweep.evaluate_command(tmp_path / "p.yaml", "m", "", sweep.cell_token("rctp-grpo", "<|h|>"), tmp_path / "e", "x")
    assert ev[ev.index("--side") + 1] == "dev" and ev[ev.index("--reward-token") + 1] == "<|h|>"
    assert sweep.cell_token("sft-grpo", "<|h|>") == "" and sweep.cell_token("sft-rc_grpo", "<|h|>") == "<|h|>"


def test_the_design_table_reads_each_candidate_s_report(tmp_path):
    spec = sweep.Spec(("rctp-grpo", "rctp-rc_grpo"), {}, {"a": {}, "b": {"rl": {"learning_rate": 1.0}}})
    row = {"overall": {"accuracy": 25.0}, "n": 60, "vs_init": {"diff": 5.0, "ci": [1.7, 8.3]},
           "rl_probe": {"change": {"mean": 0.25, "ci_low": 0.1, "ci_high": 0.4}}}
    zero = {"groups": 40, "both": 10, "only_grpo": 9, "only_rc_grpo": 1, "grpo": 0.475, "rc_grpo": 0.275,
            "mcnemar_p": 0.021}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "report.json").write_text(json.dumps(
        {"rows": {"rctp-grpo": row, "rctp-rc_grpo": row}, "rc_grpo_vs_grpo": {"rctp": {"zero_std_paired": zero}}}))
    (tmp_path / "timings.json").write_text(json.dumps({"a/rctp-grpo": {"status": "ok", "seconds": 12.0},
                                                       "b/rctp-grpo": {"status": "failed (exit 2)", "seconds": 3.0}}))
    rows = design.design_rows(tmp_path, spec)
    assert [(r["candidate"], r["cell"]) for r in rows] == [("a", "rctp-grpo"), ("a", "rctp-rc_grpo"),
                                                           ("b", "rctp-grpo"), ("b", "rctp-rc_grpo")]
    assert rows[1]["rc_grpo_vs_grpo_zero_std"] == zero and rows[0]["rc_grpo_vs_grpo_zero_std"] is None
    md = design.design_markdown(rows)
    assert "| a | rctp-grpo | 25.0 (n=60) | +5.0 [+1.7, +8.3] | +0.250 [+0.100, +0.400] |  | 12 | ok |" in md
    assert "0.28 vs 0.47 over 40 groups (1 vs 9, p = 0.021)" in md
    assert "| b | rctp-grpo | n/a | n/a | n/a |  | 3 | failed (exit 2) |" in md
    assert "| b | rctp-rc_grpo | n/a | n/a | n/a |  | n/a | not run |" in md


def test_a_failing_chain_stops_there_and_is_recorded(tmp_path):
    import os
    import sys

    ok = [sys.executable, "-c", "print('one')"]
    bad = [sys.executable, "-c", "import sys; sys.exit(3)"]
    never = [sys.executable, "-c", f"open({str(tmp_path / 'never')!r}, 'w')"]
    rc, secs = sweep.run_chain([ok, bad, never], tmp_path / "log", dict(os.environ))
    assert rc == 3 and secs >= 0 and "one" in (tmp_path / "log").read_text()
    assert not (tmp_path / "never").exists()


def _eval(folder, correct: dict):
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(
        json.dumps({"id": i, "valid": bool(v), "category": "simple_python", "task": "single_turn"}) + "\n"
        for i, v in correct.items()))


def test_replicates_pool_per_entry_and_compare_paired_with_the_init_and_the_default(tmp_path):
    """Two runs of one spec: a candidate's dev entries are averaged over cells x runs, then compared with the
    init and the default entry by entry; the spread says how far the runs are apart."""
    ids = [f"simple_python_{i}" for i in range(10)]
    spec = sweep.Spec(("rctp-grpo", "rctp-rc_grpo"), {}, {"default": {}, "other": {}})
    for run, default_right in (("A", 4), ("B", 2)):
        _eval(tmp_path / run / "init" / "rctp", {i: k < 5 for k, i in enumerate(ids)})
        for cell in spec.cells:
            _eval(tmp_path / run / "default" / cell / "eval", {i: k < default_right for k, i in enumerate(ids)})
            _eval(tmp_path / run / "other" / cell / "eval", {i: k < 5 for k, i in enumerate(ids)})
    rows = {r["candidate"]: r for r in design.pooled_rows([tmp_path / "A", tmp_path / "B"], spec)}
    assert "spread over cell runs" in design.pooled_markdown(list(rows.values()), "default")
    assert rows["default"]["runs"] == 4 and rows["default"]["dev_accuracy"] == pytest.approx(30.0)
    assert rows["default"]["spread"] == pytest.approx(20.0) and "vs_baseline" not in rows["default"]
    assert rows["default"]["vs_init"]["diff"] == pytest.approx(-20.0) and rows["default"]["vs_init"]["n"] == 10
    assert rows["other"]["vs_init"]["diff"] == pytest.approx(0.0) and rows["other"]["spread"] == 0.0
    assert rows["other"]["vs_baseline"]["diff"] == pytest.approx(20.0)
    lo, hi = rows["other"]["vs_baseline"]["ci"]
    assert 0.0 <= lo < 20.0 < hi
    md = design.pooled_markdown(list(rows.values()), "default")
    assert "| other | 4 | 50.0 | 0.0 | +0.0 [+0.0, +0.0] | +20.0 [" in md


def test_a_candidate_with_an_unknown_section_fails_before_anything_is_written(tmp_path):
    spec = _spec(tmp_path, {"cells": ["rctp-grpo"], "candidates": {"good": {"rl": {"max_steps": 1}},
                                                                     "bad": {"nope": {}}}})
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"rl": {"max_steps": 10}, "label_rewards": {"tokens": ["<|l|>", "<|h|>"]}}))
    with pytest.raises(ConfigError, match="candidates.bad"):
        sweep.run_sweep(spec, tmp_path / "out", params)
    assert not (tmp_path / "out").exists()
