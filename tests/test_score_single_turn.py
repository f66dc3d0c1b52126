"""`rcgrpo score` on BFCL single-turn result files (prompt text, function-calling objects, call strings): every
verdict equal to bfcl-eval's decoder + AST checker on the same result; mixed tasks and mixed decodings refused
with nothing written; undecodable outputs counted; model text never run."""

from __future__ import annotations

import json

import pytest
from bfcl_ast_reference import official_check_decoded, official_fc_decode, official_verdict
from typer.testing import CliRunner

from rcgrpo_tasks.env.single_turn import entries as single_turn
from rcgrpo_tasks.env.single_turn import perturb as single_turn_perturb
from rcgrpo_tasks.stages import score

ENTRIES = {e.id: e for e in single_turn.load_entries(single_turn.CATEGORIES)}
IDS = ["simple_python_0", "simple_python_7", "multiple_3", "parallel_5", "parallel_multiple_2", "live_simple_0-0-0",
       "live_multiple_2-1-0", "live_parallel_1-0-1", "live_parallel_multiple_0-0-0"]


def _gold_text(entry_id: str) -> str:
    return "[" + ", ".join(single_turn_perturb.expert_calls(ENTRIES[entry_id])) + "]"


def _prompt_rows() -> list[dict]:
    rows = [{"id": eid, "result": _gold_text(eid)} for eid in IDS]
    rows[1]["result"] = "I cannot answer that without more information."  # prose
    rows[2]["result"] = rows[2]["result"].replace("rounding=0", "rounding=0 + 1")  # wrong value by arithmetic
    rows[3]["result"] = rows[3]["result"][:-2]  # malformed
    rows[4]["result"] = "Error during inference: the server timed out"
    return rows


def _fc_rows() -> list[dict]:
    rows = [{"id": eid, "result": [{n: json.dumps(a)} for c in single_turn_perturb.expert_answer(ENTRIES[eid])
                                   for n, a in c.items()]} for eid in IDS]
    rows[1]["result"] = "The answer is 42."  # a text reply
    rows[2]["result"] = [{next(iter(rows[2]["result"][0])): "{\"a\": "}]  # malformed JSON arguments
    rows[3]["result"] = rows[3]["result"][:1]  # a call missing
    return rows


def _calls_rows() -> list[dict]:
    rows = [{"id": eid, "result": [[single_turn_perturb.expert_calls(ENTRIES[eid])]]} for eid in IDS]
    rows[1]["result"] = [[]]  # an output that decoded to no call
    rows[3]["result"] = [[rows[3]["result"][0][0][:1]]]  # a parallel answer's first call only
    return rows


def _run(tmp_path, rows, *args, lines=None):
    path, out, summary = tmp_path / "result.json", tmp_path / "v.jsonl", tmp_path / "s.json"
    path.write_text("".join(lines or [json.dumps(r) + "\n" for r in rows]))
    res = CliRunner().invoke(score.app, [str(path), "-o", str(out), "--summary", str(summary), *args])
    verdicts = {v["id"]: v for v in map(json.loads, out.read_text().splitlines())} if out.exists() else None
    return res, verdicts, (json.loads(summary.read_text()) if summary.exists() else None), path


def _official(row, decoding):
    entry = ENTRIES[row["id"]]
    if decoding == "calls":
        result = "[" + ", ".join(c for turn in row["result"] for step in turn for c in step) + "]"
        return official_verdict(entry.functions, entry.possible_answer, entry.category, result)
    decode = official_fc_decode if decoding == "fc" else None
    return official_verdict(entry.functions, entry.possible_answer, entry.category, row["result"], decode=decode)


@pytest.mark.parametrize("decoding, make", [("prompt", _prompt_rows), ("fc", _fc_rows), ("calls", _calls_rows)])
def test_each_format_is_detected_and_judged_as_bfcl_eval_judges_it(tmp_path, decoding, make):
    rows = make()
    res, verdicts, summary, _ = _run(tmp_path, rows)
    assert res.exit_code == 0, res.output
    assert f"decoding: {decoding} (detected:" in res.output and summary["decoding"] == decoding
    assert summary["task"] == "single_turn"
    for row in rows:
        v = verdicts[row["id"]]
        assert (v["valid"], v["error_type"]) == _official(row, decoding), row["id"]
        assert v["paper_reward"] == float(v["valid"]) and 0.0 <= v["partial_credit"] <= 1.0
    assert verdicts["simple_python_0"]["valid"] and verdicts["live_parallel_multiple_0-0-0"]["valid"]
    assert not verdicts["simple_python_7"]["valid"]
    failed = sum(v["error_type"] == "ast_decoder:decoder_failed" for v in verdicts.values())
    assert summary["undecodable_outputs"] == failed == sum(v["undecodable_steps"] for v in verdicts.values())
    assert failed == {"prompt": 3, "fc": 2, "calls": 0}[decoding]
    assert f"undecodable: {failed} output(s) did not decode" in res.output
    per_cat = summary["per_category"]
    assert set(per_cat) == {ENTRIES[i].category for i in IDS}
    assert summary["accuracy"] == pytest.approx(sum(c["accuracy"] for c in per_cat.values()) / len(per_cat))


