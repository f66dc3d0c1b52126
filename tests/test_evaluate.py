"""evaluate stage: end to end on the tiny model (metrics, results, report, plot, MLflow), bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from helpers import config_from_params, get_entry, write_params
from typer.testing import CliRunner

from rcgrpo_tasks.env.entries import stratified
from rcgrpo_tasks.env.multi_turn import entries as multi_turn
from rcgrpo_tasks.evaluation import accuracy as evaluate
from rcgrpo_tasks.ops.config import ConfigError, load_config
from rcgrpo_tasks.stages import evaluate as evaluate_stage

PARAMS = """prompt:
  protocol: paper
  system_prompt: bfcl
evaluate:
  limit: 4
  max_outputs: 2
  max_new_tokens: 4
  dtype: float32
  n_bootstrap: 50
  pass_samples: 2
rl:
  temperature: 0.7
  top_p: 1.0
"""


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    return make_workdir(tmp_path, monkeypatch)


def make_workdir(tmp_path, monkeypatch):
    """params, a held-out split of 8 multi_turn entries and a private MLflow store in `tmp_path`."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    write_params(tmp_path / "params.yaml", yaml.safe_load(PARAMS))
    test_ids = [f"multi_turn_{c}_{i}" for c in multi_turn.CATEGORIES for i in (1, 2)]
    (tmp_path / "split.json").write_text(json.dumps({"train": [], "test": test_ids}))
    return tmp_path


def _invoke(workdir, model, *extra):
    args = ["--model", str(model), "--out", str(workdir / "out"), "--split", str(workdir / "split.json"),
            "--params", str(workdir / "params.yaml"), *extra]
    return CliRunner().invoke(evaluate_stage.app, args)


def test_evaluate_end_to_end(workdir, tiny_model_dir):
    import mlflow

    res = _invoke(workdir, tiny_model_dir, "--name", "base", "--reward-token", "<|high_reward|>")
    assert res.exit_code == 0, res.output
    out = workdir / "out"
    assert {p.name for p in out.iterdir()} >= {"metrics.json", "results.jsonl", "trajectories.jsonl",
                                               "report.md", "accuracy.png", "accuracy.csv"}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n"] == 4 and set(metrics["categories"]) == set(multi_turn.CATEGORIES)  # stratified limit
    assert 0 <= metrics["accuracy"] <= 100 and len(metrics["overall"]["ci"]) == 2
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(set(r) >= {"id", "result", "valid", "partial_credit", "paper_reward"} for r in rows)
    assert all(r["reward_token"] == "<|high_reward|>" for r in rows)
    # pass@1: two answers per entry sampled at rl.temperature, their verdicts and share per entry
    assert all(len(r["pass_samples"]) == 2 and r["pass1"] == sum(r["pass_samples"]) / 2 for r in rows)
    assert metrics["pass_at_1"]["temperature"] == 0.7 and metrics["pass_at_1"]["samples"] == 2
    assert metrics["overall"]["pass1"]["accuracy"] == pytest.approx(100 * sum(r["pass1"] for r in rows) / 4)
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 4 and all(t["provenance"]["arm"] == "greedy" for t in trajs)  # the greedy answers
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert "| **overall** |" in (out / "report.md").read_text()
    # the report stage reads this folder as is
    from rcgrpo_tasks.evaluation.results_table import load_eval

    assert len(load_eval("base", out).entries) == 4
    # MLflow: params, metrics, per-entry table, report and plot
    client = mlflow.MlflowClient()
    run = client.search_runs([client.get_experiment_by_name("rcgrpo").experiment_id])[0]
    assert run.data.params["reward_token"] == "<|high_reward|>" and "accuracy" in run.data.metrics
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"per_entry.json", "report.md", "accuracy.png", "metrics.json"} <= names


