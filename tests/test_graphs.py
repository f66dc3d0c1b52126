"""CUDA graphs of the hf decode step: which step loop a session runs, and the capture's preconditions for the
policy RL decodes on a GPU (the live PEFT model, LoRA + trainable reward-token rows), checked on the device
under test, the CPU included: no host data made into tensors, no host reads, nothing off the device, and the
same pre-existing tensors read at every step (a replay reads what the capture read)."""

from __future__ import annotations

import contextlib

import pytest
from helpers import HIGH, LEVELS, LOW, config_from_params, device_under_test

from rcgrpo_tasks.engine import graphs, hf
from rcgrpo_tasks.engine.backend import SamplingParams
from rcgrpo_tasks.engine.graphs import CPU, EAGER, GRAPH, CaptureCheck, decode_path, graphs_wanted
from rcgrpo_tasks.engine.hf import HFBackend


def test_the_graph_path_is_cudas_default_and_never_the_cpus():
    # `HFBackend.from_model(model, tok)` (the RL rollouts) and `HFBackend(..., device="cuda")` leave it None
    assert decode_path("cuda", graphs_wanted("cuda", None)) == GRAPH
    assert decode_path("cuda", graphs_wanted("cuda", True)) == GRAPH
    assert decode_path("cuda", graphs_wanted("cuda", False)) == EAGER
    assert {decode_path("cpu", graphs_wanted("cpu", s)) for s in (None, True, False)} == {CPU}
    assert not graphs_wanted("cpu", True)


def _rl_policy(model_dir, tok):
    """The policy RL samples from on a GPU (`rollout_dtype: auto` there is the live model): the RL LoRA with the
    reward tokens' rows trainable, as `rl_trainer.rl_lora` builds it, on the device under test."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from rcgrpo_tasks.train.rl import config as rl_config
    from rcgrpo_tasks.train.rl import trainer as rl_trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device_under_test())
    torch.manual_seed(3)
    config = rl_trainer.rl_lora(config_from_params(rl_config.RLConfig, "rl", lora_r=4, lora_alpha=8), model, tok, LEVELS, "rc")
    policy = get_peft_model(model, config)
    with torch.no_grad():  # trained-looking rows and LoRA: what decodes must be what was trained
        for name, prm in policy.named_parameters():
            if "lora_B" in name or "trainable_tokens_delta" in name:
                prm.normal_(0, 0.2)
    return policy.eval()


@pytest.fixture(scope="module")
def rl_policy(rl_env):
    from transformers import AutoTokenizer

    _, model_dir = rl_env
    tok = AutoTokenizer.from_pretrained(model_dir)
    return _rl_policy(model_dir, tok), tok


def _prompts(tok):
    high, low = tok.convert_tokens_to_ids(HIGH), tok.convert_tokens_to_ids(LOW)
    return [[5, 6, 7, high, 8, 9], [5, 6, 7, low, 8], [11, 12, high]]


class _CheckedSteps:
    """`StepGraph`'s stand-in: the same calls (warm-up, capture, then one per replay), each run eagerly under a
    `CaptureCheck`, with the model's trainable-token layers patched as StepGraph patches them for capture."""

    made: list = []

    def __init__(self, step, device, model=None):
        self.step, self.device, self.checks = step, device, []
        self.patch = contextlib.ExitStack()
        self.patch.enter_context(graphs.device_side_indices(model))
        _CheckedSteps.made.append(self)

    def run(self) -> None:
        with CaptureCheck(self.device) as check:
            self.step()
        self.checks.append(check)


def _checked_decode(backend, prompts, sampling, monkeypatch):
    """`backend.generate` on the graph path with `_CheckedSteps` in place of the capture: (outputs, steppers)."""
    _CheckedSteps.made = []
    with monkeypatch.context() as m:
        m.setattr(hf, "decode_path", lambda device_type, cuda_graphs: GRAPH)
        m.setattr(hf, "StepGraph", _CheckedSteps)
        try:
            outs = backend.generate(prompts, sampling)
        finally:
            for s in _CheckedSteps.made:
                s.patch.close()
    return outs, list(_CheckedSteps.made)