def test_partial_credit_counts_gold_calls_answered(tmp_path):
    eid = "parallel_5"
    calls = single_turn_perturb.expert_calls(ENTRIES[eid])
    res, verdicts, _, _ = _run(tmp_path, [{"id": eid, "result": "[" + calls[0] + "]"}])
    v = verdicts[eid]
    assert res.exit_code == 0 and not v["valid"]
    assert v["error_type"] == "parallel_function_checker_no_order:wrong_count"
    assert v["partial_credit"] == pytest.approx(1 / len(calls))


def test_mixed_decodings_are_refused_naming_a_row_of_each_unless_one_is_asked(tmp_path):
    rows = _prompt_rows()[:3] + _fc_rows()[3:]
    res, verdicts, summary, path = _run(tmp_path, rows)
    assert res.exit_code == 2 and verdicts is None and summary is None
    assert "rows need different decodings" in res.output
    assert f"{path}:1 (simple_python_0) holds model text with calls" in res.output
    assert f"{path}:4 (parallel_5) holds function-calling" in res.output
    res, verdicts, summary, _ = _run(tmp_path, rows, "--decoding", "fc")
    assert res.exit_code == 0 and "decoding: fc (as asked)" in res.output
    assert verdicts["simple_python_0"]["error_type"] == "ast_decoder:decoder_failed"  # text under fc decoding
    assert verdicts["live_simple_0-0-0"]["valid"]


def test_prose_rows_need_no_decoding_of_their_own(tmp_path):
    """A function-calling model's text reply (prose) sits in an fc file without making it mixed."""
    rows = _fc_rows()
    assert isinstance(rows[1]["result"], str)
    res, verdicts, _, _ = _run(tmp_path, rows)
    assert res.exit_code == 0 and "decoding: fc" in res.output


def test_mixed_tasks_are_refused_naming_a_row_of_each(tmp_path):
    gold_mt = [[list(t)] if t else [] for t in score.tasks.entries_by_id()["multi_turn_base_0"].ground_truth]
    rows = [{"id": "simple_python_0", "result": _gold_text("simple_python_0")},
            {"id": "multi_turn_base_0", "result": gold_mt}]
    res, verdicts, summary, path = _run(tmp_path, rows)
    assert res.exit_code == 2 and verdicts is None and summary is None
    assert f"{path}:1 (simple_python_0) is single_turn" in res.output
    assert f"{path}:2 (multi_turn_base_0) is multi_turn" in res.output


def test_bad_lines_are_reported_and_a_file_with_nothing_to_score_writes_nothing(tmp_path):
    rows = [{"id": "simple_python_0", "result": [[single_turn_perturb.expert_calls(ENTRIES["simple_python_0"])]]},
            {"id": "simple_python_99999", "result": "[]"}, {"id": "simple_python_1"},
            {"id": "simple_python_0", "result": "[]"}, {"id": "simple_python_2", "result": [["not", "nested"]]}]
    res, verdicts, _, path = _run(tmp_path, rows, "--decoding", "calls")
    assert res.exit_code == 1
    assert f"{path}:2: unknown entry id 'simple_python_99999'" in res.output
    assert f"{path}:3: missing field 'result' for simple_python_1" in res.output
    assert f"{path}:4: duplicate entry id 'simple_python_0'" in res.output
    assert f"{path}:5: result could not be scored (ValueError: a call-strings result is [[call strings]]" in res.output
    assert list(verdicts) == ["simple_python_0"] and verdicts["simple_python_0"]["valid"]
    only_bad = tmp_path / "only_bad"
    only_bad.mkdir()
    res, verdicts, summary, path = _run(only_bad, [{"id": "simple_python_99999", "result": "[]"}])
    assert res.exit_code == 2 and verdicts is None and summary is None
    assert f"{path}:1: unknown entry id" in res.output and "nothing written" in res.output


