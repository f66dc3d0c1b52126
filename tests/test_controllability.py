"""controllability stage: the gap statistic, a token-obedient scripted policy (gap = its success rate), and
the CLI on a tiny model trained by the sft stage (real engine, real scorer, temp MLflow)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from rcgrpo_tasks import bfcl, controllability as ctl
from rcgrpo_tasks.io import write_json, write_jsonl

HIGH, LOW = "<|high_reward|>", "<|low_reward|>"
TOKENS = (LOW, HIGH)


def test_gap_stats_pairs_by_entry():
    scores = [{"entry_id": e, "reward_token": t, "r": r} for e, t, r in [
        ("a", HIGH, 1), ("a", LOW, 0), ("b", HIGH, 1), ("b", LOW, 1), ("c", HIGH, 0), ("c", LOW, 0),
        ("d", HIGH, 1)]]  # d has no low rollout: in the means, not in the paired gap
    s = ctl.gap_stats(scores, HIGH, LOW, "r")
    assert s["high"] == pytest.approx(3 / 4) and s["low"] == pytest.approx(1 / 3)
    assert s["gap"] == pytest.approx(1 / 3)
    assert s["gap_se"] == pytest.approx(math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2 / 3))


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model_dir)
    t.add_special_tokens({"extra_special_tokens": [LOW, HIGH]})
    return t


@pytest.mark.parametrize("protocol", ["paper", "official"])
def test_obedient_policy_has_full_gap(tok, protocol):
    """A policy that replays the gold calls only when asked for a high reward: gap = 1 on entries whose gold
    replay succeeds, and the low-conditioned rollouts score 0. (Partial credit is per BFCL turn, so only the
    official protocol, turn by turn, can earn it.)"""
    from rcgrpo_tasks.backends import ScriptedBackend
    from rcgrpo_tasks.engine import replay_steps
    from rcgrpo_tasks.protocols import ProtocolConfig

    entries = bfcl.load_entries(["base"])[:2]
    cfg = ctl.ControllabilityConfig(n_entries=2, protocol=protocol, max_steps=20, max_new_tokens=4000)
    steps = {"max_steps": 20} if protocol == "paper" else {}
    proto = ProtocolConfig(protocol=protocol, doc_style="compact", **steps)
    gold = {e.id: replay_steps(e, proto, e.ground_truth) for e in entries}
    high_id = tok.convert_tokens_to_ids(HIGH)
    starts: dict = {}

    def policy(key, step, ids):
        entry_id = starts.setdefault(key, next(e.id for e in entries if e.turns[0][0]["content"][:40] in tok.decode(ids)))
        texts = gold[entry_id] if high_id in ids else []
        return texts[step] if step < len(texts) else ""

    backend = ScriptedBackend(tok, policy)
    metrics, trajs = ctl.measure(cfg, TOKENS, backend, entries)
    assert [t.reward_token for t in trajs] == [HIGH, LOW, HIGH, LOW]
    assert metrics["success_rate_high"] == 1.0 and metrics["success_rate_low"] == 0.0
    assert metrics["gap"] == 1.0
    assert metrics["partial_credit_gap"] == (1.0 if protocol == "official" else 0.0)
    assert metrics["entries"] == [e.id for e in entries]


def test_cli_on_tiny_rctp_model(tiny_model_dir, tmp_path, monkeypatch):
    """End to end on a tiny sft-stage output: loads through sft.load_trained, rolls, writes, logs."""
    from typer.testing import CliRunner

    from rcgrpo_tasks import sft

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp_path / "mlartifacts"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "test-ctl")
    monkeypatch.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    from test_sft import chat  # the hand-made rctp rows

    write_jsonl(tmp_path / "rctp.jsonl", [chat(i, HIGH if i % 2 else LOW) for i in range(8)])
    cfg = sft.SftConfig(learning_rate=1e-2, max_steps=1, batch_size=4, max_length=128, lora_r=4, lora_alpha=8,
                        log_model=False, require_reward_token=True)
    spec = sft.RunSpec("rctp", tiny_model_dir, tmp_path / "rctp.jsonl", tmp_path / "adapter", tmp_path / "ck")
    sft.train_variant(cfg, TOKENS, spec, log_mlflow=False)

    entries = bfcl.load_entries(["base"])[:3]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", {"train": [entries[0].id], "test": [e.id for e in entries[1:]]})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "controllability": {"n_entries": 2, "max_steps": 1, "max_new_tokens": 3, "system_prompt": "short",
                            "dtype": "float32"},
        "label_rewards": {"tokens": list(TOKENS)}}))
    res = CliRunner().invoke(ctl.app, [
        "--model-dir", str(tiny_model_dir), "--adapter-dir", str(tmp_path / "adapter"),
        "--entries", str(tmp_path / "entries.jsonl"), "--split", str(tmp_path / "split.json"),
        "--metrics", str(tmp_path / "m.json"), "--trajectories", str(tmp_path / "t.jsonl"),
        "--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["entries"] == [e.id for e in entries[1:]] and m["n_entries"] == 2
    assert 0.0 <= m["success_rate_high"] <= 1.0 and -1.0 <= m["gap"] <= 1.0
    rows = (tmp_path / "t.jsonl").read_text().splitlines()
    assert [json.loads(r)["reward_token"] for r in rows] == [HIGH, LOW, HIGH, LOW]


def test_bad_params_and_missing_split(tmp_path):
    from typer.testing import CliRunner

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"controllability": {"n_entries": 0}}))
    res = CliRunner().invoke(ctl.app, ["--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 2 and "n_entries" in res.output
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"controllability": {}}))
    res = CliRunner().invoke(ctl.app, ["--params", str(tmp_path / "params.yaml"), "--split",
                                       str(tmp_path / "none.json"), "--entries", str(tmp_path / "e.jsonl")])
    assert res.exit_code == 2 and ("not found" in res.output)


@pytest.mark.parametrize("adapter,match", [("missing", "no adapter_config.json"), ("", "is not a single token")])
def test_bad_model_fails_before_any_run_and_writes_nothing(tiny_model_dir, tmp_path, monkeypatch, adapter, match):
    """A missing adapter, or a model without the reward tokens: exit 2 naming the folder, no outputs, no MLflow run."""
    from typer.testing import CliRunner

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    entries = bfcl.load_entries(["base"])[:2]
    write_jsonl(tmp_path / "entries.jsonl", (e.to_json() for e in entries))
    write_json(tmp_path / "split.json", {"train": [entries[0].id], "test": [entries[1].id]})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"controllability": {"n_entries": 1, "dtype": "float32"}}))
    res = CliRunner().invoke(ctl.app, [
        "--model-dir", str(tiny_model_dir), *(["--adapter-dir", str(tmp_path / adapter)] if adapter else []),
        "--entries", str(tmp_path / "entries.jsonl"), "--split", str(tmp_path / "split.json"),
        "--metrics", str(tmp_path / "m.json"), "--trajectories", str(tmp_path / "t.jsonl"),
        "--params", str(tmp_path / "params.yaml")])
    assert res.exit_code == 2 and match in res.output, res.output
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "t.jsonl").exists()
    assert not (tmp_path / "mlflow.db").exists()