def test_the_rl_policys_decode_step_meets_the_capture_preconditions(rl_policy, monkeypatch):
    policy, tok = rl_policy
    prompts, sampling = _prompts(tok), SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    backend = HFBackend.from_model(policy, tok)
    outs, steppers = _checked_decode(backend, prompts, sampling, monkeypatch)
    assert len(steppers) == 1 and len(steppers[0].checks) == max(len(o.token_ids) for o in outs) - 1 >= 3
    checks = steppers[0].checks
    assert [c.hazards for c in checks] == [[]] * len(checks)
    capture = checks[1].reads  # the warm-up may make what later steps read; the capture's reads are replayed
    for c in checks[2:]:
        assert c.reads.keys() == capture.keys(), {k: v for k, v in (c.reads.items() ^ capture.items())}
    assert not any("get_merged_weights" in vars(m) for m in policy.modules())  # the patch is undone
    # The patched layers compute what PEFT's own do: the same tokens as the default path on this device.
    plain = HFBackend.from_model(policy, tok, cuda_graphs=False).generate(prompts, sampling)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for a, b in zip(outs, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_the_check_finds_pefts_host_side_row_index(rl_policy, monkeypatch):
    """Without `device_side_indices`, PEFT's trainable-token layers make their row index from a Python list at
    every step: the host-to-device copy that made the capture fail and the RL rollouts decode eagerly."""
    policy, tok = rl_policy
    monkeypatch.setattr(graphs, "device_side_indices", lambda model: contextlib.nullcontext([]))
    _, steppers = _checked_decode(HFBackend.from_model(policy, tok), _prompts(tok),
                                  SamplingParams(temperature=0.0, max_new_tokens=3), monkeypatch)
    hazards = [h for c in steppers[0].checks for h in c.hazards]
    assert hazards and all("lift_fresh" in h or "cpu tensor" in h for h in hazards)


def test_device_side_indices_merge_the_same_rows_and_are_undone(rl_policy):
    import torch

    policy, tok = rl_policy
    layers = [m for m in policy.modules() if graphs._trainable_tokens_layer(m)]
    assert layers  # the embedding (and the LM head tied to it)
    ids = torch.tensor([_prompts(tok)[0]], device=policy.device)
    with torch.no_grad():
        before = policy(ids).logits
        with graphs.device_side_indices(policy) as made:
            assert len(made) == len(layers) and all(t.device == policy.device for t in made)
            patched = policy(ids).logits
        after = policy(ids).logits
    assert torch.equal(patched, before) and torch.equal(after, before)
    assert not any("get_merged_weights" in vars(m) for m in layers)


def test_capture_check_flags_host_data_host_reads_and_other_devices():
    import torch

    x = torch.zeros(4)
    with CaptureCheck(x.device) as check:
        y = x + torch.tensor([1.0, 2.0, 3.0, 4.0])  # host data
        bool(y.any())  # a host read
        torch.where(y > 0, y, 0.0)  # a Python number operand: fine
    assert len(check.hazards) == 2 and "lift_fresh" in check.hazards[0] and "_local_scalar_dense" in check.hazards[1]
    assert any("(4,)" in v for v in check.reads.values())  # x: read, made before
    with CaptureCheck(torch.device("meta")) as check:
        x.mul_(2)  # a CPU tensor read by a step that runs on another device
    assert check.hazards and "reads a cpu tensor (4,)" in check.hazards[0]


@pytest.mark.gpu
def test_rl_policy_decodes_from_a_captured_graph_on_cuda(rl_policy, monkeypatch, recwarn):
    policy, tok = rl_policy
    if policy.device.type != "cuda":
        pytest.skip("needs CUDA as the device under test")
    made = []

    class Recorded(graphs.StepGraph):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(hf, "StepGraph", Recorded)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=2)
    outs = HFBackend.from_model(policy, tok).generate(_prompts(tok), sampling)
    assert len(made) == 1 and made[0].graph is not None and not made[0].eager and made[0].calls >= 3
    assert not [w for w in recwarn if "CUDA graph capture" in str(w.message)]
    eager = HFBackend.from_model(policy, tok, cuda_graphs=False).generate(_prompts(tok), sampling)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
