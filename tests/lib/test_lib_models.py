"""The library's model-side helpers on a tiny random model: reward tokens and their trainable rows, the
premise measured by sampling."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rcgrpo import add_reward_tokens, measure_controllability, reward_token_lora_config  # noqa: E402
from rcgrpo.goal import DEFAULT_LEVELS  # noqa: E402

LOW, HIGH = DEFAULT_LEVELS


def test_reward_tokens_are_single_ids_and_their_rows_train_under_lora(lib_tok, build_model):
    from peft import get_peft_model

    model = build_model(len(lib_tok))
    ids = add_reward_tokens(model, lib_tok)
    assert [lib_tok(t, add_special_tokens=False)["input_ids"] for t in DEFAULT_LEVELS] == [[i] for i in ids]
    assert model.get_input_embeddings().weight.shape[0] >= len(lib_tok)
    assert add_reward_tokens(model, lib_tok) == ids  # idempotent
    peft = get_peft_model(model, reward_token_lora_config(model, lib_tok, r=2, target_modules=["q_proj"]))
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert any("trainable_tokens" in n for n in trainable) and any("lora_A" in n for n in trainable)
    ids_in = torch.tensor([[ids[0], ids[1], 5]])
    peft(input_ids=ids_in).logits.sum().backward()
    delta = next(p for n, p in peft.named_parameters() if "trainable_tokens_delta" in n)
    assert delta.grad is not None and delta.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="add_reward_tokens"):
        reward_token_lora_config(model, lib_tok, ("<|a|>", "<|b|>"))


def test_the_premise_of_a_reward_that_reads_the_token(lib_model):
    """A reward that pays the high token only: every pair is (success, failure), q = 1, the gap 1, and each
    pair's two samples were drawn with one seed."""
    model, tok = lib_model
    rows = [{"prompt": [{"role": "user", "content": f"Add {i} and 4"}], "k": i} for i in range(3)]
    seen = []

    def reward(prompts, completions, completion_ids, reward_token, k, **_):
        seen.append((k[0], reward_token[0], tuple(completion_ids[0])))
        return [1.0 if reward_token[0] == HIGH else 0.0]

    out = measure_controllability(model, tok, rows, reward, samples=2, max_new_tokens=4, n_boot=100)
    assert out["q"] == 1.0 and out["gap"] == pytest.approx(1.0) and out["pairs"] == 6
    assert out["success_high"] == 1.0 and out["success_low"] == 0.0 and out["high_only"] == 6
    assert len(seen) == 12 and {k for k, _, _ in seen} == {0, 1, 2}


def test_paired_samples_share_their_seed(lib_model):
    """With the goal left out (`external`), both tokens see one prompt: paired samples are identical."""
    model, tok = lib_model
    got = []

    def reward(prompts, completions, completion_ids, reward_token, **_):
        got.append(tuple(completion_ids[0]))
        return [float(len(completion_ids[0]) % 2)]

    measure_controllability(model, tok, [{"prompt": "Add 3 and 4"}], reward, samples=3, max_new_tokens=5,
                            place="external", n_boot=50, temperature=1.5)
    assert got[0::2] == got[1::2] and len(set(got[0::2])) > 1
