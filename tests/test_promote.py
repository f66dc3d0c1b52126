"""promote: the paired gate on hand-built per-entry results (pure) and the real MLflow registry on a temp
sqlite store: champion records stored with the version, refusal across profiles/protocols/entry sets."""

from __future__ import annotations

import json

import pytest

from rcgrpo_tasks.evaluation import promotion as pr
from rcgrpo_tasks.ops.io import InputError
from rcgrpo_tasks.stages import promote as pr_stage

IDS = [f"multi_turn_base_{i}" for i in range(40)]


def rec(valid: list[bool], profile: str = "default", protocol: str = "paper", ids=IDS, label="m") -> pr.EvalRecord:
    return pr.EvalRecord(label, protocol, profile, {i: float(v) for i, v in zip(ids, valid)}, f"<{label}>")


HALF = [i % 2 == 0 for i in range(40)]          # 50 %
BETTER = [i % 2 == 0 or i % 3 == 0 for i in range(40)]  # a superset of HALF's successes: 67.5 %
ONE_MORE = [*HALF[:-1], True]                    # HALF + one entry: 52.5 %


def test_paired_gate_promotes_only_a_clear_paired_win():
    cfg = pr.PromoteConfig()
    win = pr.paired_gate(rec(BETTER), rec(HALF), cfg)
    assert win["decision"] == "promoted" and win["diff"] == pytest.approx(17.5) and win["ci"][0] > 0
    assert "over 40 paired entries" in win["reason"]
    tie = pr.paired_gate(rec(HALF), rec(HALF), cfg)
    assert tie["decision"] == "kept" and tie["ci"] == [0.0, 0.0]
    noisy = pr.paired_gate(rec(ONE_MORE), rec(HALF), cfg)  # +2.5 pp from one entry: CI touches 0
    assert noisy["decision"] == "kept" and noisy["ci"][0] <= 0 < noisy["diff"]
    worse = pr.paired_gate(rec(HALF), rec(BETTER), cfg)
    assert worse["decision"] == "kept" and worse["diff"] < 0
    strict = pr.paired_gate(rec(BETTER), rec(HALF), pr.PromoteConfig(min_improvement=50.0))
    assert strict["decision"] == "kept" and "more than 50 pp" in strict["reason"]
    assert pr.paired_gate(rec(HALF), None, cfg)["decision"] == "promoted"


def test_pairing_is_by_entry_not_by_overall_number():
    """Same accuracy (50 %) on complementary entries: an unpaired gate sees a tie; the pairs show the
    candidate fails every entry the champion solves."""
    flipped = [not v for v in HALF]
    gate = pr.paired_gate(rec(flipped), rec(HALF), pr.PromoteConfig())
    assert gate["diff"] == 0 and gate["ci"][0] < -20 and gate["decision"] == "kept"


@pytest.mark.parametrize("champion, what", [
    (rec(HALF, profile="smoke"), "profile differs: candidate 'default', champion 'smoke'"),
    (rec(HALF, protocol="official"), "protocol differs: candidate 'paper', champion 'official'"),
    (rec(HALF[:30], ids=IDS[:30]), "entry sets differ: candidate 40, champion 30, 30 shared"),
])
def test_comparisons_across_conditions_are_refused(champion, what):
    gate = pr.paired_gate(rec(BETTER), champion, pr.PromoteConfig())
    assert gate["decision"] == "refused" and gate["reason"].startswith("comparison refused: " + what)


def test_parse_results_errors():
    ok = pr.parse_results([{"id": "a", "valid": True, "protocol": "paper"}], "x", "default", "f")
    assert ok.accuracy == 100.0 and ok.protocol == "paper"
    with pytest.raises(InputError, match="f: row 1 needs a string 'id' and a boolean 'valid'"):
        pr.parse_results([{"id": "a", "valid": 1}], "x", "default", "f")
    with pytest.raises(InputError, match="duplicate entry id 'a'"):
        pr.parse_results([{"id": "a", "valid": True}, {"id": "a", "valid": False}], "x", "default", "f")
    with pytest.raises(InputError, match="mix protocols"):
        pr.parse_results([{"id": "a", "valid": True, "protocol": "paper"},
                          {"id": "b", "valid": True, "protocol": "official"}], "x", "default", "f")
    with pytest.raises(InputError, match="no per-entry results"):
        pr.parse_results([], "x", "default", "f")
    with pytest.raises(ValueError):
        pr.PromoteConfig(min_improvement=-1)


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