def test_non_text_results_in_prompt_mode_are_bfcl_evals_decoder_failures(tmp_path):
    rows = [{"id": "simple_python_0", "result": 42}, {"id": "simple_python_1", "result": None},
            {"id": "simple_python_2", "result": "[]"}]
    res, verdicts, summary, _ = _run(tmp_path, rows, "--decoding", "prompt")
    assert res.exit_code == 0
    for row in rows:
        assert (verdicts[row["id"]]["valid"], verdicts[row["id"]]["error_type"]) == _official(row, "prompt")
    assert summary["undecodable_outputs"] == 2


BLANK = ["", " ", "\n", " \t\n ", "\r\n", "``"]
NO_CALLS = {"prompt": BLANK, "fc": [""]}
"""Results bfcl-eval decodes to no call: `default_decode_ast_prompting` strips backticks, newlines and spaces and
parses `[...]` (whitespace it leaves is no token); a function-calling handler iterates the result (`""`: none)."""


@pytest.mark.parametrize("decoding", sorted(NO_CALLS))
def test_empty_and_whitespace_results_get_bfcl_evals_verdict_in_every_category(tmp_path, decoding):
    """bfcl-eval decodes them to `[]` and its checker judges that (`simple_function_checker:wrong_count`,
    `multiple_function_checker:wrong_count`, `parallel_function_checker_no_order:wrong_count`), not a decoder
    failure; a function-calling handler fails on whitespace (it iterates the text: `" ".keys()`)."""
    for i, blank in enumerate(NO_CALLS[decoding]):
        case = tmp_path / str(i)
        case.mkdir()
        rows = [{"id": eid, "result": blank} for eid in IDS]
        res, verdicts, summary, _ = _run(case, rows, "--decoding", decoding)
        assert res.exit_code == 0, res.output
        for eid in IDS:
            e = ENTRIES[eid]
            expected = official_check_decoded(e.functions, [], e.possible_answer, e.category)
            assert (verdicts[eid]["valid"], verdicts[eid]["error_type"]) == expected, (eid, blank)
            assert verdicts[eid]["undecodable_steps"] == 0
        assert summary["undecodable_outputs"] == 0
    if decoding == "prompt":  # `auto` takes a file of blank outputs as a prompt-mode model's
        res, verdicts, _, _ = _run(tmp_path, [{"id": eid, "result": ""} for eid in IDS])
        assert "decoding: prompt (detected:" in res.output and not any(v["valid"] for v in verdicts.values())
    res, verdicts, _, _ = _run(tmp_path, [{"id": eid, "result": " "} for eid in IDS], "--decoding", "fc")
    assert {v["error_type"] for v in verdicts.values()} == {"ast_decoder:decoder_failed"}
    with pytest.raises(AttributeError):  # the handler's own failure on whitespace, hence decoder_failed
        official_fc_decode(" ")


def test_underscore_to_dot(tmp_path):
    entry = next(e for e in ENTRIES.values() if e.category == "simple_python" and "." in e.functions[0]["name"])
    text = _gold_text(entry.id).replace(entry.functions[0]["name"], entry.functions[0]["name"].replace(".", "_"))
    rows = [{"id": entry.id, "result": text}]
    _, plain, _, _ = _run(tmp_path, rows)
    assert plain[entry.id]["error_type"] == "simple_function_checker:wrong_func_name"
    res, flagged, _, _ = _run(tmp_path, rows, "--underscore-to-dot")
    assert res.exit_code == 0 and flagged[entry.id]["valid"]
    assert official_verdict(entry.functions, entry.possible_answer, entry.category, text, True) == (True, None)


def test_underscore_to_dot_is_refused_for_multi_turn_files(tmp_path):
    res, verdicts, _, _ = _run(tmp_path, [{"id": "multi_turn_base_0", "result": [[["ls()"]]]}], "--underscore-to-dot")
    assert res.exit_code == 2 and verdicts is None and "function names have no dots" in res.output


def test_model_text_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    attack = f"[math.factorial(number=__import__('os').system('touch {marker}') + 1)]"
    rows = [{"id": "simple_python_0", "result": attack},
            {"id": "multi_turn_base_0", "result": [[attack]]}]
    for row in rows:
        path = tmp_path / f"{row['id']}.json"
        path.write_text(json.dumps(row) + "\n")
        res = CliRunner().invoke(score.app, [str(path), "-o", str(tmp_path / "v.jsonl"), "--decoding", "prompt"])
        assert res.exit_code == 0, res.output
        verdict = json.loads((tmp_path / "v.jsonl").read_text())
        assert not verdict["valid"] and verdict["undecodable_steps"] == 1
    assert not marker.exists()
