"""Fixtures of the library's tests: a byte-level BPE tokenizer with a ChatML template and a 2-layer random-init
Llama, both built here in seconds (no hub, no GGUF, no package of the pipeline), so these tests run wherever the
library's core dependencies are installed (`make test-lib`: the lowest versions the package claims)."""

from __future__ import annotations

from pathlib import Path

import pytest

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CORPUS = [
    "What is the weather in Paris today? Call get_weather with city Paris.",
    "Add 3 and 4. The answer is 7. Multiply 6 by 7: 42.",
    "You are a helpful assistant. Reply with a function call or a short answer.",
    "[Reward Goal: high] [Reward Goal: low] user assistant system tool",
] * 20


def build_tokenizer(out: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", pad_token="<pad>",
                                  bos_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(out)
    return tok


def make_model(vocab: int, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         tie_word_embeddings=True, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@pytest.fixture
def build_model():
    """`make_model` as a fixture: tests/trl_suite has a conftest.py too, so `from conftest import` could pick either."""
    return make_model


@pytest.fixture(scope="session")
def lib_tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lib_tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture
def lib_tok(lib_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(lib_tokenizer_dir)


@pytest.fixture
def lib_model(lib_tok):
    """A fresh tiny model with the reward tokens added (rcgrpo.add_reward_tokens), and its tokenizer."""
    from rcgrpo import add_reward_tokens

    model = make_model(len(lib_tok))
    add_reward_tokens(model, lib_tok)
    model.generation_config.pad_token_id = lib_tok.pad_token_id
    model.generation_config.eos_token_id = lib_tok.eos_token_id
    return model, lib_tok
