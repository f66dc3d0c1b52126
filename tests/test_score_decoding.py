"""`rcgrpo score` on result files as `bfcl generate` writes them (env.results): prompt-mode text and
function-calling objects decoded by bfcl-eval's own decoders, text replies and inference errors handled as
`bfcl evaluate` handles them; every verdict checked against bfcl-eval's evaluation path on the same steps."""

from __future__ import annotations

import json

import pytest
from bfcl_reference import official_check_raw
from helpers import get_entry
from typer.testing import CliRunner

from rcgrpo_tasks.env.multi_turn import decode
from rcgrpo_tasks.env.multi_turn.calls import parse_call_string
from rcgrpo_tasks.stages import score

IDS = ["multi_turn_base_0", "multi_turn_base_11", "multi_turn_miss_param_3", "multi_turn_long_context_2",
       "multi_turn_base_30"]


def _turns(entry_id: str, wrong: bool) -> list[list[list[str]]]:
    """The gold calls, one step per turn; `wrong`: the last turn's calls dropped (a failing answer)."""
    gold = [list(t) for t in get_entry(entry_id).ground_truth]
    if wrong:
        gold[-1] = []
    return [[calls] for calls in gold]


def _as_prompt(turns):
    out = []
    for t, turn in enumerate(turns):
        steps = [f"[{', '.join(calls)}]" for calls in turn]
        if t == 0:
            steps.insert(0, "Let me look at the files first.")  # a text reply: dropped, as bfcl-eval does
        out.append(steps)
    return out


def _as_fc(turns):
    out = []
    for t, turn in enumerate(turns):
        steps = []
        for calls in turn:
            parsed = [parse_call_string(c) for c in calls]
            steps.append([{c.name: json.dumps(c.kwargs)} for c in parsed] if parsed else "Nothing to do.")
        if t == 0:
            steps.append(["Done with this part."])  # a one-element text list: fails to decode, dropped
        out.append(steps)
    return out


def _rows(shape):
    rows = []
    for i, eid in enumerate(IDS):
        turns = _turns(eid, wrong=i % 2 == 1)
        rows.append({"id": eid, "result": shape(turns)})
    rows.append({"id": "multi_turn_base_1", "result": "Error during inference: the server timed out"})
    return rows


def _bfcl_decoder(decoding):
    from bfcl_eval.model_handler.utils import convert_to_function_call, default_decode_execute_prompting

    return default_decode_execute_prompting if decoding == "prompt" else convert_to_function_call


@pytest.mark.parametrize("decoding, shape", [("prompt", _as_prompt), ("fc", _as_fc), ("calls", lambda t: t)])
def test_each_shape_is_detected_and_scored_as_bfcl_evaluate_scores_it(tmp_path, decoding, shape):
    rows = _rows(shape)
    path, out, summary = tmp_path / "result.json", tmp_path / "verdicts.jsonl", tmp_path / "summary.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(score.app, [str(path), "-o", str(out), "--summary", str(summary)])
    assert res.exit_code == 0, res.output
    assert f"decoding: {decoding} (detected:" in res.output
    assert json.loads(summary.read_text())["decoding"] == decoding
    verdicts = {v["id"]: v for v in map(json.loads, out.read_text().splitlines())}
    decode = _bfcl_decoder(decoding) if decoding != "calls" else (lambda step: step)
    for row in rows:
        entry = get_entry(row["id"])
        assert (verdicts[row["id"]]["valid"], verdicts[row["id"]]["error_type"]) == \
            official_check_raw(entry, row["result"], decode), row["id"]
    # gold answers pass, wrong ones fail (base_0's gold `sort('final_report.pdf')` passes only as call strings:
    # bfcl-eval's text and FC decoders keep keyword arguments only, and agreement keeps that)
    assert verdicts["multi_turn_base_30"]["valid"] and verdicts["multi_turn_miss_param_3"]["valid"]
    assert not verdicts["multi_turn_base_11"]["valid"]
    assert verdicts["multi_turn_base_0"]["valid"] is (decoding == "calls")
    assert verdicts["multi_turn_base_1"]["error_type"] == "multi_turn:inference_error"
    dropped = {row["id"]: _undecodable(row["result"], decode) for row in rows}
    assert {i: v["undecodable_steps"] for i, v in verdicts.items()} == dropped
    assert json.loads(summary.read_text())["undecodable_steps"] == sum(dropped.values())
    assert (sum(dropped.values()) > 0) is (decoding != "calls")  # text replies in the prompt and fc files
    assert f"undecodable: {sum(dropped.values())} step(s) did not decode" in res.output


