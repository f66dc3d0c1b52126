"""`rcgrpo score`: BFCL result files in, verdicts + official accuracy summary out, bad lines reported."""

import json
import subprocess
import sys

from helpers import get_entry


def _run(*args):
    return subprocess.run([sys.executable, "-m", "rcgrpo_tasks.cli", "score", *map(str, args)],
                          capture_output=True, text=True)


def _gold(entry_id):
    return [[list(t)] if t else [] for t in get_entry(entry_id).ground_truth]


def test_scores_file_with_bad_lines_and_reports_each(tmp_path):
    results = tmp_path / "results.jsonl"
    wrong = _gold("multi_turn_miss_param_3")
    wrong[0] = []
    lines = [
        json.dumps({"id": "multi_turn_base_0", "result": _gold("multi_turn_base_0")}),
        json.dumps({"id": "multi_turn_base_1", "result": _gold("multi_turn_base_1")[:-1]}),
        "{not json",
        json.dumps({"id": "multi_turn_nope_1", "result": []}),
        json.dumps({"id": "multi_turn_miss_param_3", "result": wrong}),
        json.dumps({"result": []}),
    ]
    results.write_text("\n".join(lines) + "\n")
    out, summary = tmp_path / "verdicts.jsonl", tmp_path / "summary.json"
    r = _run(results, "--output", out, "--summary", summary)
    assert r.returncode == 1
    assert f"{results}:3: invalid JSON" in r.stderr
    assert f"{results}:4: unknown entry id 'multi_turn_nope_1'" in r.stderr
    assert f"{results}:6: missing string field 'id'" in r.stderr
    verdicts = {v["id"]: v for v in map(json.loads, out.read_text().splitlines())}
    assert verdicts["multi_turn_base_0"]["valid"] is True
    assert verdicts["multi_turn_base_1"]["error_type"] == "multi_turn:force_terminated"
    assert verdicts["multi_turn_miss_param_3"]["valid"] is False
    s = json.loads(summary.read_text())
    assert s["per_category"]["base"]["accuracy"] == 0.5 and s["per_category"]["miss_param"]["accuracy"] == 0.0
    assert s["accuracy"] == 0.25  # mean of categories, as the official leaderboard
    assert "overall" in r.stdout


def test_missing_file_is_a_clear_error(tmp_path):
    r = _run(tmp_path / "nope.jsonl", "--output", tmp_path / "v.jsonl")
    assert r.returncode == 2 and "file not found" in r.stderr and not (tmp_path / "v.jsonl").exists()


def test_one_hostile_line_never_loses_the_good_ones(tmp_path):
    """A 5,000-deep `[[[...]]]` line (RecursionError inside json) and an invalid UTF-8 line are reported
    with file:line; the good lines around them are scored and written."""
    results = tmp_path / "results.jsonl"
    good = [json.dumps({"id": f"multi_turn_base_{i}", "result": _gold(f"multi_turn_base_{i}")}).encode()
            for i in range(2)]
    results.write_bytes(b"\n".join([good[0], b"[" * 5000 + b"]" * 5000, b'{"id": "\xff"}', good[1]]) + b"\n")
    out = tmp_path / "verdicts.jsonl"
    r = _run(results, "--output", out)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{results}:2: invalid JSON (nested too deeply)" in r.stderr
    assert f"{results}:3: invalid UTF-8" in r.stderr
    assert "2 line(s) could not be scored; 2 scored" in r.stderr
    assert [v["id"] for v in map(json.loads, out.read_text().splitlines())] == ["multi_turn_base_0",
                                                                                  "multi_turn_base_1"]


def test_unwritable_output_exits_2_naming_it(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"id": "multi_turn_base_0", "result": _gold("multi_turn_base_0")}) + "\n")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    r = _run(results, "--output", blocker / "v.jsonl", "--summary", tmp_path / "s.json")
    assert r.returncode == 2 and f"cannot write {blocker}/v.jsonl" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s.json").exists()  # the summary is never published without the verdicts
