"""bench/rctp_design.py's content-premise candidate: a design's `label.<key>` overrides reach params
`label_rewards` (the RCTP set it builds with the pipeline's label-rewards command), the rest its RCTP variant,
and the design table states q by the low side's failure kind (checked without running a model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("rctp_design", REPO / "bench" / "rctp_design.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_design_builds_its_own_set_and_the_table_splits_q_by_failure_kind(tmp_path, monkeypatch):
    bench = _bench()
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    name, data, overrides = bench.parse_design("wrong_call:label.failures=wrong_call,label.base_failures=false,"
                                               "unlikelihood=1")
    assert (name, data) == ("wrong_call", None)
    params = bench.design_params(base, overrides, ["controllability.n_entries=60"])
    assert params["label_rewards"]["failures"] == "wrong_call" and params["label_rewards"]["base_failures"] is False
    assert params["sft"]["variants"]["rctp"]["unlikelihood"] == 1 and "label.failures" not in params["sft"]["variants"]["rctp"]
    assert params["controllability"]["n_entries"] == 60
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda argv, **k: calls.append(argv))
    path = bench.build_set(name, overrides, base, [], tmp_path)
    assert path == str(tmp_path / "wrong_call" / "rctp.jsonl") and calls[0][:2] == ["rcgrpo", "label-rewards"]
    written = yaml.safe_load((tmp_path / "wrong_call-label.yaml").read_text())
    assert written["label_rewards"]["failures"] == "wrong_call"
    rows = [{"design": f"wrong_call-s{s}", "data": path, "q": q, "q_ci": [q - 0.1, q + 0.1], "sampled_high": 0.25,
             "sampled_gap": 0.1, "q_by_kind": {"no_call": 0.0, "wrong_function": q - 0.05, "wrong_arguments": 0.05}}
            for s, q in ((0, 0.2), (1, 0.1))]
    table = bench.table(rows, 0.3, 0.2625)
    assert "| wrong_call | wrong_call/rctp.jsonl | 0.20 [0.10, 0.30], 0.10 [0.00, 0.20] | 0.10 | 0.00 / 0.10 / 0.05 |" in table
    assert "| missed | missed |" in table  # q < 0.3 in a seed; R|high below the bar
