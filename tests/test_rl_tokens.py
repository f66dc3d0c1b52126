"""Reward tokens RL can move and RL that is never a silent no-op: the tokens' embedding rows train under the
RL LoRA (a tiny Qwen2-shaped model with an untied, padded embedding), a reward undefined under the protocol
is refused, rollouts the model ended count as finished for TRL, and a step with nothing to train on moves no
weight under DeepSpeed either (where DeepSpeed runs on the CPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import HIGH, LEVELS, capture_trainer, compute_from_params, config_from_params, free_port_base
from test_rl import PROTOCOL, TEST_RL, _spec

from rcgrpo import tokens as reward_tokens
from rcgrpo_tasks.engine.backend import SamplingParams, ScriptedBackend, stop_token_ids
from rcgrpo_tasks.engine.rollout import run_seeded_groups
from rcgrpo_tasks.env.multi_turn import entries as multi_turn
from rcgrpo_tasks.env.prompt import PromptConfig
from rcgrpo_tasks.env.single_turn import entries as single_turn
from rcgrpo_tasks.ops.config import ConfigError
from rcgrpo_tasks.ops.outputs import write_json, write_jsonl
from rcgrpo_tasks.train.rl import config as rl_config
from rcgrpo_tasks.train.rl import rollout as rl_rollout
from rcgrpo_tasks.train.rl import rollout_policy
from rcgrpo_tasks.train.rl import run as rl_run

SPARE = 6
"""Embedding rows beyond the tokenizer (Qwen2.5 ships 152,064 rows for ~151,665 tokens)."""


def _padded_qwen(tokenizer_dir: Path):
    """(model, tokenizer): a 2-layer Qwen2 with untied embeddings of len(tokenizer) + SPARE rows."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(vocab_size=len(tok) + SPARE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config), tok


@pytest.fixture(scope="module")
def qwen_env(tmp_path_factory, tokenizer_dir):
    """The padded Qwen2 with the reward tokens added (spare rows, mean init), saved; a 4-entry train split."""
    root = tmp_path_factory.mktemp("qwen")
    model, tok = _padded_qwen(tokenizer_dir)
    before = {n: m.weight.detach().clone() for n, m in (("in", model.get_input_embeddings()),
                                                        ("out", model.get_output_embeddings()))}
    ids = reward_tokens.add_reward_tokens(model, tok, LEVELS, seed=0, init="mean_resizing", levels=LEVELS)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    entries = multi_turn.load_entries(["base"])[:6]
    write_jsonl(root / "entries.jsonl", (e.to_json() for e in entries))
    write_json(root / "split.json", {"train": [e.id for e in entries[:4]], "test": [e.id for e in entries[4:]]})
    return root, model, tok, ids, before


def test_spare_rows_get_the_mean_init_and_nothing_shrinks(qwen_env):
    import torch

    _, model, tok, ids, before = qwen_env
    n_tok = len(tok)
    assert all(len(tok) - len(LEVELS) <= i < n_tok for i in ids)  # taken from the spare rows
    for name, matrix in (("in", model.get_input_embeddings()), ("out", model.get_output_embeddings())):
        weight = matrix.weight.detach()
        assert weight.shape == before[name].shape  # no resize: the rows were there
        real = before[name][: n_tok - len(LEVELS)]
        for i in ids:
            assert torch.allclose(weight[i], real.mean(0), atol=1e-3)  # the mean, not the untrained spare row
            assert not torch.allclose(weight[i], before[name][i], atol=1e-2)
        untouched = [i for i in range(weight.shape[0]) if i not in ids]
        torch.testing.assert_close(weight[untouched], before[name][untouched], rtol=0, atol=0)


def _scripted_spread(monkeypatch) -> None:
    from rcgrpo_tasks.engine import rollout as engine

    real = engine.run_seeded_groups

    def run(backend, groups, protocol_cfg, provenance=None):
        out = real(backend, groups, protocol_cfg, provenance)
        for trajs in out:
            for t in trajs:
                t.score = {**t.score, "paper_reward": float(t.reward_token == HIGH)}
        return out

    monkeypatch.setattr(engine, "run_seeded_groups", run)


