"""prepare_model: the bundled GGUF becomes a fast-reloading, generating HF folder; bad sources fail clearly."""

from __future__ import annotations

import json
import time

import pytest
from helpers import config_from_params
from typer.testing import CliRunner

from rcgrpo_tasks.engine import source as pm
from rcgrpo_tasks.ops.outputs import atomic_dir
from rcgrpo_tasks.stages import prepare_model as pm_stage


def prepare(cfg, out):
    """The stage's write: the folder filled atomically (nothing left behind on an error)."""
    with atomic_dir(out) as tmp:
        return pm.write_model(cfg, tmp)


@pytest.mark.slow
def test_embedded_gguf_to_folder_reloads_fast_and_generates(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "base"
    record = prepare(config_from_params(pm.PrepareModelConfig, "prepare_model"), out)
    assert record["n_parameters"] > 100e6 and record["max_position_embeddings"] == 8192
    prepare(config_from_params(pm.PrepareModelConfig, "prepare_model"), tmp_path / "again")
    assert _files(out) == _files(tmp_path / "again")  # the lock reproduces on every run and machine
    assert json.loads((out / pm.PROVENANCE_FILE).read_text())["config"]["source"] == "embedded"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out)  # a plain folder: no GGUF on load (its seconds: bench/refusals.py)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.strip()  # a real instruct model answers


@pytest.mark.parametrize("source", ["./no/such/folder", "not a hub id!", "folder_without_config"])
def test_bad_source_is_a_clear_error_and_writes_nothing(tmp_path, source):
    if source == "folder_without_config":
        (tmp_path / source).mkdir()
        source = str(tmp_path / source)
    with pytest.raises(pm.ModelSourceError, match="source"):
        prepare(config_from_params(pm.PrepareModelConfig, "prepare_model", source=source), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_gguf_and_offline_hub_id(tmp_path, monkeypatch):
    with pytest.raises(pm.ModelSourceError, match="not found"):
        prepare(config_from_params(pm.PrepareModelConfig, "prepare_model", gguf_file="nope.gguf"), tmp_path / "out")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: patch the flag
    with pytest.raises(pm.ModelSourceError, match="could not load"):
        prepare(config_from_params(pm.PrepareModelConfig, "prepare_model", source="Qwen/Qwen2.5-7B-Instruct-not-cached"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _files(folder):
    """{name: (bytes, mode)} of every file in a folder."""
    return {p.name: (p.read_bytes(), p.stat().st_mode & 0o777) for p in sorted(folder.iterdir())}


def test_same_bytes_on_every_run(tiny_model_dir, tmp_path):
    """Two runs (different folders, different wall times) write byte-identical folders: a fresh clone
    reproduces the hash dvc.lock records. The first cause found: the wall time in rcgrpo_model.json."""
    cfg = config_from_params(pm.PrepareModelConfig, "prepare_model", source=str(tiny_model_dir))
    first = prepare(cfg, tmp_path / "a")
    time.sleep(0.05)
    prepare(cfg, tmp_path / "b")
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert sorted(a) == sorted(b) and {"model.safetensors", pm.PROVENANCE_FILE} <= set(a)
    for name in a:
        assert a[name] == b[name], f"{name} differs between two runs"
    assert all(mode == 0o644 for _, mode in a.values())  # safetensors' 0600 would lock out other users
    assert "seconds" in first and "seconds" not in json.loads(a[pm.PROVENANCE_FILE][0])


def test_local_folder_source_resaves_in_dtype(tiny_model_dir, tmp_path):
    record = prepare(config_from_params(pm.PrepareModelConfig, "prepare_model", source=str(tiny_model_dir), dtype="bfloat16"), tmp_path / "m")
    assert record["architecture"] == "LlamaForCausalLM"
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_bad_params(tmp_path):
    (tmp_path / "params.yaml").write_text("prepare_model:\n  sourc: embedded\n")
    res = CliRunner().invoke(pm_stage.app, ["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and "sourc" in res.output
    assert not (tmp_path / "o").exists()
