"""Reward tokens in a tokenizer and a model: add them (`add_reward_tokens`), make their embedding rows
trainable under LoRA (`reward_token_indices`, `reward_token_lora_config`: PEFT trainable tokens).

RC-GRPO conditions on tokens the model must read as one unit each: they are added as special tokens with single
ids, and their rows start where the model can tell them apart (`init`). Under LoRA the rows are trained as PEFT
trainable tokens (input and, untied, output rows), so a saved adapter restores them exactly on load.
Heavy imports (torch, peft, deepspeed) happen inside the functions.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence

from rcgrpo.goal import DEFAULT_LEVELS, check_levels

REWARD_TOKEN_INITS = ("mean_resizing", "apart", "words")
"""How new rows start: at the old rows' mean (transformers' `mean_resizing`), apart from each other
(`apart_rows`), or at the embedding of the word each token names (`token_word`)."""


def add_reward_tokens(model, tokenizer, tokens: Sequence[str] = DEFAULT_LEVELS, *, init: str = "mean_resizing",
                      seed: int = 0, levels: Sequence[str] | None = None) -> list[int]:
    """Add `tokens` (the reward tokens, lowest first) to `tokenizer` as special tokens with single ids and grow
    `model`'s embeddings where needed; returns their ids. Call it before RCTP fine-tuning (and before RC-GRPO
    when the model does not have them yet); train their rows under LoRA with `reward_token_lora_config`.

    New rows are drawn from the old rows' mean and covariance (transformers' `mean_resizing`) under `seed`,
    so a run and its resumption start from the same rows. A model whose embedding already has rows for the
    new ids (Qwen-style checkpoints carry spare rows beyond the tokenizer) is not resized, and those spare
    rows, never trained, get the same mean init (`mean_rows`) from the tokenizer's real rows. `init="apart"`
    then overwrites the rows of the tokens this call added (input and, when untied, output embeddings) with
    `apart_rows`: `levels` (default: `tokens`, the reward tokens lowest first) spread along one direction, any other added
    token on its own direction. `init="words"` starts each added token's row at the embedding of the word it
    names (`token_word`: `<|low_reward|>` -> " low", the mean over its pieces). Under DeepSpeed ZeRO-3 the
    row count is the full (`ds_shape`) one, so the vocabulary never shrinks, and rows are written with the
    sharded matrices gathered."""
    import torch

    tokens = tuple(tokens)
    levels = tokens if levels is None else tuple(levels)
    if init not in REWARD_TOKEN_INITS:
        raise ValueError(f"reward_token_init must be one of {REWARD_TOKEN_INITS}, got {init!r}")
    old_vocab, rows_before = len(tokenizer), embedding_rows(model)
    new = [t for t in tokens if t not in tokenizer.get_vocab()]
    if new:
        tokenizer.add_special_tokens({"extra_special_tokens": new}, replace_extra_special_tokens=False)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    for tok, i in zip(tokens, ids):
        if tokenizer(tok, add_special_tokens=False)["input_ids"] != [i]:
            raise RuntimeError(f"{tok} does not encode to the single id {i}")
    if len(tokenizer) > rows_before:  # never shrink
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model.resize_token_embeddings(len(tokenizer))
    generator = torch.Generator().manual_seed(seed)
    if init == "apart" and new:
        order = [t for t in levels if t in new] + [t for t in new if t not in levels]
        n_levels = sum(t in levels for t in new)
        rows = [tokenizer.convert_tokens_to_ids(t) for t in order]
        _write_rows(model, rows, old_vocab, lambda old: apart_rows(old, n_levels, len(rows) - n_levels, generator))
    elif init == "words" and new:
        rows = [tokenizer.convert_tokens_to_ids(t) for t in new]
        pieces = [tokenizer(" " + token_word(t), add_special_tokens=False)["input_ids"] for t in new]
        _write_rows(model, rows, old_vocab, lambda old: torch.stack([old[ids].float().mean(0) for ids in pieces]))
    elif spare := [i for i in (tokenizer.convert_tokens_to_ids(t) for t in new) if i < rows_before]:
        _write_rows(model, spare, old_vocab, lambda old: mean_rows(old, len(spare), generator))
    return ids


def token_word(token: str) -> str:
    """The word a reward token names: `<|high_reward|>` -> `high` (`init="words"` starts its row at that word's
    embedding, so the network reads the token as it reads a word it knows)."""
    return re.sub(r"^<\|(.*?)(_reward)?\|>$", r"\1", token).replace("_", " ")


def embedding_rows(model) -> int:
    """Rows of the input embedding; under ZeRO-3 its full row count (a partitioned weight's local shape is 0)."""
    weight = model.get_input_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def _write_rows(model, rows: list[int], old_vocab: int, make) -> None:
    """Set `rows` of the input and (untied) output embedding to `make(real rows (old_vocab, d))`, gathering
    ZeRO-3-partitioned matrices first (every process computes the same seeded rows; rank 0's are kept)."""
    import torch

    matrices = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())
                if m is not None}  # tied embeddings: one matrix
    with _gathered(list(matrices.values())), torch.no_grad():
        for weight in matrices.values():
            weight[rows] = make(weight[:old_vocab]).to(weight.dtype)