def _undecodable(result, decode) -> int:
    """Steps bfcl-eval's decoder fails on (its runner drops them)."""
    if not isinstance(result, list):
        return 0
    n = 0
    for step in (s for turn in result for s in turn):
        try:
            decode(step)
        except Exception:
            n += 1
    return n


def test_rows_needing_different_decodings_are_refused_naming_the_first_of_each(tmp_path):
    rows = [{"id": IDS[0], "result": _turns(IDS[0], False)}, {"id": IDS[1], "result": _as_prompt(_turns(IDS[1], False))},
            {"id": IDS[2], "result": _as_fc(_turns(IDS[2], False))}]
    path, out = tmp_path / "result.json", tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(score.app, [str(path), "-o", str(out)])
    assert res.exit_code == 2 and not out.exists()
    assert f"{path}:1 ({IDS[0]}) holds lists of call strings" in res.output
    assert f"{path}:2 ({IDS[1]}) holds model text with calls" in res.output
    assert f"{path}:3 ({IDS[2]}) holds function-calling" in res.output
    res = CliRunner().invoke(score.app, [str(path), "-o", str(out), "--decoding", "calls"])
    assert res.exit_code == 0 and len(out.read_text().splitlines()) == 3


def test_rows_whose_steps_are_all_prose_need_no_decoding_of_their_own(tmp_path):
    """A function-calling model that only replied in text, beside rows with calls: not a mixed file."""
    rows = [{"id": IDS[0], "result": _as_fc(_turns(IDS[0], False))},
            {"id": IDS[1], "result": [["I could not do that."] for _ in _turns(IDS[1], False)]}]
    path, out = tmp_path / "result.json", tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(score.app, [str(path), "-o", str(out)])
    assert res.exit_code == 0 and "decoding: fc (detected:" in res.output


def test_a_forced_decoding_overrides_detection_and_a_wrong_one_drops_every_step(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"id": IDS[0], "result": _as_fc(_turns(IDS[0], False))}) + "\n")
    res = CliRunner().invoke(score.app, [str(path), "-o", str(tmp_path / "v.jsonl"), "--decoding", "prompt"])
    assert res.exit_code == 0 and "decoding: prompt (as asked)" in res.output
    verdict = json.loads((tmp_path / "v.jsonl").read_text())
    assert not verdict["valid"] and verdict["error_type"] == "multi_turn:empty_turn_model_response"
    res = CliRunner().invoke(score.app, [str(path), "-o", str(tmp_path / "v.jsonl"), "--decoding", "xml"])
    assert res.exit_code == 2 and "--decoding 'xml'" in res.output


def test_an_empty_file_is_an_error_not_an_accuracy_of_zero(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    res = CliRunner().invoke(score.app, [str(path), "-o", str(tmp_path / "v.jsonl")])
    assert res.exit_code == 2 and "no result rows" in res.output and not (tmp_path / "v.jsonl").exists()


def test_detection_rules():
    assert decode.detect([[[["a()"]]]])[0] == "calls"
    assert decode.detect([[["[a()]"]], "Error during inference: x"])[0] == "prompt"
    assert decode.detect([[["text"], [{"a": "{}"}]]])[0] == "fc"
    assert decode.decode_result("Error during inference: x", "fc") == ("Error during inference: x", 0)
    assert decode.decode_result([["[a(x=1)]", "no calls here"], []], "prompt") == ([[["a(x=1)"]], []], 1)