def test_side_dev_scores_the_dev_entries_and_an_unknown_side_fails(workdir, tiny_model_dir):
    """The dev sweep scores candidates on the dev side; nothing else changes."""
    dev_ids = [f"multi_turn_{c}_{i}" for c in multi_turn.CATEGORIES for i in (5,)]
    split = json.loads((workdir / "split.json").read_text())
    (workdir / "split.json").write_text(json.dumps({**split, "dev": dev_ids}))
    res = _invoke(workdir, tiny_model_dir, "--side", "dev")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (workdir / "out" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(dev_ids)
    assert json.loads((workdir / "out" / "metrics.json").read_text())["settings"]["side"] == "dev"
    res = _invoke(workdir, tiny_model_dir, "--side", "train")
    assert res.exit_code != 0 and "--side must be test or dev" in res.output


@pytest.mark.parametrize("case", ["unknown_id", "missing_model", "bad_adapter", "bad_params"])
def test_bad_input_fails_clearly_without_outputs(workdir, tiny_model_dir, case):
    model, extra = tiny_model_dir, []
    if case == "unknown_id":
        (workdir / "split.json").write_text(json.dumps({"train": [], "test": ["multi_turn_base_9999"]}))
    elif case == "missing_model":
        model = workdir / "no_model"
    elif case == "bad_adapter":
        (workdir / "adapter").mkdir()
        (workdir / "adapter" / "adapter_config.json").write_text("{not json")
        extra = ["--adapter", str(workdir / "adapter")]
    else:
        write_params(workdir / "params.yaml", {"evaluate": {"max_stepz": 3}})
    res = _invoke(workdir, model, *extra)
    assert res.exit_code != 0
    text = res.output
    assert {"unknown_id": "multi_turn_base_9999", "missing_model": "no_model", "bad_adapter": "invalid JSON",
            "bad_params": "max_stepz"}[case] in text
    assert not (workdir / "out").exists()


def test_tracking_failure_fails_stage_without_outputs(workdir, tiny_model_dir, monkeypatch):
    from rcgrpo_tasks.ops import tracking

    def broken(*a, **k):
        raise tracking.TrackingError("MLflow log_metrics failed (test)")

    monkeypatch.setattr(tracking, "log_metrics", broken)
    res = _invoke(workdir, tiny_model_dir)
    assert res.exit_code != 0 and isinstance(res.exception, tracking.TrackingError)
    assert not (workdir / "out").exists()


def test_config_rejects_bad_values(tmp_path):
    p = tmp_path / "p.yaml"
    write_params(p, {"evaluate": {"max_new_tokens": 0}})
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config(evaluate.EvaluateConfig, p, "evaluate")


def test_call_recall_and_summary():
    from rcgrpo_tasks.env.multi_turn.scoring import call_recall

    entry = get_entry("multi_turn_base_0")
    gold = [[list(t)] for t in entry.ground_truth]
    assert call_recall(entry, gold) == 1.0
    assert call_recall(entry, [[]]) == 0.0
    n_gold = sum(len(t) for t in entry.ground_truth)
    # keyword spacing differs from the gold text: calls are compared bound, not as strings
    assert call_recall(entry, [[["cd(folder = 'document')"]]]) == pytest.approx(1 / n_gold)
    rows = [{"id": f"multi_turn_{c}_{i}", "task": "multi_turn", "category": c, "protocol": "paper",
             "valid": i % 2 == 0, "partial_credit": 0.5, "partial_credit_kind": "gold_call_recall",
             "paper_reward": float(i % 2 == 0), "termination": "done", "n_steps": 2,
             "n_model_tokens": 10} for c in ("base", "miss_func") for i in range(4)]
    s = evaluate.summarize(rows, "x", n_boot=200, seed=0)
    assert s["accuracy"] == 50.0 and s["categories"]["base"]["n"] == 4
    lo, hi = s["overall"]["ci"]
    assert 0 <= lo <= 50 <= hi <= 100 and lo < hi
    assert s["terminations"] == {"done": 8}


def test_stratified_limit():
    entries = [get_entry(f"multi_turn_{c}_{i}") for c in ("base", "long_context") for i in range(3)]
    assert [e.category for e in stratified(entries, 3)] == ["base", "long_context", "base"]
    assert stratified(entries, None) == entries


def test_stage_trajectories_are_the_same_bytes_on_every_run():
    """The ids and wall times a DVC stage stores do not change between runs (dvc.lock can vouch for them)."""
    from rcgrpo_tasks.engine.trajectory import DATASET_WALL_TIME, Trajectory, as_stage_output

    fields = {f.name for f in dataclasses.fields(Trajectory)}
    assert {"trajectory_id", "wall_time_s", "entry_id"} <= fields
    runs = []
    for wall in (1.5, 9.0):
        t = dataclasses.replace(_any_trajectory(), wall_time_s=wall)
        runs.append(as_stage_output([t, t], "evaluate:x"))
    assert runs[0] == runs[1] and runs[0][0].wall_time_s == DATASET_WALL_TIME
    assert runs[0][0].trajectory_id != runs[0][1].trajectory_id  # distinct rows, distinct ids
    assert as_stage_output([t], "evaluate:y")[0].trajectory_id != runs[0][0].trajectory_id


def _any_trajectory():
    from rcgrpo_tasks.engine.trajectory import Trajectory

    return Trajectory(entry_id="multi_turn_base_0", category="base", protocol="paper", reward_token=None,
                      messages=[], token_ids=[1, 2], prompt_len=1, completion_mask=[0, 1], logprobs=[0.0, -1.0],
                      result=[[["ls()"]]], termination="done", n_steps=1, n_model_tokens=1, wall_time_s=3.0)


def test_single_turn_evaluation_scores_bfcl_ast_verdicts(tok):
    """The same held-out evaluation on the single-turn task: a scripted policy answers half the entries with
    their expert call and the rest in prose; rows carry BFCL's verdicts and error types, and the task."""
    from rcgrpo_tasks.engine.backend import ScriptedBackend
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.env.single_turn import entries as single_turn
    from rcgrpo_tasks.env.single_turn.perturb import expert_calls

    entries = stratified(single_turn.load_entries(single_turn.DEFAULT_CATEGORIES), 8)
    right = {e.id for e in entries[::2]}

    def policy(key, step, prompt_ids):
        text = tok.decode(prompt_ids)
        e = next(e for e in entries if e.question[-1]["content"] in text)
        return "[" + ", ".join(expert_calls(e)) + "]" if e.id in right else "I cannot help with that."

    cfg = config_from_params(evaluate.EvaluateConfig, "evaluate", **{"n_bootstrap": 50, "limit": 8, "max_outputs": 8,
                                              "max_new_tokens": 96, "batch_rows": 8})
    trajs, rows, summary = evaluate.run_eval(cfg, config_from_params(PromptConfig, "prompt", system_prompt="bfcl"), ScriptedBackend(tok, policy), entries, None, "x")
    assert summary["task"] == "single_turn" and summary["n"] == 8 and summary["accuracy"] == 50.0
    assert set(summary["categories"]) == set(single_turn.DEFAULT_CATEGORIES)
    for r in rows:
        assert r["task"] == "single_turn" and r["valid"] is (r["id"] in right) and r["n_steps"] == 1
        assert r["error_type"] == (None if r["id"] in right else "ast_decoder:decoder_failed")
        assert r["partial_credit_kind"] == "gold_calls_matched" and r["partial_credit"] == float(r["valid"])
    md = evaluate.report_markdown(summary, {"side": "test"}, None)
    assert "`single_turn` task" in md and "AST checker" in md and "## Held-out split" in md