def test_rl_trains_the_reward_token_rows_saves_and_merges_them(qwen_env, monkeypatch):
    """RC-GRPO under LoRA: both reward tokens' input and output rows move, no other row does; the reference
    (adapter off) keeps the init rows; the rollout snapshot follows them; `rl_adapter` holds them and,
    loaded on the init, reproduces the merged policy."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, TrainerCallback

    root, _, tok, ids, _ = qwen_env
    _scripted_spread(monkeypatch)
    box = capture_trainer(monkeypatch)
    seen = {}

    class AtTheEnd(TrainerCallback):  # before the policy is merged and saved
        def on_train_end(self, args, state, control, **kwargs):
            live = box["trainer"].accelerator.unwrap_model(box["trainer"].model)
            with torch.no_grad():
                seen["live"] = live.get_input_embeddings().weight[ids].clone()
                # the refresh
                snap = rollout_policy.policy_snapshot(live, torch.float32, box["rollout"].snapshot)
                seen["snapshot"] = snap.get_input_embeddings().weight[ids].clone()
                with live.disable_adapter():
                    seen["reference"] = live.get_input_embeddings().weight[ids].clone()

    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "learning_rate": 0.05, "p_high": 0.5,
                                    "token_draw": "stratified", "rollout_dtype": "float32"})
    spec = _spec(root, root / "model", "tokens", "rctp", "rc_grpo")
    rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, callbacks=[AtTheEnd()], track=False, compute=compute_from_params())
    init, out = load_file(str(root / "model" / "model.safetensors")), load_file(str(spec.out / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        moved = (init[key] != out[key]).any(dim=1).nonzero().flatten().tolist()
        assert sorted(moved) == sorted(ids), key
    saved = load_file(str(spec.out / "rl_adapter" / "adapter_model.safetensors"))
    assert any("trainable_tokens" in k for k in saved) and all(v.shape[0] < 1000 for v in saved.values())
    seen = {k: v.cpu() for k, v in seen.items()}  # the run's device: the device under test
    torch.testing.assert_close(seen["reference"], init["model.embed_tokens.weight"][ids])
    torch.testing.assert_close(seen["live"], out["model.embed_tokens.weight"][ids])
    torch.testing.assert_close(seen["snapshot"], seen["live"])
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "model"), spec.out / "rl_adapter")
    merged = AutoModelForCausalLM.from_pretrained(spec.out)
    x = torch.tensor([[5, ids[0], 17, ids[1], 3]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, merged(x).logits, atol=1e-4, rtol=1e-4)


def test_rc_frozen_keeps_the_init_token_rows_and_trains_the_rest(qwen_env, monkeypatch):
    """The ablation `rc_frozen`: RC-GRPO's groups and advantage, the RL LoRA without trainable token rows, so
    the merged policy's reward-token rows are the init's; under full fine-tuning it is refused."""
    from safetensors.torch import load_file

    root, _, tok, ids, _ = qwen_env
    _scripted_spread(monkeypatch)
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "learning_rate": 0.05,
                                                            "token_draw": "stratified", "rollout_dtype": "float32"})
    spec = _spec(root, root / "model", "frozen", "rctp", "rc_frozen")
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, track=False, compute=compute_from_params())
    assert spec.mode == "rc" and summary["conditioning"] == "rc"
    init, out = load_file(str(root / "model" / "model.safetensors")), load_file(str(spec.out / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert init[key][ids].equal(out[key][ids]), key
    assert any(not init[k].equal(out[k]) for k in init if "q_proj" in k)
    saved = load_file(str(spec.out / "rl_adapter" / "adapter_model.safetensors"))
    assert not any("trainable_tokens" in k for k in saved)
    with pytest.raises(ConfigError, match="rc_frozen"):
        rl_run.train_rl(rl_config.replace(cfg, full_finetune=True), PROTOCOL, LEVELS,
                        _spec(root, root / "model", "frozen-ft", "rctp", "rc_frozen"), track=False,
                        compute=compute_from_params())


@pytest.mark.parametrize("reward", ["official_verdict", "partial_credit"])
def test_a_reward_undefined_under_the_protocol_is_refused(reward):
    multi = multi_turn.load_entries(["base"])[:2]
    cfg = config_from_params(rl_config.RLConfig, "rl", reward=reward)
    with pytest.raises(ConfigError, match=f"rl.reward: {reward}.*prompt.protocol: paper"):
        rl_config.check_reward(cfg, config_from_params(PromptConfig, "prompt", protocol="paper", system_prompt="bfcl").protocol_config(2), multi)
    rl_config.check_reward(cfg, config_from_params(PromptConfig, "prompt", protocol="official", system_prompt="bfcl").protocol_config(2), multi)
    single = single_turn.load_entries(single_turn.DEFAULT_CATEGORIES[:1])[:2]
    rl_config.check_reward(cfg, config_from_params(PromptConfig, "prompt", protocol="paper", system_prompt="bfcl").protocol_config(2), single)  # defined for one turn
    rl_config.check_reward(config_from_params(rl_config.RLConfig, "rl"), config_from_params(PromptConfig, "prompt", protocol="paper", system_prompt="bfcl").protocol_config(2), multi)


def test_rollouts_the_model_ended_count_as_finished_for_trl(tok):
    """`done()` ends the episode on the model's end-of-turn token: the TRL completion stops there (finished
    under TRL's EOS test once the end-of-turn ids are its EOS ids); a rollout cut by the output budget keeps
    its environment tail and counts as truncated."""
    entry = multi_turn.load_entries(["base"])[0]
    scripts = {0: ["[done()]"], 1: ["[ls()]", "[ls()]"]}
    backend = ScriptedBackend(tok, lambda key, step, ids: scripts[key][step] if step < len(scripts[key]) else "")
    protocol = config_from_params(PromptConfig, "prompt", system_prompt="short").protocol_config(2)
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",)})
    rollout = rl_rollout.EngineRollout(cfg, protocol, "none", LEVELS, {entry.id: entry}, tok)
    trajs = run_seeded_groups(backend, [(entry, [None, None], SamplingParams(seed=0))], protocol)[0]
    assert [t.termination for t in trajs] == ["done", "step_limit"]
    fields = rollout.to_trl(trajs)
    eos = set(stop_token_ids(tok)) | {tok.pad_token_id}  # what `build_trainer` makes TRL's EOS ids
    truncated = [ids[-1] not in eos for ids in fields["completion_ids"]]  # TRL's `is_truncated`
    assert truncated == [False, True]
    done = fields["completion_ids"][0]
    assert fields["env_mask"][0][-1] == 1 and len(done) < len(trajs[0].token_ids) - trajs[0].prompt_len
    assert len(fields["logprobs"][0]) == len(fields["env_mask"][0]) == len(done)


def _one_process_group(monkeypatch) -> None:
    """The environment of a one-process torch.distributed group, as DeepSpeed needs even alone, on a free port:
    another module may run beside this one (pytest-xdist)."""
    port = str(free_port_base(span=1))
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_a_skipped_step_moves_no_weight_under_deepspeed(rl_env, monkeypatch, tmp_path):
    """Dynamic sampling with every group flat, under DeepSpeed (ZeRO-2, on the CPU): accelerate steps the
    optimizer inside `backward`, so the step must skip its backward; weights and the engine's step count stay."""
    from safetensors.torch import load_file

    from rcgrpo_tasks.engine import rollout as engine

    real = engine.run_seeded_groups

    def flat(backend, groups, protocol_cfg, provenance=None):
        out = real(backend, groups, protocol_cfg, provenance)
        for trajs in out:
            for t in trajs:
                t.score = {**t.score, "paper_reward": 0.0}
        return out

    monkeypatch.setattr(engine, "run_seeded_groups", flat)
    _one_process_group(monkeypatch)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
                              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}))
    root, model_dir = rl_env
    box = capture_trainer(monkeypatch)
    cfg = config_from_params(rl_config.RLConfig, "rl", **{**TEST_RL, "categories": ("base",), "max_steps": 1, "deepspeed": str(ds),
                                    "full_finetune": True, "dynamic_max_rounds": 1, "bf16": False})
    spec = _spec(root, model_dir, "ds-skip", "sft", "dynamic")
    summary = rl_run.train_rl(cfg, PROTOCOL, LEVELS, spec, track=False, compute=compute_from_params())
    trainer = box["trainer"]
    assert trainer.is_deepspeed_enabled
    assert trainer.model_wrapped.global_steps == 0  # DeepSpeed's own optimizer step count
    assert summary["total_step_skipped"] == 1
    before, after = load_file(str(model_dir / "model.safetensors")), load_file(str(spec.out / "model.safetensors"))
    assert all(before[k].equal(after[k]) for k in before if k in after)


