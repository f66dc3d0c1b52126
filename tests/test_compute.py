"""Placement of the training stages: the `compute` section, the training device (explicit CPU,
CUDA absent, GPU index), and the micro-batch that fits (halved on a memory error, effective batch kept)."""

from __future__ import annotations

import pytest
import yaml
from helpers import compute_from_params, config_from_params, write_params

from rcgrpo_tasks.engine.compute import load_compute, resolve_compute
from rcgrpo_tasks.engine.device import MemorySplitWarning
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.train.common import placement


def _params(tmp_path, data) -> str:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_compute_section_values_missing_and_unknown_keys(tmp_path):
    with pytest.raises(ConfigError, match="missing section 'compute'"):  # no section: no defaults either
        load_compute(_params(tmp_path, {"sft": {}}))
    with pytest.raises(ConfigError, match=r"params.yaml:compute: missing key\(s\) \['device', 'processes', 'cpu_bf16'\]"):
        load_compute(_params(tmp_path, {"compute": None}))
    assert load_compute(write_params(tmp_path / "params.yaml", {"compute": {"device": "cuda:1"}})).device == "cuda:1"
    with pytest.raises(ConfigError, match=r"params.yaml:compute: unknown key\(s\) \['devices'\]"):
        load_compute(_params(tmp_path, {"compute": {"devices": "cpu"}}))
    with pytest.raises(ConfigError, match=r"params.yaml:compute: device 'gpu': expected auto \| cpu \| cuda"):
        load_compute(write_params(tmp_path / "params.yaml", {"compute": {"device": "gpu"}}))
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_compute(_params(tmp_path, {"compute": "cpu"}))


def test_training_device_never_falls_back(monkeypatch):
    import torch

    assert compute_from_params(device="cpu").resolve() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement.train_device("auto") == torch.device("cpu") and placement.use_cpu(torch.device("cpu"))
    with pytest.raises(ConfigError, match="CUDA is not available"):
        placement.train_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # An explicit cpu on a CUDA host forces the CPU (accelerate would otherwise pick the GPU).
    assert placement.train_device("cpu") == torch.device("cpu") and placement.use_cpu(torch.device("cpu"))
    assert not placement.use_cpu(torch.device("cuda")) and not placement.use_cpu(None)
    assert placement.train_device("cuda") == torch.device("cuda") and placement.train_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=1"):  # the Trainer would train on cuda:0
        placement.train_device("cuda:1")


def test_explicit_cpu_reaches_the_training_arguments(tmp_path):
    import torch

    from rcgrpo_tasks.train.sft import config as sft_config
    from rcgrpo_tasks.train.sft import trainer as sft_trainer

    args = sft_trainer.trainer_args(config_from_params(sft_config.SftConfig, "sft", max_steps=1), tmp_path / "ck", False, torch.device("cpu"))
    assert args.use_cpu and args.device.type == "cpu"


@pytest.mark.parametrize("micro, steps", [(8, [4, 2, 1]), (10, [5, 1]), (6, [3, 1]), (1, [])])
def test_smaller_micro_batch_divides(micro, steps):
    seen, m = [], micro
    while (m := placement.smaller_micro_batch(m)) is not None:
        seen.append(m)
    assert seen == steps


def test_fit_micro_batch_keeps_the_effective_batch():
    import torch

    tried = []

    def attempt(micro, accum):
        tried.append((micro, accum))
        if micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "done"

    with pytest.warns(MemorySplitWarning, match=r"retrying at 4 x 2 .*same effective batch"):
        result = placement.fit_micro_batch(attempt, 8, 1, "sft@x")
    assert result == ("done", 2, 4) and tried == [(8, 1), (4, 2), (2, 4)]
    assert {m * a for m, a in tried} == {8}


def test_fit_micro_batch_gives_up_on_other_errors_and_at_one():
    import torch

    calls = []

    def broken(micro, accum):
        calls.append(micro)
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        placement.fit_micro_batch(broken, 4, 1, "x")
    assert calls == [4]  # not a memory error: no retry

    def never_fits(micro, accum):
        calls.append(micro)
        raise torch.OutOfMemoryError("CUDA out of memory")

    calls.clear()
    with pytest.warns(MemorySplitWarning), pytest.raises(torch.OutOfMemoryError):
        placement.fit_micro_batch(never_fits, 4, 1, "x")
    assert calls == [4, 2, 1]


def test_fit_micro_batch_never_retries_inside_a_multi_process_launch(monkeypatch):
    import torch

    calls = []

    def oom(micro, accum):
        calls.append(micro)
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setenv("WORLD_SIZE", "2")  # a retry on one rank would leave the other waiting in a collective
    with pytest.raises(torch.OutOfMemoryError):
        placement.fit_micro_batch(oom, 4, 1, "x")
    assert calls == [4]


def test_a_cpu_trains_in_float32_unless_told_and_a_gpu_in_bf16_where_it_has_it(monkeypatch):
    """`bf16: null` resolved with the CPU setting `off` never autocasts a CPU run; an explicit flag wins
    everywhere; a GPU takes bf16 where it has it (the rule itself: tests/test_dtype.py)."""
    import torch

    cpu, gpu = torch.device("cpu"), torch.device("cuda")

    def bf16(flag, device) -> bool:
        return resolve_compute(compute_from_params(), train=flag, trains=True, device=device).train_bf16

    assert bf16(None, cpu) is False
    assert bf16(True, cpu) is True and bf16(False, gpu) is False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert bf16(None, gpu) is True
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert bf16(None, gpu) is False
