"""A reward token the model can learn: the added rows start apart (seeded) or at the mean
(today's setting, reproduced exactly), and train at `token_lr_multiplier` x the base lr: PEFT's
trainable-token rows in their own optimizer group (LoRA), or the rows' steps scaled (full fine-tuning)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import HIGH, LEVELS, LOW, TINY_SFT, chat, config_from_params, resolved, tiny_sft_config

from rcgrpo import tokens as reward_tokens
from rcgrpo_tasks.ops.outputs import write_jsonl
from rcgrpo_tasks.train.common import adapters
from rcgrpo_tasks.train.sft import config as sft_config
from rcgrpo_tasks.train.sft import rows as sft_rows
from rcgrpo_tasks.train.sft import trainer as sft_trainer


def _with_tokens(model_dir: Path, init: str, seed: int = 0, untied: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    kwargs = {"tie_word_embeddings": False} if untied else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    ids = reward_tokens.add_reward_tokens(model, tok, LEVELS, init=init, seed=seed, levels=LEVELS)
    return model, tok, ids


def _cos(a, b) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def test_apart_init_starts_the_reward_tokens_apart_and_is_seeded(tiny_model_dir):
    import torch

    model, tok, ids = _with_tokens(tiny_model_dir, "apart")
    emb = model.get_input_embeddings().weight.detach()
    old = emb[: ids[0]]
    mu, r = old.mean(0), (old - old.mean(0)).norm(dim=1).pow(2).mean().sqrt()
    low, high = emb[ids[0]], emb[ids[1]]
    assert _cos(low, high) < -0.9  # antipodal around the mean (|mu| << r in a random-init model)
    for row in (low, high):  # as far from the mean as a typical real token
        assert float((row - mu).norm() / r) == pytest.approx(1.0, rel=1e-4)
    again, _, _ = _with_tokens(tiny_model_dir, "apart")
    torch.testing.assert_close(again.get_input_embeddings().weight[ids], emb[ids], rtol=0, atol=0)
    other, _, _ = _with_tokens(tiny_model_dir, "apart", seed=1)
    assert not torch.allclose(other.get_input_embeddings().weight[ids], emb[ids])
    assert tok(HIGH, add_special_tokens=False)["input_ids"] == [ids[1]]
    # Today's init puts both rows at the mean: one vector to the model.
    same, _, ids2 = _with_tokens(tiny_model_dir, "mean_resizing")
    rows = same.get_input_embeddings().weight.detach()[ids2]
    assert ids2 == ids and _cos(rows[0], rows[1]) > 0.99


def test_words_init_starts_each_token_at_the_word_it_names(tiny_model_dir):
    """`words`: <|low_reward|> starts at the embedding of " low" (the mean of its pieces), <|high_reward|> at
    " high"; the rows differ from each other and from the mean init."""
    import torch

    assert reward_tokens.token_word("<|high_reward|>") == "high" and reward_tokens.token_word("<|mid_reward|>") == "mid"
    model, tok, ids = _with_tokens(tiny_model_dir, "words")
    emb = model.get_input_embeddings().weight.detach()
    for token, row in zip(LEVELS, ids):
        pieces = tok(" " + reward_tokens.token_word(token), add_special_tokens=False)["input_ids"]
        torch.testing.assert_close(emb[row], emb[pieces].mean(0), rtol=0, atol=1e-6)
    assert not torch.allclose(emb[ids[0]], emb[ids[1]])


def test_apart_init_of_untied_heads_spreads_the_output_rows_too(tiny_model_dir):
    model, _, ids = _with_tokens(tiny_model_dir, "apart", untied=True)
    inp = model.get_input_embeddings().weight.detach()[ids]
    out = model.get_output_embeddings().weight.detach()[ids]
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert _cos(inp[0], inp[1]) < -0.9 and _cos(out[0], out[1]) < -0.9


def test_default_token_settings_are_todays(tiny_model_dir, tmp_path):
    """mean_resizing + multiplier 1.0 = the code before the options: the same rows (plain resize under the
    seed), the Trainer's own optimizer groups, no step hooks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = config_from_params(sft_config.SftConfig, "sft")
    assert (cfg.reward_token_init, cfg.token_lr_multiplier) == ("mean_resizing", 1.0)
    model, _, ids = _with_tokens(tiny_model_dir, cfg.reward_token_init)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"extra_special_tokens": list(LEVELS)}, replace_extra_special_tokens=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ref.resize_token_embeddings(len(tok))
    torch.testing.assert_close(model.get_input_embeddings().weight, ref.get_input_embeddings().weight, rtol=0, atol=0)
    rows = sft_rows.load_rows(_dataset(tmp_path), LEVELS, True)
    trainer = sft_trainer.build_trainer(resolved(tiny_sft_config(max_steps=1)), tiny_model_dir, rows, LEVELS, tmp_path / "ck")
    optimizer = trainer.create_optimizer()
    assert len(optimizer.param_groups) == 2 and not any("rcgrpo_token_rows" in g for g in optimizer.param_groups)
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def _dataset(tmp_path: Path) -> Path:
    path = tmp_path / "rctp.jsonl"
    write_jsonl(path, [chat(i, HIGH if i % 2 else LOW) for i in range(8)])
    return path