def write_eval(folder, valid, protocol="paper", ids=IDS):
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "category": "base", "protocol": protocol, "valid": v} for i, v in zip(ids, valid)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def cand(tmp_path, model, name, valid, profile="default", **kw):
    folder = write_eval(tmp_path / "eval" / name, valid, **kw)
    return {name: (model, pr.read_eval(folder, name, profile))}


def test_alias_moves_only_on_a_paired_win(registry, tmp_path):
    import mlflow

    cfg = pr.PromoteConfig(model_name="test-agent")
    first = pr.promote(cfg, {**cand(tmp_path, registry, "a", ONE_MORE), **cand(tmp_path, registry, "b", HALF)})
    assert first["candidate"] == "a" and first["promoted"] and first["champion_version"] is None
    same = pr.promote(cfg, cand(tmp_path, registry, "b", ONE_MORE))
    assert same["decision"] == "kept" and same["champion_accuracy"] == 52.5 and same["ci"] == [0.0, 0.0]
    better = pr.promote(cfg, cand(tmp_path, registry, "c", BETTER))
    assert better["decision"] == "promoted" and better["champion_version"] == first["candidate_version"]
    smoke = pr.promote(cfg, cand(tmp_path, registry, "d", [True] * 40, profile="smoke"))
    assert smoke["decision"] == "refused" and "profile differs" in smoke["reason"]

    client = mlflow.MlflowClient()
    champ = client.get_model_version_by_alias("test-agent", "champion")
    assert int(champ.version) == better["candidate_version"]  # the refused 100 % never moved the alias
    assert champ.tags["eval.profile"] == "default" and champ.tags["eval.n"] == "40"
    assert len(client.search_model_versions("name='test-agent'")) == 4  # every candidate is registered
    run = client.get_run(smoke["run_id"])
    assert run.data.tags["promote.decision"] == "refused"
    assert run.data.metrics["candidate_accuracy"] == 100.0
    files = {a.path for a in client.list_artifacts(better["run_id"], "model")}
    assert "model/adapter_config.json" in files
    assert {a.path for a in client.list_artifacts(better["run_id"], "eval")} == {"eval/results.jsonl"}


def test_fresh_champion_evaluation_overrides_the_stored_record(registry, tmp_path):
    cfg = pr.PromoteConfig(model_name="retrain-agent")
    pr.promote(cfg, cand(tmp_path, registry, "old", HALF, profile="smoke"))
    fresh = pr.read_eval(write_eval(tmp_path / "champ", HALF), "champion", "default")
    record = pr.promote(cfg, cand(tmp_path, registry, "new", BETTER), champion_eval=fresh)
    assert record["decision"] == "promoted" and record["champion_accuracy"] == 50.0


def test_legacy_champion_without_a_record_is_replaced(registry, tmp_path):
    import mlflow

    cfg = pr.PromoteConfig(model_name="legacy-agent")
    first = pr.promote(cfg, cand(tmp_path, registry, "b", BETTER))
    client = mlflow.MlflowClient()
    client.delete_model_version_tag("legacy-agent", str(first["candidate_version"]), "eval.entries_sha256")
    again = pr.promote(cfg, cand(tmp_path, registry, "b", HALF))
    assert again["promoted"] and "no per-entry record" in again["reason"]


def test_cli_errors_are_clear(tmp_path, registry):
    from typer.testing import CliRunner

    params = tmp_path / "params.yaml"
    params.write_text("promote:\n  model_name: cli-agent\n  metric_key: old.key\n")
    runner = CliRunner()
    base = ["--params", str(params), "--eval-dir", str(tmp_path / "eval"), "--out", str(tmp_path / "d.json")]
    res = runner.invoke(pr_stage.app, [*base, "--candidate", f"b={registry}"])
    assert res.exit_code == 2 and f"{tmp_path}/eval/b/results.jsonl: file not found" in res.output
    write_eval(tmp_path / "eval" / "b", HALF)
    res = runner.invoke(pr_stage.app, [*base, "--candidate", f"b={tmp_path / 'missing'}"])
    assert res.exit_code == 2 and "missing or empty" in res.output
    (tmp_path / "eval" / "bad").mkdir()
    (tmp_path / "eval" / "bad" / "results.jsonl").write_text("[" * 5000 + "]" * 5000 + "\n")
    res = runner.invoke(pr_stage.app, [*base, "--candidate", f"bad={registry}"])
    assert res.exit_code == 2 and "results.jsonl:1: invalid JSON (nested too deeply)" in res.output
    res = runner.invoke(pr_stage.app, [*base, "--candidate", f"b={registry}", "--report", "ignored.json"])
    assert res.exit_code == 0, res.output
    decision = json.loads((tmp_path / "d.json").read_text())
    assert decision["promoted"] is True and decision["profile"] == "default" and decision["n_entries"] == 40
