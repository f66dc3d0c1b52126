"""A hub-free stand-in for every Hugging Face Hub id TRL's GRPO tests load (`build_hub`), and their datasets
(`load_dataset`).

Models: tiny random-init models of each architecture the tests name (`MODELS`), saved in bfloat16 as TRL's
`trl-internal-testing` tiny models are, each with its family's tokenizer: a byte-level BPE trained here on a small
corpus, the family's special tokens, its real chat template (read from the installed TRL package, which ships the
templates it recognises by identity: tool parsing and TRL's training templates then apply as with the hub
tokenizers), and the two reward tokens (`rcgrpo.add_reward_tokens`, so `conditioning="rc"` runs). The Qwen family
keeps Qwen's id layout: 151643 base ids, Qwen's special tokens at Qwen's ids (`<|endoftext|>` 151643, `<|im_end|>`
151645, `<tool_call>` 151657, ...), the 256 byte symbols at GPT-2's ids 0-255, and the multi-byte pieces the tests
write as literal Qwen ids (`QWEN_PINNED`, read off the decoded texts the tests give beside them) at those ids, so
tests that fake `generate` with hard-coded Qwen ids decode what they expect. Other families get a small vocabulary.

Hub: each model is written into a Hugging Face cache layout (`models--org--name/refs/main`, `snapshots/<rev>/`)
under `HF_HUB_CACHE`; with `HF_HUB_OFFLINE=1` every `from_pretrained` entry point (transformers' Auto classes,
PEFT, TRL's own loads, remote code) resolves the ids from there, which a patch of a few functions would not cover.

Datasets: `load_dataset("trl-internal-testing/zen", config, split=..., streaming=...)` for the prompt-only configs,
19 rows (17 train, 2 test, as the hub's `train_test_split(test_size=0.1, shuffle=False)`), built from the Zen of
Python in the standard library's `this` module; any other path raises, naming it.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

TRL_TEMPLATES = "chat_templates"  # inside the installed trl package

ZEN_PROMPT_WORDS = (4, 2, 3, 1, 4, 3, 1, 4, 3, 3, 2, 6, 6, 10, 2, 4, 7, 5, 5)
"""Words of each Zen aphorism kept as its standard prompt (`Beautiful is better than` of `... than ugly.`)."""
ZEN_TEST_ROWS = 2

QWEN_IDS_ENV = "TRL_SUITE_QWEN_IDS"
"""`qwen3` (default): only the Qwen3 family keeps Qwen's id layout; `all`: Qwen2.5 too. Qwen's 151k-row head costs
about 5 s a GRPO step on this 2-core host (51 steps in most tests), a small vocabulary a fraction of that; the
tests that hard-code Qwen ids on Qwen2.5 (`test_train_with_mask_truncated_completions*`) need `all`."""
QWEN_BASE = 151643
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
QWEN3_EXTRA = ("<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN_PINNED = {
    198: "\n", 220: " ", 4913: '{"', 606: "name", 788: '":', 330: ' "', 64648: "multiply", 22785: "_tool",
    497: '",', 16370: "arguments", 5212: ' {"', 11248: '}}\n', 1513: " don", 944: "'t", 1414: " know",
    894: " any", 5392: " tool", 17453: "Done", 7692: "async", 93054: "_multiply", 35744: "increment", 9520: "step",
    2765: " won", 16252: " increment", 927: "sh", 411: "out", 1318: "text", 6023: "hi", 95642: '"}}\n', 450: "dec",
    13477: "rement", 14172: "tool", 6659: "call", 397: ">\n", 522: "</", 314: " {", 293: " b",
}
"""Qwen ids the tests write literally, and the text each stands for (single bytes sit at GPT-2's ids anyway)."""


@dataclass(frozen=True)
class TokenizerSpec:
    """A family's tokenizer: chat template file (TRL's), special tokens in id order, eos / pad / bos."""

    template: str
    specials: tuple[str, ...]
    eos: str
    pad: str | None
    bos: str | None = None
    qwen_layout: bool = False


TOKENIZERS = {
    "qwen2_5": TokenizerSpec("qwen2_5.jinja", QWEN_SPECIALS, "<|im_end|>", "<|endoftext|>",
                             qwen_layout=os.environ.get(QWEN_IDS_ENV, "qwen3") == "all"),
    "qwen3": TokenizerSpec("qwen3.jinja", QWEN_SPECIALS + QWEN3_EXTRA, "<|im_end|>", "<|endoftext|>",
                           qwen_layout=True),
    "cohere2": TokenizerSpec("cohere2.jinja", (
        "<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
        "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"),
        "<|END_OF_TURN_TOKEN|>", "<PAD>", "<BOS_TOKEN>"),
    "glm4moe": TokenizerSpec("glm4moe.jinja", (
        "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
        "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>",
        "<arg_value>", "</arg_value>"), "<|endoftext|>", "<|endoftext|>"),
    "gptoss": TokenizerSpec("gptoss.jinja", (
        "<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
        "<|return|>", "<|call|>"), "<|return|>", "<|endoftext|>"),
    "nemotron_3_nano": TokenizerSpec("nemotron_3_nano.jinja", (
        "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
        "<tool_response>", "</tool_response>"), "<|im_end|>", "<unk>", "<s>"),
    "gemma": TokenizerSpec("gemma.jinja", ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
                           "<eos>", "<pad>", "<bos>"),
    "llama3_2": TokenizerSpec("llama3_2.jinja", (
        "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
        "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"), "<|eot_id|>", None, "<|begin_of_text|>"),
}


@dataclass(frozen=True)
class ModelSpec:
    """One hub id: the transformers class, its tokenizer family, tiny config values, and `vocab` (rows of the
    embedding when the real tiny model carries spare rows beyond its tokenizer, kept under Qwen's id layout only;
    None: the tokenizer's length)."""

    cls: str
    config: str
    tokenizer: str
    kwargs: dict = field(default_factory=dict)
    vocab: int | None = None
    remote: bool = False


TINY = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
SEQ = dict(TINY, hidden_size=16, num_labels=1)
ORG = "trl-internal-testing/"
MODELS = {
    ORG + "tiny-Qwen2ForCausalLM-2.5": ModelSpec("Qwen2ForCausalLM", "Qwen2Config", "qwen2_5", TINY),
    ORG + "tiny-Qwen2ForSequenceClassification-2.5": ModelSpec(
        "Qwen2ForSequenceClassification", "Qwen2Config", "qwen2_5", SEQ, vocab=152064),
    ORG + "tiny-Qwen3ForCausalLM": ModelSpec("Qwen3ForCausalLM", "Qwen3Config", "qwen3", TINY),
    ORG + "tiny-Qwen3ForSequenceClassification": ModelSpec(
        "Qwen3ForSequenceClassification", "Qwen3Config", "qwen3", SEQ, vocab=151936),
    ORG + "tiny-Qwen3MoeForCausalLM": ModelSpec("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "qwen3", dict(
        TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True), vocab=151936),
    ORG + "tiny-Cohere2ForCausalLM": ModelSpec("Cohere2ForCausalLM", "Cohere2Config", "cohere2", dict(
        TINY, logit_scale=1.0)),
    ORG + "tiny-Glm4MoeForCausalLM": ModelSpec("Glm4MoeForCausalLM", "Glm4MoeConfig", "glm4moe", dict(
        TINY, moe_intermediate_size=32, head_dim=2, n_routed_experts=4, num_experts_per_tok=2, attention_bias=True,
        use_qk_norm=True, first_k_dense_replace=1)),
    ORG + "tiny-GptOssForCausalLM": ModelSpec("GptOssForCausalLM", "GptOssConfig", "gptoss", dict(
        TINY, num_local_experts=4, num_experts_per_tok=2)),
    ORG + "tiny-NemotronHForCausalLM-nano": ModelSpec("NemotronHForCausalLM", "NemotronHConfig", "nemotron_3_nano", dict(
        hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=8, mamba_head_dim=4, mamba_n_groups=1,
        ssm_state_size=16, mamba_d_conv=4, mamba_expand=2, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, use_mamba_kernels=False)),
    ORG + "tiny-Gemma2ForCausalLM": ModelSpec("Gemma2ForCausalLM", "Gemma2Config", "gemma", TINY),
    ORG + "tiny-LlamaForSequenceClassification-3.2": ModelSpec(
        "LlamaForSequenceClassification", "LlamaConfig", "llama3_2", SEQ),
    ORG + "tiny-RemoteForCausalLM": ModelSpec("LlamaForCausalLM", "LlamaConfig", "llama3_2", TINY, remote=True),
}