def _gathered(params: list):
    """DeepSpeed's `GatheredParameters` (modifier rank 0) for ZeRO-3-partitioned `params`, else nothing."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def mean_rows(old, n: int, generator):
    """(n, d) rows drawn as transformers' `mean_resizing` draws grown rows: N(mu, 1e-9 Cov) of the real rows
    `old` (V, d), so they sit at the mean (the spare rows of a padded embedding were never trained)."""
    import torch

    rows = old.detach().float()
    mu = rows.mean(0)
    centred = rows - mu
    noise = (centred.T @ torch.randn(rows.shape[0], n, generator=generator)).T / max(rows.shape[0] - 1, 1) ** 0.5
    return mu + noise * 1e-9 ** 0.5


def token_indices(model, token_ids: list[int]) -> list[int] | dict[str, list[int]]:
    """PEFT `trainable_token_indices` for `token_ids`. Tied embeddings (SmolLM2): the input rows, tied into
    the LM head by PEFT. Untied (Qwen): the rows of both the input embedding and the LM head, so the saved
    adapter restores them exactly on load."""
    if bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False)):
        return list(token_ids)
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(model.get_input_embeddings())].split(".")[-1]: list(token_ids),
            names[id(model.get_output_embeddings())].split(".")[-1]: list(token_ids)}


def apart_rows(old, n_levels: int, n_other: int, generator):
    """(n_levels + n_other, d) embedding rows for new tokens that start apart from each other.

    Why: `mean_resizing` puts every new row at the old rows' mean (its covariance is scaled by 1e-9), so
    `<|low_reward|>` and `<|high_reward|>` start as the same vector (cosine ~1) and the model first has to
    learn to tell them apart (docs/training.md: no gap after RCTP with that init). Here each row sits at the typical
    distance `r` of a real token from the mean mu (r = RMS of |e_i - mu| over the old rows `old` (V, d)), so
    no new token is louder or quieter than a real one:
    - levels: mu + s_j * r * u, s_j evenly spaced in [-1, 1] (lowest level -1, highest +1; two levels are
      antipodal: cosine (|mu|^2 - r^2) / (|mu|^2 + r^2), about -1 when r >> |mu|, as in trained models);
    - other tokens: mu + r * v_k, each v_k its own direction.
    Directions are drawn from the old rows' own spread (a random combination of the centred rows, i.e. a
    sample of N(0, Cov)), so they point where real tokens differ, not into directions the network never
    reads; then made orthogonal to mu and to each other and normalised. Seeded by `generator`.
    """
    import torch

    rows = old.detach().float()
    mu = rows.mean(0)
    centred = rows - mu
    r = centred.pow(2).sum(1).mean().sqrt()
    basis = [mu / mu.norm().clamp_min(1e-12)]
    directions = []
    for _ in range(int(n_levels > 0) + n_other):
        v = centred.T @ torch.randn(rows.shape[0], generator=generator)
        for b in basis:  # Gram-Schmidt against the mean and the earlier directions
            v = v - (v @ b) * b
        v = v / v.norm().clamp_min(1e-12)
        basis.append(v)
        directions.append(v)
    out = []
    if n_levels:
        u = directions.pop(0)
        steps = torch.linspace(-1.0, 1.0, n_levels) if n_levels > 1 else torch.ones(1)
        out += [mu + s * r * u for s in steps]
    out += [mu + r * v for v in directions]
    return torch.stack(out) if out else rows[:0]


def reward_token_indices(model, tokenizer, tokens: Sequence[str] = DEFAULT_LEVELS) -> list[int] | dict[str, list[int]]:
    """PEFT `LoraConfig(trainable_token_indices=...)` for the reward tokens already in `tokenizer`."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in check_levels(tokens)]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"reward tokens {list(tokens)} are not all in the tokenizer: call add_reward_tokens first")
    return token_indices(model, ids)


