"""Placement: the `device` setting resolves or fails clearly (never a silent CPU run); models land there."""

from __future__ import annotations

import pytest
from helpers import TEST_DEVICE_ENV, cuda_visibility

from rcgrpo_tasks.engine.device import is_memory_error, placement, resolve_device
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.ops.config import ConfigError


def _no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_cuda_when_available_else_cpu(monkeypatch):
    import torch

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    _no_cuda(monkeypatch)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")


@pytest.mark.parametrize("setting", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_is_a_config_error(monkeypatch, setting):
    _no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device(setting)


def test_missing_gpu_index_and_bad_values(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match=r"1 CUDA device\(s\)"):
        resolve_device("cuda:1")
    for bad in ("gpu", "cuda:", "cuda:-1", "mps", ""):
        with pytest.raises(ConfigError, match="expected auto | cpu | cuda"):
            resolve_device(bad)


def test_backend_places_model_on_the_resolved_device(tiny_model_dir, monkeypatch):
    backend = HFBackend(tiny_model_dir, device="cpu")
    assert {p.device.type for p in backend.model.parameters()} == {"cpu"}
    assert backend.describe()["device"] == "cpu" and backend.describe()["dtype"] == "float32"
    assert not backend.cuda_graphs  # graphs are a CUDA-only path
    wrapped = HFBackend.from_model(backend.model, backend.tokenizer, cuda_graphs=True)
    assert wrapped.describe()["device"] == "cpu" and not wrapped.cuda_graphs  # from_model keeps the model's device
    _no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        HFBackend(tiny_model_dir, device="cuda")  # refused, not decoded on the CPU


def test_placement_describes_device_and_dtype(tiny_model_dir):
    import torch

    model = HFBackend(tiny_model_dir, device="cpu").model
    assert placement(model) == {"device": "cpu", "dtype": "float32"}
    assert placement(model.to(torch.bfloat16)) == {"device": "cpu", "dtype": "bfloat16"}


def test_memory_errors_are_recognised():
    import torch

    assert is_memory_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_memory_error(RuntimeError("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good()"
                                        " to be true, but got false."))
    assert is_memory_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_memory_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_memory_error(ValueError("out of memory"))  # only runtime errors from the device


@pytest.mark.gpu
def test_backend_on_cuda(tiny_model_dir):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    backend = HFBackend(tiny_model_dir, device="auto", dtype="auto")
    assert backend.model.device.type == "cuda" and backend.cuda_graphs
    info = backend.describe()
    assert info["device"].startswith("cuda:") and info["dtype"] == "bfloat16" and info["device_name"]


def test_test_device_setting_picks_the_gpus_auto_sees():
    """RCGRPO_TEST_DEVICE through CUDA_VISIBLE_DEVICES (conftest): cpu hides every GPU, cuda:N shows the N-th
    visible one alone, auto and cuda change nothing; anything else is refused before a test runs."""
    assert [cuda_visibility(s, None) for s in ("", "auto", " CUDA ", "cpu", "cuda:1")] == [None, None, None, "", "1"]
    assert cuda_visibility("cuda:1", "3,5,7") == "5" and cuda_visibility("cpu", "3,5") == ""
    for bad, visible in (("gpu", None), ("cuda:2", "0,1"), ("cuda:0", "")):
        with pytest.raises(ValueError, match=TEST_DEVICE_ENV):
            cuda_visibility(bad, visible)