def _token_step(tiny_model_dir, tmp_path, name: str, **overrides):
    """Rows of the reward tokens (and of two ordinary tokens) before and after ONE optimizer step."""
    rows = sft_rows.load_rows(_dataset(tmp_path), LEVELS, True)
    trainer = sft_trainer.build_trainer(resolved(tiny_sft_config(max_steps=1, **overrides)), tiny_model_dir, rows, LEVELS,
                                        tmp_path / name)
    ids = list(trainer.token_ids)

    def token_rows():
        inner = trainer.accelerator.unwrap_model(trainer.model)
        deltas = adapters.trainable_token_params(inner)
        if deltas:
            return deltas[0].detach().clone()
        return inner.get_input_embeddings().weight.detach()[ids + [5, 7]].clone()

    before = token_rows()
    trainer.train()
    return trainer, before, token_rows()


def test_token_lr_multiplier_gives_the_lora_token_rows_k_times_the_lr(tiny_model_dir, tmp_path):
    import torch

    _, b1, a1 = _token_step(tiny_model_dir, tmp_path, "k1")
    trainer, b4, a4 = _token_step(tiny_model_dir, tmp_path, "k4", token_lr_multiplier=4.0)
    torch.testing.assert_close(b1, b4)
    ratio = float((a4 - b4).norm() / (a1 - b1).norm())
    assert ratio == pytest.approx(4.0, rel=1e-3)
    groups = trainer.optimizer.param_groups
    token = [g for g in groups if g.get("rcgrpo_token_rows")]
    assert len(token) == 1 and len(token[0]["params"]) == 1
    assert token[0]["initial_lr"] == pytest.approx(4.0 * TINY_SFT["learning_rate"])
    assert all(g["initial_lr"] == pytest.approx(TINY_SFT["learning_rate"]) for g in groups if g not in token)


def test_token_lr_multiplier_scales_the_rows_steps_in_full_finetuning(tiny_model_dir, tmp_path):
    import torch

    _, b1, a1 = _token_step(tiny_model_dir, tmp_path, "f1", full_finetune=True)
    _, b3, a3 = _token_step(tiny_model_dir, tmp_path, "f3", full_finetune=True, token_lr_multiplier=3.0)
    torch.testing.assert_close(b1, b3)
    d1, d3 = a1 - b1, a3 - b3
    assert d1[:2].norm() > 0
    torch.testing.assert_close(d3[:2], 3.0 * d1[:2], rtol=1e-4, atol=1e-7)  # the reward-token rows: 3x
    torch.testing.assert_close(d3[2:], d1[2:], rtol=1e-4, atol=1e-7)  # ordinary rows: as before
