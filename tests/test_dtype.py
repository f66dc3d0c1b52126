"""THE dtype rule (`engine.dtype`): one setting, `compute.cpu_bf16`, decides a CPU's decoding dtype and training
autocast for every stage; `auto` measures once per host and caches; explicit dtypes win; CUDA takes bf16 where
it has it; every stage records what it resolved."""

from __future__ import annotations

import json
import math
import types

import pytest
from helpers import config_from_params

from rcgrpo_tasks.engine import dtype as rule
from rcgrpo_tasks.engine.compute import ComputeConfig
from rcgrpo_tasks.evaluation.accuracy import EvaluateConfig
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.train.rl.config import RLConfig


def test_off_and_on_decide_a_cpu_and_explicit_dtypes_win():
    assert rule.decode_dtype("auto", "cpu") == "float32"  # the committed default: off
    assert rule.decode_dtype("auto", "cpu", "on") == "bfloat16" and rule.train_bf16(None, "cpu", "on") is True
    assert rule.decode_dtype("float32", "cpu", "on") == "float32" and rule.train_bf16(False, "cpu", "on") is False
    assert rule.decode_dtype("bfloat16", "cpu", "off") == "bfloat16" and rule.train_bf16(True, "cpu") is True
    with pytest.raises(ValueError, match="cpu_bf16"):
        rule.decode_dtype("auto", "cpu", "yes")
    with pytest.raises(ConfigError, match="cpu_bf16"):
        config_from_params(ComputeConfig, "compute", **{"cpu_bf16": "maybe"}, where="params.yaml:compute")


def test_cuda_takes_bf16_where_it_has_it_whatever_the_cpu_setting(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert rule.decode_dtype("auto", "cuda", "off") == "bfloat16" and rule.train_bf16(None, "cuda", "off") is True
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert rule.decode_dtype("auto", "cuda", "on") == "float32" and rule.train_bf16(None, "cuda", "on") is False


def test_auto_measures_once_per_host_and_reads_the_cache(tmp_path, monkeypatch):
    """`auto` runs the calibration once, writes it under the host's key and reads it from there after; the
    decision follows the measured speed-ups, decoding and training apart."""
    monkeypatch.setenv("RCGRPO_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(shape):
        calls.append(shape)
        return {"decode_speedup": 1.3, "train_speedup": 0.7, "seconds": 0.0}

    monkeypatch.setattr(rule, "calibrate", fake)
    rule._measured.cache_clear()
    try:
        got = rule.cpu_bf16("auto")
        assert (got["decode"], got["train"]) == (True, False) and "measured" in got["source"]
        rule._measured.cache_clear()
        assert rule.decode_dtype("auto", "cpu", "auto") == "bfloat16" and rule.train_bf16(None, "cpu", "auto") is False
        assert len(calls) == 1  # the second process-level call read the file
        cached = json.loads(rule.cache_file().read_text())
        assert list(cached) == [rule.host_key(rule.SMOLLM2_135M, __import__("torch").get_num_threads())]
    finally:
        rule._measured.cache_clear()


def test_a_speedup_is_the_ratio_of_the_arms_medians_over_alternating_runs(monkeypatch):
    """The calibration's timing on a fake clock (each run of an arm advances it by that run's cost): one warm-up
    each, then the arms alternate, and the speed-up is median(float32) / median(bf16), warm-ups left out."""
    clock, calls = [0.0], []

    def arm(name: str, costs: list[float]):
        left = iter(costs)

        def run():
            calls.append(name)
            clock[0] += next(left)
        return run

    monkeypatch.setattr(rule, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    got = rule._side_by_side(arm("fp32", [50.0, 3.0, 3.0, 5.0]), arm("bf16", [50.0, 1.0, 2.0, 1.0]), reps=3)
    assert got == pytest.approx(3.0)  # median(3, 3, 5) / median(1, 2, 1)
    assert calls == ["fp32", "bf16", "fp32", "bf16", "bf16", "fp32", "fp32", "bf16"]


def test_the_calibration_leaves_the_stages_random_state_and_names_what_it_ran():
    """A real (tiny) calibration: the random model and inputs are drawn off the global generator (a stage that
    calibrates draws the same numbers afterwards), and the record names the shape and threads it ran."""
    import torch

    before = torch.get_rng_state()
    got = rule.calibrate((64, 128, 4, 2, 16), layers=1, rows=2, tokens=32, reps=1)
    assert torch.equal(torch.get_rng_state(), before)
    assert got["shape"] == [64, 128, 4, 2, 16] and got["threads"] == torch.get_num_threads()
    assert all(math.isfinite(got[k]) and got[k] > 0 for k in ("decode_speedup", "train_speedup"))


def test_stages_resolve_through_the_rule(tiny_model_dir):
    """A decoding stage's backend arguments and an RL run's config come out concrete under the setting."""
    decode = config_from_params(EvaluateConfig, "evaluate", dtype="auto").decode
    assert decode.backend_kwargs(config_from_params(ComputeConfig, "compute", device="cpu", cpu_bf16="on"))["dtype"] == "bfloat16"
    assert decode.backend_kwargs(config_from_params(ComputeConfig, "compute", device="cpu"))["dtype"] == "float32"
    rl = config_from_params(RLConfig, "rl").resolved("on", "cpu")
    assert (rl.rollout_dtype, rl.bf16) == ("bfloat16", True)
    assert (config_from_params(RLConfig, "rl").resolved("off", "cpu").rollout_dtype, config_from_params(RLConfig, "rl").resolved("off", "cuda").rollout_dtype) == (
        "float32", "live")
    assert rule.record("off", "cpu", "float32", False) == {"cpu_bf16": "off", "device": "cpu",
                                                           "decode_dtype": "float32", "train_bf16": False}
