"""promote: the paired gate on hand-built per-entry results (pure) and the real MLflow registry on a temp
sqlite store: champion records stored with the version, refusal across evaluation settings/protocols/entry
sets (read from the evaluations, never from the caller's params)."""

from __future__ import annotations

import json

import pytest
from helpers import config_from_params, write_params

from rcgrpo_tasks.evaluation import promotion as pr
from rcgrpo_tasks.ops import tracking
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.stages import promote as pr_stage

IDS = [f"multi_turn_base_{i}" for i in range(40)]


def rec(valid: list[bool], settings: dict | None = None, protocol: str = "paper", ids=IDS, label="m") -> pr.EvalRecord:
    return pr.EvalRecord(label, protocol, settings or {"limit": 40}, {i: float(v) for i, v in zip(ids, valid)},
                         f"<{label}>")


def promote(cfg, candidates, champion_eval=None):
    """What the stage does: the gate inside its MLflow run."""
    with tracking.stage_run("promote", cfg) as run:
        return pr.promote(cfg, candidates, run, champion_eval)


HALF = [i % 2 == 0 for i in range(40)]          # 50 %
BETTER = [i % 2 == 0 or i % 3 == 0 for i in range(40)]  # a superset of HALF's successes: 67.5 %
ONE_MORE = [*HALF[:-1], True]                    # HALF + one entry: 52.5 %


def test_paired_gate_promotes_only_a_clear_paired_win():
    cfg = config_from_params(pr.PromoteConfig, "promote")
    win = pr.paired_gate(rec(BETTER), rec(HALF), cfg)
    assert win["decision"] == "promoted" and win["diff"] == pytest.approx(17.5) and win["ci"][0] > 0
    assert "over 40 paired entries" in win["reason"]
    tie = pr.paired_gate(rec(HALF), rec(HALF), cfg)
    assert tie["decision"] == "kept" and tie["ci"] == [0.0, 0.0]
    noisy = pr.paired_gate(rec(ONE_MORE), rec(HALF), cfg)  # +2.5 pp from one entry: CI touches 0
    assert noisy["decision"] == "kept" and noisy["ci"][0] <= 0 < noisy["diff"]
    worse = pr.paired_gate(rec(HALF), rec(BETTER), cfg)
    assert worse["decision"] == "kept" and worse["diff"] < 0
    strict = pr.paired_gate(rec(BETTER), rec(HALF), config_from_params(pr.PromoteConfig, "promote", min_improvement=50.0))
    assert strict["decision"] == "kept" and "more than 50 pp" in strict["reason"]
    assert pr.paired_gate(rec(HALF), None, cfg)["decision"] == "promoted"


def test_pairing_is_by_entry_not_by_overall_number():
    """Same accuracy (50 %) on complementary entries: an unpaired gate sees a tie; the pairs show the
    candidate fails every entry the champion solves."""
    flipped = [not v for v in HALF]
    gate = pr.paired_gate(rec(flipped), rec(HALF), config_from_params(pr.PromoteConfig, "promote"))
    assert gate["diff"] == 0 and gate["ci"][0] < -20 and gate["decision"] == "kept"


@pytest.mark.parametrize("champion, what", [
    (rec(HALF, settings={"limit": 8}), "evaluation settings differ (limit: candidate 40, champion 8)"),
    (rec(HALF, protocol="official"), "protocol differs: candidate 'paper', champion 'official'"),
    (rec(HALF[:30], ids=IDS[:30]), "entry sets differ: candidate 40, champion 30, 30 shared"),
])
def test_comparisons_across_conditions_are_refused(champion, what):
    gate = pr.paired_gate(rec(BETTER), champion, config_from_params(pr.PromoteConfig, "promote"))
    assert gate["decision"] == "refused" and gate["reason"].startswith("comparison refused: " + what)