REMOTE_CONFIG = '''from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
'''
REMOTE_MODELING = '''from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
'''


# ---------------------------------------------------------------------------------------------- datasets

def zen_aphorisms() -> list[str]:
    """The 19 aphorisms of PEP 20, as `import this` prints them."""
    with contextlib.redirect_stdout(io.StringIO()):  # its first import prints the Zen
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def zen_split(config: str) -> dict[str, list[dict]]:
    """The `trl-internal-testing/zen` config as rows per split (prompt-only configs only)."""
    lines = zen_aphorisms()
    prefixes = [" ".join(line.split()[:n]) for line, n in zip(lines, ZEN_PROMPT_WORDS, strict=True)]
    if config == "standard_prompt_only":
        rows = [{"prompt": p} for p in prefixes]
    elif config == "conversational_prompt_only":
        rows = [{"prompt": [{"role": "user", "content": f"How does this line of the Zen of Python go on: {p}?"}]}
                for p in prefixes]
    else:
        raise ValueError(f"the hub-free harness has no zen config {config!r}")
    return {"train": rows[:-ZEN_TEST_ROWS], "test": rows[-ZEN_TEST_ROWS:]}


def load_dataset(path, name=None, split=None, streaming=False, **kwargs):
    """`datasets.load_dataset` for the hub datasets the tests name: a `Dataset` (an `IterableDataset` when
    `streaming`), or a `DatasetDict` / `IterableDatasetDict` of both splits without `split`."""
    from datasets import Dataset, DatasetDict, IterableDatasetDict

    if path != ORG + "zen":
        raise ValueError(f"the hub-free harness serves no dataset {path!r} (only {ORG}zen)")
    splits = {k: Dataset.from_list(v) for k, v in zen_split(name).items()}
    if streaming:
        splits = {k: v.to_iterable_dataset() for k, v in splits.items()}
    if split is not None:
        return splits[split]
    return (IterableDatasetDict if streaming else DatasetDict)(splits)


