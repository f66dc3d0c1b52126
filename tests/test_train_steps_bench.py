"""bench/train_steps.py (the GPU check's `train-steps` step) on the tiny random-init model on the CPU: every
phase (SFT full and LoRA, an RC-GRPO step, an evaluate batch) runs through the stages' code on entries the
prepare_data stage writes, and the JSON holds positive seconds for each."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("train_steps", REPO / "bench" / "train_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_times_every_phase(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    out = tmp_path / "train-steps.json"
    monkeypatch.setattr(sys, "argv", ["train_steps.py", "--model", str(tiny_model_dir), "--device", "cpu",
                                      "--dtype", "float32", "--tiny", "--out", str(out)])
    _bench().main()
    got = json.loads(out.read_text())
    assert (got["device"], got["placement"], got["steps"]) == ("cpu", "cpu", 1)
    for phase in ("sft_full", "sft_lora"):
        assert got[phase]["step_s"] > 0 and len(got[phase]["steps_s"]) == 1
        assert got[phase]["chats"] == 2 and got[phase]["tokens_median"] > 100
    assert got["rl"]["step_s"] > 0 and got["rl"]["rollout_s"] > 0 and got["rl"]["train_s"] > 0
    assert (got["rl"]["groups"], got["rl"]["G"], got["rl"]["beta"]) == (2, 2, 0.1)
    assert got["evaluate"]["batch_s"] > 0 and got["evaluate"]["rows"] == 4
    assert got["evaluate"]["model_tokens"] > 0
    lines = capsys.readouterr().out
    for head in ("sft-full step:", "rl step:", "evaluate batch:", "sft-lora step:"):
        assert head in lines
