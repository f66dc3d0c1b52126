"""promote: the champion gate (pure) and the real MLflow registry on a temp sqlite store."""

from __future__ import annotations

import json

import pytest

from rcgrpo_tasks import promote as pr
from rcgrpo_tasks.io import InputError


def test_decide_rules():
    assert pr.decide(0.5, None) == (True, "no comparable champion")
    assert pr.decide(0.6, 0.5)[0] is True
    assert pr.decide(0.5, 0.5) == (False, "tie at 0.5: champion kept")
    assert pr.decide(0.4, 0.5)[0] is False
    assert pr.decide(0.55, 0.5, min_improvement=0.1)[0] is False
    assert pr.decide(0.61, 0.5, min_improvement=0.1)[0] is True


def test_read_accuracy_paths_and_errors():
    report = {"rows": {"rctp-rc_grpo": {"overall": {"accuracy": 42.5}}}}
    assert pr.read_accuracy(report, pr.PromoteConfig.metric_key, "rctp-rc_grpo") == 42.5
    with pytest.raises(InputError, match="no value at 'rows.sft.overall.accuracy'"):
        pr.read_accuracy(report, pr.PromoteConfig.metric_key, "sft")
    with pytest.raises(InputError, match="not a number"):
        pr.read_accuracy({"acc": "x"}, "acc", "a")
    with pytest.raises(ValueError):
        pr.PromoteConfig(min_improvement=-1)


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


def _report(**acc):
    return {"rows": {label: {"overall": {"accuracy": a}} for label, a in acc.items()}}


def test_alias_moves_only_for_a_better_model(registry):
    import mlflow

    cfg = pr.PromoteConfig(model_name="test-agent")
    first = pr.promote(cfg, _report(a=40.0, b=50.0), {"a": registry, "b": registry})
    assert first["candidate"] == "b" and first["promoted"] and first["champion_version"] is None
    worse = pr.promote(cfg, _report(b=30.0), {"b": registry})
    assert not worse["promoted"] and worse["champion_accuracy"] == 50.0
    tie = pr.promote(cfg, _report(b=50.0), {"b": registry})
    assert not tie["promoted"] and "tie" in tie["reason"]
    better = pr.promote(cfg, _report(b=55.0), {"b": registry})
    assert better["promoted"] and better["champion_version"] == first["candidate_version"]

    client = mlflow.MlflowClient()
    champ = client.get_model_version_by_alias("test-agent", "champion")
    assert int(champ.version) == better["candidate_version"]
    versions = client.search_model_versions("name='test-agent'")
    assert len(versions) == 4  # every candidate is registered; only the alias is gated
    run = client.get_run(worse["run_id"])
    assert run.data.metrics["candidate_accuracy"] == 30.0 and run.data.metrics["champion_accuracy"] == 50.0
    assert run.data.tags["promote.decision"] == "kept"
    files = {a.path for a in client.list_artifacts(better["run_id"], "model")}
    assert "model/adapter_config.json" in files


def test_champion_without_recorded_accuracy_is_replaced(registry):
    import mlflow

    cfg = pr.PromoteConfig(model_name="legacy-agent")
    first = pr.promote(cfg, _report(b=10.0), {"b": registry})
    client = mlflow.MlflowClient()
    client.delete_model_version_tag("legacy-agent", str(first["candidate_version"]), pr.ACC_TAG)
    again = pr.promote(cfg, _report(b=5.0), {"b": registry})
    assert again["promoted"] and "no recorded" in again["reason"]


def test_cli_errors_are_clear(tmp_path, registry):
    from typer.testing import CliRunner

    params = tmp_path / "params.yaml"
    params.write_text("promote:\n  model_name: cli-agent\n")
    runner = CliRunner()
    res = runner.invoke(pr.app, ["--params", str(params), "--report", str(tmp_path / "nope.json"),
                                 "--candidate", f"b={registry}", "--out", str(tmp_path / "d.json")])
    assert res.exit_code == 2 and "metrics JSON not found" in res.output
    rep = tmp_path / "report.json"
    rep.write_text(json.dumps(_report(b=12.0)))
    res = runner.invoke(pr.app, ["--params", str(params), "--report", str(rep),
                                 "--candidate", f"b={tmp_path / 'missing'}", "--out", str(tmp_path / "d.json")])
    assert res.exit_code == 2 and "missing or empty" in res.output
    res = runner.invoke(pr.app, ["--params", str(params), "--report", str(rep),
                                 "--candidate", f"b={registry}", "--out", str(tmp_path / "d.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "d.json").read_text())["promoted"] is True