# ---------------------------------------------------------------------------------------------- tokenizers

@functools.cache
def _byte_order() -> tuple[int, ...]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return (*printable, *(b for b in range(256) if b not in printable))


@functools.cache
def byte_alphabet() -> tuple[str, ...]:
    """The 256 byte symbols of byte-level BPE in GPT-2's id order (`bytes_to_unicode`): the printable bytes as
    themselves, the others shifted past 255."""
    return tuple(chr(b) if i < 188 else chr(256 + i - 188) for i, b in enumerate(_byte_order()))


@functools.cache
def _byte_table() -> dict[int, str]:
    return dict(zip(_byte_order(), byte_alphabet()))


def to_byte_level(text: str) -> str:
    """`text` in byte-level BPE's symbols."""
    table = _byte_table()
    return "".join(table[b] for b in text.encode())


def corpus() -> list[str]:
    words = ["system", "user", "assistant", "tool", "function", "arguments", "name", "reward", "Reward Goal",
             "multiply", "increment", "Done!", "I don't know any tool", "think", "response", "content"]
    return [*zen_aphorisms(), *(f'{{"name": "{w}", "arguments": {{"a": 3, "b": 4}}}}' for w in words)] * 4


def trained_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def build_tokenizer(spec: TokenizerSpec):
    """The family's tokenizer (module docstring), without the reward tokens."""
    import importlib.resources

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    trained, merges = trained_bpe(900)
    alphabet = byte_alphabet()
    vocab = {s: i for i, s in enumerate(alphabet)}
    if spec.qwen_layout:
        for i, text in QWEN_PINNED.items():
            piece = to_byte_level(text)
            assert vocab.setdefault(piece, i) == i, (piece, i)  # a single byte is at its GPT-2 id already
    taken, next_id = set(vocab.values()), len(alphabet)
    for piece in sorted(trained, key=trained.get):
        if piece in vocab:
            continue
        while next_id in taken:
            next_id += 1
        vocab[piece] = next_id
        taken.add(next_id)
    size = QWEN_BASE if spec.qwen_layout else max(taken) + 1
    filler = (i for i in range(size) if i not in taken)
    for n, i in enumerate(filler):  # unreachable by merges (no NUL byte in any text): decode-only ids
        vocab[to_byte_level(f"\x00\x00{n}")] = i
    assert sorted(vocab.values()) == list(range(size))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in spec.specials])
    template = (importlib.resources.files("trl") / TRL_TEMPLATES / spec.template).read_text()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec.eos, pad_token=spec.pad, bos_token=spec.bos,
                                   model_max_length=131072)
    fast.chat_template = template
    return fast