def reward_token_lora_config(model, tokenizer, tokens: Sequence[str] = DEFAULT_LEVELS, **lora_kwargs):
    """A PEFT `LoraConfig` (`task_type="CAUSAL_LM"`, `lora_kwargs` as LoraConfig takes them) whose trainable
    tokens are the reward tokens' rows: LoRA on the weights, the token rows trained whole."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", trainable_token_indices=reward_token_indices(model, tokenizer, tokens),
                      **lora_kwargs)


def expose_head_bias(model) -> None:
    """TRL's fused LM head reads `lm_head.weight` and `lm_head.bias`; PEFT's trainable-tokens wrapper
    serves `.weight` (merged with the trained rows) but raises on `.bias`. Give it the base layer's bias.
    Call it on a PEFT model with reward-token rows before TRL's SFTTrainer trains it (TRL 1.16, PEFT 0.21);
    `RCGRPOTrainer` calls it itself."""
    head = model.get_output_embeddings()
    adapter = getattr(head, "token_adapter", None)
    if adapter is not None and "bias" not in vars(head):
        head.bias = getattr(adapter.base_layer, "bias", None)


def text_tokenizer(processing_class):
    """The text tokenizer of a processing class (a processor's `tokenizer`, or the tokenizer itself)."""
    return getattr(processing_class, "tokenizer", processing_class)


def check_reward_tokens(tokenizer, levels: Sequence[str]) -> list[int]:
    """The ids of `levels`, each of which must be one token of `tokenizer` (an RCTP model has them;
    `add_reward_tokens` adds them): otherwise the goal would be text the model never learned to read. ValueError
    naming the missing ones."""
    missing = [t for t in levels if len(tokenizer(t, add_special_tokens=False)["input_ids"]) != 1
               or tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:
        raise ValueError(f"reward tokens {missing} are not single tokens of the tokenizer: start RC-GRPO from an RCTP "
                         f"model (docs/library.md), or call rcgrpo.add_reward_tokens(model, tokenizer) first")
    return [tokenizer.convert_tokens_to_ids(t) for t in levels]


def check_reference_rows(ref_model, model) -> None:
    """TRL loads a full fine-tune's KL reference from the model's path: a model whose reward tokens were added in
    memory and not saved gets a reference without their rows (an index error at the first KL term). ValueError
    saying what to do instead. Rows counted as `embedding_rows` counts them (ZeRO-3's full shape)."""
    ref_rows, rows = embedding_rows(ref_model), embedding_rows(model)
    if ref_rows < rows:
        raise ValueError(f"the KL reference TRL loaded from {model.config._name_or_path!r} has {ref_rows} "
                         f"embedding rows, the model {rows}: save the RCTP model (with its reward tokens) and "
                         f"pass its path, train a PEFT adapter (the reference is then the adapter disabled), or set "
                         f"beta=0.0")


def identical_token_rows(model, ids: Sequence[int], tol: float = 1e-6) -> float | None:
    """The cosine of the lowest and the highest reward token's input rows where they are one vector (cosine above
    1 - `tol`: `mean_resizing` adds every new row at the same mean, 1e-9 noise apart), else None (and None where
    the rows cannot be read here: a ZeRO-3-partitioned weight)."""
    import torch

    weight = model.get_input_embeddings().weight
    if weight.numel() == 0:
        return None
    with torch.no_grad():
        low, high = weight[ids[0]].float(), weight[ids[-1]].float()
        cosine = float(torch.nn.functional.cosine_similarity(low, high, dim=0))
    return cosine if cosine > 1 - tol else None


def with_reward_token_rows(peft_config, model, processing_class, tokens: Sequence[str] = DEFAULT_LEVELS):
    """A copy of a user's `peft_config` whose trainable tokens include the reward tokens' rows (PEFT trainable
    tokens: LoRA on the weights, those rows trained whole), so RL can move what the tokens mean under any LoRA.

    `trainable_token_indices` None: the reward tokens' (`token_indices` for a model object: input and, untied,
    output rows; the input rows for a model given by its path, whose saved embeddings carry both); a list: the
    union; a dict: the reward tokens added under the input embedding's name (`embed_tokens` when the model is a
    path). A config without trainable tokens (prompt tuning, ...) is a ValueError naming the fix. The tokenizer is
    `processing_class`'s, or the model path's own."""
    import copy

    if not hasattr(peft_config, "trainable_token_indices"):
        raise ValueError(f"{type(peft_config).__name__} cannot train the reward tokens' embedding rows: use a "
                         "peft.LoraConfig (RCGRPOTrainer adds the rows to its trainable tokens), or train without PEFT")
    if processing_class is None:
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(model if isinstance(model, str) else model.config._name_or_path)
    ids = check_reward_tokens(text_tokenizer(processing_class), check_levels(tokens))
    mine = list(ids) if isinstance(model, str) else token_indices(model, ids)
    given, out = peft_config.trainable_token_indices, copy.deepcopy(peft_config)
    if given is None:
        out.trainable_token_indices = mine
    elif isinstance(given, dict):
        names = mine if isinstance(mine, dict) else {_input_embedding_name(model): mine}
        out.trainable_token_indices = {**given, **{k: _union(given.get(k, []), v) for k, v in names.items()}}
    else:
        out.trainable_token_indices = _union(given, ids)
    return out


def _union(given: Sequence[int], more: Sequence[int]) -> list[int]:
    """`given` in its order, then what `more` adds (a config that already names the rows is left as it is)."""
    return [*given, *(i for i in more if i not in given)]


def _input_embedding_name(model) -> str:
    if isinstance(model, str):
        return "embed_tokens"
    names = {id(m): n for n, m in model.named_modules()}
    return names[id(model.get_input_embeddings())].split(".")[-1]