def test_parse_results_errors():
    ok = pr.parse_results([{"id": "a", "valid": True, "protocol": "paper"}], "x", {}, "f")
    assert ok.accuracy == 100.0 and ok.protocol == "paper"
    with pytest.raises(InputError, match="f: row 1 needs a string 'id' and a boolean 'valid'"):
        pr.parse_results([{"id": "a", "valid": 1}], "x", {}, "f")
    with pytest.raises(InputError, match="duplicate entry id 'a'"):
        pr.parse_results([{"id": "a", "valid": True}, {"id": "a", "valid": False}], "x", {}, "f")
    with pytest.raises(InputError, match="mix protocols"):
        pr.parse_results([{"id": "a", "valid": True, "protocol": "paper"},
                          {"id": "b", "valid": True, "protocol": "official"}], "x", {}, "f")
    with pytest.raises(InputError, match="no per-entry results"):
        pr.parse_results([], "x", {}, "f")
    with pytest.raises(ValueError):
        config_from_params(pr.PromoteConfig, "promote", min_improvement=-1)


# -- the registry -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def _store(tmp_path_factory):
    return tmp_path_factory.mktemp("registry")  # one sqlite DB (creating one costs seconds)


@pytest.fixture()
def registry(_store, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{_store}/mlflow.db")
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(_store / "artifacts"))
    monkeypatch.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    model = tmp_path / "adapter"
    model.mkdir()
    (model / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (model / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return model


SETTINGS = {"max_new_tokens": 64, "max_outputs": 6, "temperature": 0.0, "limit": 40, "model": "m", "batch_rows": 8}


def write_eval(folder, valid, protocol="paper", ids=IDS, **settings):
    """An evaluate output: results.jsonl and metrics.json with the settings it ran under."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "category": "base", "protocol": protocol, "valid": v} for i, v in zip(ids, valid)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "metrics.json").write_text(json.dumps({"settings": {**SETTINGS, **settings}}))
    return folder


def cand(tmp_path, model, name, valid, **kw):
    folder = write_eval(tmp_path / "eval" / name, valid, **kw)
    return {name: (model, pr.read_eval(folder, name))}


def test_alias_moves_only_on_a_paired_win(registry, tmp_path):
    import mlflow

    cfg = config_from_params(pr.PromoteConfig, "promote", model_name="test-agent")
    first = promote(cfg, {**cand(tmp_path, registry, "a", ONE_MORE), **cand(tmp_path, registry, "b", HALF)})
    assert first["candidate"] == "a" and first["promoted"] and first["champion_version"] is None
    same = promote(cfg, cand(tmp_path, registry, "b", ONE_MORE))
    assert same["decision"] == "kept" and same["champion_accuracy"] == 52.5 and same["ci"] == [0.0, 0.0]
    better = promote(cfg, cand(tmp_path, registry, "c", BETTER))
    assert better["decision"] == "promoted" and better["champion_version"] == first["candidate_version"]
    short = promote(cfg, cand(tmp_path, registry, "d", [True] * 40, max_new_tokens=16))  # other budgets
    assert short["decision"] == "refused" and short["candidate_version"] is None
    assert "evaluation settings differ (max_new_tokens: candidate 16, champion 64)" in short["reason"]

    client = mlflow.MlflowClient()
    champ = client.get_model_version_by_alias("test-agent", "champion")
    assert int(champ.version) == better["candidate_version"]  # the refused 100 % never moved the alias
    assert json.loads(champ.tags["eval.settings"])["max_new_tokens"] == 64 and champ.tags["eval.n"] == "40"
    assert "model" not in json.loads(champ.tags["eval.settings"])  # which model does not make it incomparable
    assert len(client.search_model_versions("name='test-agent'")) == 3  # the refused one is not registered
    run = client.get_run(short["run_id"])
    assert run.data.tags["promote.decision"] == "refused"
    assert run.data.metrics["candidate_accuracy"] == 100.0
    files = {a.path for a in client.list_artifacts(better["run_id"], "model")}
    assert "model/adapter_config.json" in files
    assert {a.path for a in client.list_artifacts(better["run_id"], "eval")} == {"eval/results.jsonl"}


def test_fresh_champion_evaluation_overrides_the_stored_record(registry, tmp_path):
    cfg = config_from_params(pr.PromoteConfig, "promote", model_name="retrain-agent")
    promote(cfg, cand(tmp_path, registry, "old", HALF, max_new_tokens=16))
    fresh = pr.read_eval(write_eval(tmp_path / "champ", HALF), "champion")
    record = promote(cfg, cand(tmp_path, registry, "new", BETTER), champion_eval=fresh)
    assert record["decision"] == "promoted" and record["champion_accuracy"] == 50.0


def test_legacy_champion_without_a_record_is_replaced(registry, tmp_path):
    import mlflow

    cfg = config_from_params(pr.PromoteConfig, "promote", model_name="legacy-agent")
    first = promote(cfg, cand(tmp_path, registry, "b", BETTER))
    client = mlflow.MlflowClient()
    client.delete_model_version_tag("legacy-agent", str(first["candidate_version"]), "eval.entries_sha256")
    again = promote(cfg, cand(tmp_path, registry, "b", HALF))
    assert again["promoted"] and "no per-entry record" in again["reason"]


def test_cli_errors_are_clear(tmp_path, registry):
    from typer.testing import CliRunner

    params = tmp_path / "params.yaml"
    write_params(params, {"promote": {"model_name": "cli-agent", "metric_key": "old.key"}})
    runner = CliRunner()
    base = ["--params", str(params), "--eval-dir", str(tmp_path / "eval"), "--out", str(tmp_path / "d.json")]
    res = runner.invoke(pr_stage.app, [*base, "--candidate", f"b={registry}"])
    assert res.exit_code == 2 and f"{tmp_path}/eval/b/metrics.json: not found" in res.output
    write_eval(tmp_path / "eval" / "b", HALF)
    res = runner.invoke(pr_stage.app, [*base, "--candidate", f"b={tmp_path / 'missing'}"])
    assert res.exit_code == 2 and "missing or empty" in res.output
    (tmp_path / "eval" / "bad").mkdir()
    (tmp_path / "eval" / "bad" / "results.jsonl").write_text("[" * 5000 + "]" * 5000 + "\n")
    (tmp_path / "eval" / "bad" / "metrics.json").write_text(json.dumps({"settings": SETTINGS}))
    res = runner.invoke(pr_stage.app, [*base, "--candidate", f"bad={registry}"])
    assert res.exit_code == 2 and "results.jsonl:1: invalid JSON (nested too deeply)" in res.output
    res = runner.invoke(pr_stage.app, [*base, "--candidate", f"b={registry}", "--report", "ignored.json"])
    assert res.exit_code == 0, res.output
    decision = json.loads((tmp_path / "d.json").read_text())
    assert decision["promoted"] is True and decision["settings"]["limit"] == 40 and decision["n_entries"] == 40


def test_without_candidates_every_cell_of_every_grid_seed_competes(tmp_path, registry):
    """The pipeline's call: no --candidate, so each RL cell of each grid seed (models/rl/<seed>/<cell>,
    results/eval/<seed>/<cell>) is a candidate labelled `<cell>@<seed>`, and the best one is registered."""
    import shutil

    from typer.testing import CliRunner

    params = tmp_path / "params.yaml"
    write_params(params, {"promote": {"model_name": "grid-agent"},
                          "grid": {"seeds": [0, 1], "rl": {"sft": [], "rctp": ["grpo", "rc_grpo"]}, "evaluate": {}}})
    for seed, cell, valid in ((0, "rctp-grpo", HALF), (0, "rctp-rc_grpo", HALF), (1, "rctp-grpo", BETTER),
                              (1, "rctp-rc_grpo", HALF)):
        write_eval(tmp_path / "eval" / str(seed) / cell, valid)
        shutil.copytree(registry, tmp_path / "rl" / str(seed) / cell)
    res = CliRunner().invoke(pr_stage.app, ["--params", str(params), "--eval-dir", str(tmp_path / "eval"),
                                            "--rl-root", str(tmp_path / "rl"), "--out", str(tmp_path / "d.json")])
    assert res.exit_code == 0, res.output
    decision = json.loads((tmp_path / "d.json").read_text())
    assert decision["candidate"] == "rctp-grpo@1" and decision["promoted"]
    assert set(decision["all_candidates"]) == {f"{c}@{s}" for s in (0, 1) for c in ("rctp-grpo", "rctp-rc_grpo")}