# ---------------------------------------------------------------------------------------------- models

def build_model(spec: ModelSpec, tokenizer, seed: int = 0):
    """A tiny random-init model of `spec` for `tokenizer`, the reward tokens added (`rcgrpo.add_reward_tokens`)."""
    import torch
    import transformers

    from rcgrpo import add_reward_tokens

    ids = {k: tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{k}_token")) for k in ("eos", "pad", "bos")
           if getattr(tokenizer, f"{k}_token") is not None}
    rows = spec.vocab if spec.vocab and len(tokenizer) > QWEN_BASE else len(tokenizer)
    kwargs = dict(spec.kwargs, vocab_size=rows, tie_word_embeddings=False,
                  **{f"{k}_token_id": v for k, v in ids.items()})
    config = getattr(transformers, spec.config)(**kwargs)
    if getattr(config, "layer_types", None) and "num_hidden_layers" in kwargs:
        config.layer_types = config.layer_types[:kwargs["num_hidden_layers"]]
    torch.manual_seed(seed)
    model = getattr(transformers, spec.cls)(config)
    add_reward_tokens(model, tokenizer)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = ids["eos"]
        model.generation_config.pad_token_id = ids.get("pad", ids["eos"])
    return model.to(torch.bfloat16)


def save_remote(out: Path, model) -> None:
    """`tiny-RemoteForCausalLM`: the model under a custom `remote` type whose code ships with the checkpoint."""
    (out / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (out / "modeling_remote.py").write_text(REMOTE_MODELING)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="remote", architectures=["RemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def publish(cache: Path, repo_id: str, files: Path) -> Path:
    """Lay `files` out as the hub cache's snapshot of `repo_id` (revision `main`); returns the snapshot dir."""
    rev = hashlib.sha1(repo_id.encode()).hexdigest()
    root = cache / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(rev)
    snapshot = root / "snapshots" / rev
    shutil.copytree(files, snapshot, dirs_exist_ok=True)
    return snapshot


def build_hub(cache: Path, work: Path) -> list[str]:
    """Every model of `MODELS` built (in `work`) and published into the hub cache `cache`; returns the ids."""
    tokenizers = {}
    for repo_id, spec in MODELS.items():
        if spec.tokenizer not in tokenizers:
            tokenizers[spec.tokenizer] = build_tokenizer(TOKENIZERS[spec.tokenizer])
        tokenizer = _copy(tokenizers[spec.tokenizer])
        model = build_model(spec, tokenizer)
        out = work / repo_id.replace("/", "--")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        if spec.remote:
            save_remote(out, model)
        publish(cache, repo_id, out)
    return list(MODELS)


def _copy(tokenizer):
    import copy

    return copy.deepcopy(tokenizer)