def test_lora_reward_token_rows_under_zero3_are_refused(tmp_path):
    """PEFT gathers ZeRO-3-partitioned trainable-token rows on CUDA only: refused before anything loads, naming
    the fields; full fine-tuning (the paper's ZeRO-3 setup) and runs without a token are not."""
    zero3, zero2 = tmp_path / "z3.json", tmp_path / "z2.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    zero2.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match="rl.deepspeed: .*ZeRO-3 and rl.full_finetune is false"):
        rl_config.check_deepspeed(config_from_params(rl_config.RLConfig, "rl", deepspeed=str(zero3)), "rc")
    rl_config.check_deepspeed(config_from_params(rl_config.RLConfig, "rl", deepspeed=str(zero3)), "none")
    rl_config.check_deepspeed(config_from_params(rl_config.RLConfig, "rl", deepspeed=str(zero3), full_finetune=True), "fixed")
    rl_config.check_deepspeed(config_from_params(rl_config.RLConfig, "rl", deepspeed=str(zero2)), "rc")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("init", ["mean_resizing", "apart"])
def test_reward_tokens_on_a_zero3_sharded_padded_model(tokenizer_dir, tmp_path, monkeypatch, init):
    """Under ZeRO-3 the embedding loads partitioned (local shape 0): the vocabulary must not shrink and the
    rows must get the same init as without DeepSpeed (CPU, one process)."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM, TrainingArguments
    from transformers.integrations import is_deepspeed_zero3_enabled

    model, tok = _padded_qwen(tokenizer_dir)
    rows = model.get_input_embeddings().weight.shape[0]
    model.save_pretrained(tmp_path / "m")
    plain_tok = type(tok).from_pretrained(tokenizer_dir)
    ids = reward_tokens.add_reward_tokens(model, plain_tok, LEVELS, seed=0, init=init, levels=LEVELS)
    expected = [model.get_input_embeddings().weight.detach()[ids], model.get_output_embeddings().weight.detach()[ids]]
    _one_process_group(monkeypatch)
    ds = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1, "train_batch_size": 1}
    args = TrainingArguments(output_dir=str(tmp_path / "o"), deepspeed=ds, report_to=[])  # noqa: F841 (keeps ZeRO-3 on)
    assert is_deepspeed_zero3_enabled()
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    weight = sharded.get_input_embeddings().weight
    assert weight.shape[0] == 0 and weight.ds_shape[0] == rows  # partitioned
    got = reward_tokens.add_reward_tokens(sharded, tok, LEVELS, seed=0, init=init, levels=LEVELS)
    assert got == ids and reward_tokens.embedding_rows(sharded) == rows
    mats = [sharded.get_input_embeddings().weight, sharded.get_output_embeddings().weight]
    with deepspeed.zero.GatheredParameters(mats):
        for m, e in zip(mats, expected):
            assert m.shape[0] == rows  # nothing shrank
            torch.testing.assert_close(m.detach()[ids].cpu(), e)  # ZeRO-3 gathers onto its accelerator
