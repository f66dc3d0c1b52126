"""THE dtype rule (`engine.dtype`): one setting, `compute.cpu_bf16`, decides a CPU's decoding dtype and training
autocast for every stage; `auto` measures once per host and caches; explicit dtypes win; CUDA takes bf16 where
it has it; every stage records what it resolved."""

from __future__ import annotations

import json
import math
import types

import pytest
from helpers import compute_from_params, config_from_params

from rcgrpo_tasks.engine import dtype as rule
from rcgrpo_tasks.engine.compute import ComputeConfig, resolve_compute
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.train.rl.config import RLConfig


def _resolve(device="cpu", setting="off", **requests):
    return resolve_compute(compute_from_params(device=device, cpu_bf16=setting), **requests)


def test_off_and_on_decide_a_cpu_and_explicit_dtypes_win():
    off = _resolve(decode="auto", trains=True)
    assert (off.decode_dtype, off.train_bf16, off.decode_source, off.train_source) == (
        "float32", False, "params off", "params off")  # the committed default
    on = _resolve(setting="on", decode="auto", trains=True)
    assert (on.decode_dtype, on.train_bf16, on.decode_source, on.measured) == ("bfloat16", True, "params on", None)
    explicit = _resolve(setting="on", decode="float32", train=False, trains=True)
    assert (explicit.decode_dtype, explicit.train_bf16, explicit.decode_source, explicit.train_source) == (
        "float32", False, "explicit", "explicit")
    assert _resolve(decode="bfloat16", train=True, trains=True).record() == {
        "device": "cpu", "cpu_bf16": "off", "decode_dtype": "bfloat16", "train_bf16": True,
        "decode_source": "explicit", "train_source": "explicit", "measured": None}
    nothing = _resolve()  # a stage that neither decodes nor trains resolves neither
    assert (nothing.decode_dtype, nothing.train_bf16, nothing.decode_source) == (None, None, None)
    with pytest.raises(ValueError, match="cpu_bf16"):
        rule.cpu_bf16("yes")
    with pytest.raises(ConfigError, match="cpu_bf16"):
        config_from_params(ComputeConfig, "compute", **{"cpu_bf16": "maybe"}, where="params.yaml:compute")


def test_cuda_takes_bf16_where_it_has_it_whatever_the_cpu_setting(monkeypatch):
    import torch

    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    got = resolve_compute(compute_from_params(cpu_bf16="off"), decode="auto", trains=True, device=gpu)
    assert (got.decode_dtype, got.train_bf16, got.decode_source, got.device) == ("bfloat16", True, "gpu", "cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    got = resolve_compute(compute_from_params(cpu_bf16="on"), decode="auto", trains=True, device=gpu)
    assert (got.decode_dtype, got.train_bf16) == ("float32", False)
    rl = resolve_compute(compute_from_params(), decode="auto", gpu_decode="live", device=gpu)
    assert (rl.decode_dtype, rl.decode_source) == ("live", "gpu")  # RL's rollouts: the training model itself


def _fake_calibration(monkeypatch, tmp_path, decode: float, train: float) -> list:
    monkeypatch.setenv("RCGRPO_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(shape):
        calls.append(shape)
        return {"decode_speedup": decode, "train_speedup": train, "seconds": 0.0}

    monkeypatch.setattr(rule, "calibrate", fake)
    rule._measured.cache_clear()
    return calls


def test_auto_measures_once_per_host_and_reads_the_cache(tmp_path, monkeypatch):
    """`auto` runs the calibration once, writes it under the host's key and reads it from there after; the
    decision follows the measured speed-ups, decoding and training apart, and the resolution carries them."""
    calls = _fake_calibration(monkeypatch, tmp_path, 1.3, 0.7)
    try:
        got = _resolve(setting="auto", decode="auto", trains=True)
        assert (got.decode_dtype, got.train_bf16, got.decode_source) == ("bfloat16", False, "measured auto")
        assert (got.measured["decode_speedup"], got.measured["train_speedup"]) == (1.3, 0.7)
        assert got.measured["min_speedup"] == rule.AUTO_MIN_SPEEDUP and got.measured["cache"] == str(rule.cache_file())
        rule._measured.cache_clear()
        assert _resolve(setting="auto", decode="auto").decode_dtype == "bfloat16"
        assert len(calls) == 1  # the second process-level call read the file
        cached = json.loads(rule.cache_file().read_text())
        assert list(cached) == [rule.host_key(rule.SMOLLM2_135M, __import__("torch").get_num_threads())]
        assert _resolve(setting="auto", decode="float32").measured is None  # nothing asked `auto`: nothing measured
    finally:
        rule._measured.cache_clear()


@pytest.mark.parametrize(("speedup", "bf16"), [(1.0, False), (1.09, False), (1.1, True), (1.5, True)])
def test_auto_switches_only_at_a_measured_speedup_of_at_least_the_threshold(tmp_path, monkeypatch, speedup, bf16):
    _fake_calibration(monkeypatch, tmp_path, speedup, speedup)
    try:
        got = _resolve(setting="auto", decode="auto", trains=True)
        assert (got.decode_dtype == "bfloat16", got.train_bf16) == (bf16, bf16)
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
    got = rule.side_by_side(arm("fp32", [50.0, 3.0, 3.0, 5.0]), arm("bf16", [50.0, 1.0, 2.0, 1.0]), reps=3)
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


def test_runs_resolve_once_and_lower_layers_refuse_an_unresolved_setting(tiny_model_dir):
    """A training run's config comes out concrete from the one resolution; the backends, the rollout snapshot
    and the trainer's autocast refuse `auto` / null instead of silently taking float32."""
    from rcgrpo_tasks.engine.hf import HFBackend
    from rcgrpo_tasks.train.common import placement
    from rcgrpo_tasks.train.rl.rollout_policy import rollout_dtype
    from rcgrpo_tasks.train.sft.config import SftConfig

    rl = config_from_params(RLConfig, "rl")
    on = rl.resolved(rl.compute_for(compute_from_params(device="cpu", cpu_bf16="on")))
    assert (on.rollout_dtype, on.bf16) == ("bfloat16", True)
    off = rl.resolved(rl.compute_for(compute_from_params(device="cpu")))
    assert (off.rollout_dtype, off.bf16) == ("float32", False)
    sft = config_from_params(SftConfig, "sft")
    assert sft.resolved(sft.compute_for(compute_from_params(device="cpu", cpu_bf16="on"))).bf16 is True
    for refused in (lambda: HFBackend(tiny_model_dir, dtype="auto", device="cpu"), lambda: rollout_dtype("auto"),
                    lambda: placement.resolved_bf16(None)):
        with pytest.raises(ValueError, match="unresolved"):
            refused()
