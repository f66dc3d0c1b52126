"""validate_trajectories: the GX gate passes a real generated set and fails each deliberately broken one,
naming the expectation, while nothing downstream (passed.json, label_rewards datasets) is written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from helpers import config_from_params
from test_generate_trajectories import multi_turn_config, write_inputs

from rcgrpo_tasks.data.dataset import generate
from rcgrpo_tasks.data.gate import PASSED_FILE, RESULT_FILE, ValidationFailed
from rcgrpo_tasks.data.labels import LabelConfig, labelled
from rcgrpo_tasks.data.quality import ValidateConfig, validate
from rcgrpo_tasks.env.multi_turn.entries import load_entries
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.ops.inputs import InputError

GEN = multi_turn_config(policy_entries=0)
PROMPT = config_from_params(PromptConfig, "prompt", system_prompt="bfcl")
CFG = config_from_params(ValidateConfig, "validate_trajectories", data_docs=False)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_model_dir):
    """A real generated set: 6 train entries (experts + verified near-misses), 4 held-out ids."""
    tmp = tmp_path_factory.mktemp("validate")
    entries_path, split = write_inputs(tmp, load_entries()[::50], n_train=6, n_test=4)
    rows, _ = generate(GEN, PROMPT, entries_path, split, tiny_model_dir)
    return {"rows": [t.to_json() for t in rows], "split": split, "model_dir": tiny_model_dir,
            "test_ids": json.loads(split.read_text())["test"]}


def _run(tmp_path, dataset, rows, cfg=CFG):
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "validation"
    metrics, fails, text = validate(cfg, GEN, PROMPT, path, dataset["split"], dataset["model_dir"], out,
                                    docs_dir=tmp_path / "docs")
    return path, out, metrics, fails, text


def test_generated_set_passes(tmp_path, dataset):
    path, out, metrics, fails, text = _run(tmp_path, dataset, dataset["rows"],
                                           config_from_params(ValidateConfig, "validate_trajectories", data_docs=True))
    assert fails == [] and text == "" and metrics["passed"] is True
    assert metrics["n_rows"] == len(dataset["rows"]) and metrics["success_fraction"] == 0.5
    assert json.loads((out / PASSED_FILE).read_text())["n_rows"] == len(dataset["rows"])
    result = json.loads((out / RESULT_FILE).read_text())
    assert result["success"] is True and len(result["results"]) == metrics["n_expectations"] >= 20
    assert (tmp_path / "docs" / "index.html").is_file() and not (out / "data_docs").exists()


def test_the_gate_output_is_a_function_of_its_input(tmp_path, dataset):
    """No run ids or times in the published result: rerunning the gate on the same file changes no byte,
    so no downstream stage reruns."""
    path, out, *_ = _run(tmp_path, dataset, dataset["rows"])
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    _run(tmp_path, dataset, dataset["rows"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    def keys(obj):
        if isinstance(obj, dict):
            return set(obj) | {k for v in obj.values() for k in keys(v)}
        return {k for v in obj for k in keys(v)} if isinstance(obj, list) else set()

    assert not keys(json.loads(first[RESULT_FILE])) & {"validation_time", "run_id", "id", "validation_id"}


def _first(rows, source):
    return next(r for r in rows if r["provenance"]["source"] == source)


def _null_entry(rows, d):
    rows[0]["entry_id"] = None


def _wrong_reward(rows, d):
    _first(rows, "near_miss")["provenance"]["reward"] = 0.5


def _leak(rows, d):
    rows[0]["entry_id"] = d["test_ids"][0]


def _unknown_entry(rows, d):
    for r in rows:  # every row of one entry moved to an id the split does not know
        if r["entry_id"] == rows[0]["entry_id"]:
            r["entry_id"] = r["id"] = "multi_turn_base_99999"


def _too_long(rows, d):
    r = rows[0]
    extra = 9000 - len(r["token_ids"])
    r["token_ids"] += [0] * extra
    r["completion_mask"] += [0] * extra
    r["logprobs"] += [0.0] * extra


def _unbalanced(rows, d):
    keep = [r for r in rows if r["provenance"]["reward"] == 1.0] + [_first(rows, "near_miss")]
    rows[:] = keep


def _duplicate_id(rows, d):
    rows[1]["trajectory_id"] = rows[0]["trajectory_id"]


def _bad_source(rows, d):
    rows[0]["provenance"]["source"] = "oracle"


def _bad_kind(rows, d):
    rows[0]["provenance"]["kind"] = "teleport"


def _no_assistant(rows, d):
    rows[0]["messages"] = [m for m in rows[0]["messages"] if m["role"] != "assistant"]


def _unparsable(rows, d):
    rows[0]["completion_mask"] = rows[0]["completion_mask"][:-1]


def _unknown_field(rows, d):
    rows[0]["colour"] = "blue"


def _expert_failing(rows, d):
    r = _first(rows, "expert")
    r["provenance"]["reward"] = 0.0
    r["score"]["paper_reward"] = 0.0


def _bad_partial(rows, d):
    rows[0]["score"]["partial_credit"] = 1.5


def _other_task(rows, d):
    rows[0]["provenance"]["task"] = "single_turn"  # a stale file of the other task


BROKEN = [
    ("not_null:entry_id", _null_entry),
    ("reward_values", _wrong_reward),
    ("no_test_leakage", _leak),
    ("known_entry_id", _unknown_entry),
    ("token_length", _too_long),
    ("success_balance", _unbalanced),
    ("unique_trajectory_id", _duplicate_id),
    ("provenance_source", _bad_source),
    ("provenance_kind", _bad_kind),
    ("has_assistant_message", _no_assistant),
    ("parses", _unparsable),
    ("schema", _unknown_field),
    ("label_consistent", _expert_failing),
    ("partial_credit_range", _bad_partial),
    ("task", _other_task),
]


@pytest.mark.parametrize("check,breaker", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_set_fails_naming_expectation(tmp_path, dataset, check, breaker):
    rows = copy.deepcopy(dataset["rows"])
    breaker(rows, dataset)
    path, out, metrics, fails, text = _run(tmp_path, dataset, rows)
    assert metrics["passed"] is False and check in metrics["failed_checks"]
    assert check in text and "row" in text
    failed = next(f for f in fails if f["check"] == check)
    if failed["unexpected_count"] is not None:
        assert failed["unexpected_count"] >= 1 and failed["trajectory_ids"]
    # The full result is written, the pass stamp is not, and label_rewards refuses the set.
    assert json.loads((out / RESULT_FILE).read_text())["success"] is False
    assert not (out / PASSED_FILE).exists()
    for name in ("sft", "rctp"):
        with pytest.raises(ValidationFailed, match="has not passed"):
            labelled(name, config_from_params(LabelConfig, "label_rewards", count_tokens=False), GEN, path, out, dataset["model_dir"])


def test_stale_pass_does_not_cover_a_changed_file(tmp_path, dataset):
    path, out, metrics, _, _ = _run(tmp_path, dataset, dataset["rows"])
    assert metrics["passed"]
    path.write_text(path.read_text() + "\n")  # any byte change
    with pytest.raises(ValidationFailed, match="changed since"):
        labelled("sft", config_from_params(LabelConfig, "label_rewards", count_tokens=False), GEN, path, out, dataset["model_dir"])


def test_corrupt_line_names_file_and_line(tmp_path, dataset):
    path = tmp_path / "trajectories.jsonl"
    lines = [json.dumps(r) for r in dataset["rows"][:3]]
    lines[2] = lines[2][:-10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"trajectories\.jsonl:3"):
        validate(CFG, GEN, PROMPT, path, dataset["split"], dataset["model_dir"], tmp_path / "validation")
    assert not (tmp_path / "validation").exists()


def test_folder_and_metrics_appear_together_or_not_at_all(tmp_path, dataset):
    """An unwritable metrics path (its parent is a file) leaves neither the gate's folder nor the metrics;
    the error names the metrics path. A writable one gets both, with the same record."""
    from rcgrpo_tasks.ops.outputs import OutputError

    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in dataset["rows"]))
    (tmp_path / "afile").write_text("x")
    bad, out = tmp_path / "afile" / "m.json", tmp_path / "validation"
    with pytest.raises((OutputError, OSError), match="m.json"):
        validate(CFG, GEN, PROMPT, path, dataset["split"], dataset["model_dir"], out, metrics_out=bad)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "trajectories.jsonl"]
    good = tmp_path / "metrics" / "m.json"
    record, fails, _ = validate(CFG, GEN, PROMPT, path, dataset["split"], dataset["model_dir"], out, metrics_out=good)
    assert fails == [] and json.loads(good.read_text()) == record and (out / PASSED_FILE).is_file()


def test_a_bad_split_or_model_is_refused_before_any_run(tmp_path, monkeypatch):
    """As the other stages: bad `--split` / `--model-dir` exit 2 naming the file, before an MLflow run opens."""
    from typer.testing import CliRunner

    from rcgrpo_tasks.ops import tracking
    from rcgrpo_tasks.stages import validate_trajectories as stage

    def no_run(*args, **kwargs):
        raise AssertionError("an MLflow run was opened")

    monkeypatch.setattr(tracking, "published_run", no_run)
    split, model = tmp_path / "split.json", tmp_path / "model"
    split.write_text('{"train": [], "test": [],}')
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 64}')
    args = ["--params", str(Path(__file__).parents[1] / "params.yaml"), "--trajectories", str(tmp_path / "t.jsonl"),
            "--split", str(split), "--model-dir", str(model),
            "--out-dir", str(tmp_path / "v"), "--metrics", str(tmp_path / "m.json")]
    res = CliRunner().invoke(stage.app, args)
    assert res.exit_code == 2 and f"{split}:1: invalid JSON at column 26" in res.output
    split.write_text('{"train": [], "test": []}')
    (model / "config.json").unlink()
    res = CliRunner().invoke(stage.app, args)
    assert res.exit_code == 2 and f"{model / 'config.json'}: file not found" in res.output
    assert not (tmp_path / "v").exists() and not (tmp_path / "m.json").exists()


def test_the_gate_run_is_named_after_the_stage_it_runs_in(monkeypatch):
    from rcgrpo_tasks.ops import tracking
    from rcgrpo_tasks.stages.validate_trajectories import STAGE, run_variant

    monkeypatch.setenv("DVC_STAGE", "sample_policy")
    assert tracking.run_name(STAGE, run_variant()) == "validate_trajectories@sample_policy"
    monkeypatch.setenv("DVC_STAGE", "validate_trajectories")
    assert tracking.run_name(STAGE, run_variant()) == "validate_trajectories"
    monkeypatch.delenv("DVC_STAGE")
    assert run_variant() is None


def test_an_rl_prompt_in_a_fine_tuning_set_is_refused_and_rls_own_samples_pass(tmp_path, dataset):
    """RL learns on prompts no fine-tuning set holds: a train-side set with an RL prompt fails `no_rl_leakage`;
    the samples of RL's prompts pass the gate on the rl side (`--side rl`), and fail it on the train side."""
    rows = copy.deepcopy(dataset["rows"])
    split = json.loads(dataset["split"].read_text())
    moved = rows[0]["entry_id"]
    split = {**split, "train": [i for i in split["train"] if i != moved], "rl": [moved]}
    path = tmp_path / "split.json"
    path.write_text(json.dumps(split))
    rl_rows = [r for r in rows if r["entry_id"] == moved]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rl_rows))
    cfg = config_from_params(ValidateConfig, "validate_trajectories", data_docs=False, min_rows=1)
    metrics, *_ = validate(cfg, GEN, PROMPT, tmp_path / "t.jsonl", path, dataset["model_dir"], tmp_path / "v1")
    assert "no_rl_leakage" in metrics["failed_checks"]
    metrics, *_ = validate(cfg, GEN, PROMPT, tmp_path / "rl.jsonl", path, dataset["model_dir"], tmp_path / "v2",
                           balance=False, side="rl")
    assert metrics["passed"], metrics["failed_checks"]
    metrics, *_ = validate(cfg, GEN, PROMPT, tmp_path / "rl.jsonl", path, dataset["model_dir"], tmp_path / "v3",
                           balance=False)
    assert {"no_rl_leakage", "known_entry_id"} <= set(metrics["failed_checks"])
