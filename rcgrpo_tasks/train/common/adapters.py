"""Trainable reward tokens on PEFT adapters: add them, train through TRL, save small, load back.

Shared by the sft stage (training), controllability / RL / evaluate (loading) and the bench:
- `add_special_tokens`: reward tokens (and any extra) as special tokens with single ids; embeddings grown
  (spare rows of a padded embedding used as they are); their rows start at the old rows' mean
  (`mean_resizing`, `mean_rows`) or apart from each other (`apart_rows`); `token_indices`: their rows as
  PEFT trainable tokens (SFT/RCTP and RL).
- `token_lr_groups` / `scale_row_updates`: the token rows' own learning rate (`token_lr_multiplier`).
- `load_logged_model(uri)`: `rcgrpo_tasks.engine.models.load_trained` (THE loader of an sft-stage output)
  for an adapter logged to MLflow.
- `small_adapter_saves`: adapters without PEFT's copy of the resized embedding matrices (the trained rows
  are in the adapter as trainable tokens); `log_model`: the adapter as an `mlflow.transformers` model.
- `compact_head_loss`, `expose_head_bias`: the CPU loss path and a PEFT/TRL compatibility shim;
  `lora_targets`: PEFT's `target_modules` of a module list.
Heavy imports (torch, transformers, peft, mlflow) happen inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path

from rcgrpo_tasks.engine.models import load_trained
from rcgrpo_tasks.engine.shared_prefix import target_hidden, trunk_and_head
from rcgrpo_tasks.ops.tracking_store import TrackingError

REWARD_TOKEN_INITS = ("mean_resizing", "apart", "words")


def lora_targets(modules: tuple[str, ...]) -> str | list[str]:
    """PEFT `target_modules`: the module names, or PEFT's "all-linear" for `("all-linear",)`."""
    return "all-linear" if tuple(modules) == ("all-linear",) else list(modules)


# ---------------------------------------------------------------------------------------------- results


def add_special_tokens(tokenizer, model, tokens: tuple[str, ...], seed: int = 0, init: str = "mean_resizing",
                       levels: tuple[str, ...] = ()) -> list[int]:
    """Add `tokens` as special tokens (single ids), grow the embeddings if needed; returns their ids.

    New rows are drawn from the old rows' mean and covariance (transformers' `mean_resizing`) under `seed`,
    so a run and its resumption start from the same rows. A model whose embedding already has rows for the
    new ids (Qwen-style checkpoints carry spare rows beyond the tokenizer) is not resized, and those spare
    rows, never trained, get the same mean init (`mean_rows`) from the tokenizer's real rows. `init="apart"`
    then overwrites the rows of the tokens this call added (input and, when untied, output embeddings) with
    `apart_rows`: `levels` (the reward tokens, lowest first) spread along one direction, any other added
    token on its own direction. `init="words"` starts each added token's row at the embedding of the word it
    names (`token_word`: `<|low_reward|>` -> " low", the mean over its pieces). Under DeepSpeed ZeRO-3 the
    row count is the full (`ds_shape`) one, so the vocabulary never shrinks, and rows are written with the
    sharded matrices gathered."""
    import torch

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


def trainable_token_params(model) -> list:
    """The PEFT trainable-token rows of `model` (`trainable_tokens_delta` parameters that require grad;
    with tied embeddings the head shares the input's, listed once)."""
    seen, out = set(), []
    for name, param in model.named_parameters():
        if "trainable_tokens_delta" in name and param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def token_lr_groups(optimizer, params: list, multiplier: float) -> None:
    """Move `params` out of the optimizer's groups into groups of their own with `lr` x `multiplier` (each
    keeps the rest of its former group's settings, e.g. weight decay). Call it on a fresh optimizer, before
    the learning-rate scheduler is built: the scheduler then scales every group's own initial lr."""
    wanted = {id(p) for p in params}
    extra = []
    for group in optimizer.param_groups:
        moved = [p for p in group["params"] if id(p) in wanted]
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in wanted]
            extra.append({**{k: v for k, v in group.items() if k != "params"}, "params": moved,
                          "lr": group["lr"] * multiplier, "rcgrpo_token_rows": True})
    for group in extra:
        optimizer.add_param_group(group)


def scale_row_updates(optimizer, weights: list, rows: list[int], multiplier: float) -> None:
    """Full fine-tuning: make every optimizer step move `rows` of each matrix in `weights` `multiplier`
    times as far (the token rows live inside the embedding matrix, so they cannot have a group of their own).

    Why the step and not the gradient: Adam normalises the gradient, so scaling it barely changes the
    update. The step of AdamW (and Adam, SGD) on a row is lr x (direction from optimizer state + decoupled
    decay), and the optimizer state does not depend on lr, so multiplying each step's change of the rows
    by k is exactly training those rows at k x lr. Hooks on the optimizer: the rows are saved before each
    step and their change is scaled after it (a step skipped by the fp16 scaler runs neither)."""
    import torch

    saved: list = []
    index = torch.tensor(rows, dtype=torch.long)

    def before(opt, args, kwargs):
        saved[:] = [w.detach()[index.to(w.device)].clone() for w in weights]

    def after(opt, args, kwargs):
        with torch.no_grad():
            for w, old in zip(weights, saved):
                i = index.to(w.device)
                w[i] = old + multiplier * (w[i] - old)
        saved.clear()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def compact_head_loss(trainer, model, inputs: dict, num_items_in_batch=None, objective=None):
    """Token-mean NLL projecting only the labelled (assistant) positions through the LM head.

    TRL's fused head scores every position on devices without Triton; assistant tokens are a small share
    of these chats (long system prompts and tool outputs), so this skips most of the 49k-wide head work.
    Same loss and the same logged metrics (entropy, token accuracy, token count) as TRL's path. A
    micro-batch's shared tokens (an RCTP pair's prompt) go through the trunk once (`shared_prefix`, at the
    trainer's `shared_prefix` threshold). `objective(logp, targets, mask, inputs) -> (weights, extra)`, when
    given, reweights each labelled token's NLL (`weights`, one per labelled position, or None) and adds `extra`
    (a summed loss term) before the division by the token count: the RCTP objective's hook
    (`train.sft.objective`).
    """
    import torch

    trunk, head = trunk_and_head(trainer.accelerator.unwrap_model(model))
    labels = inputs["labels"]
    targets = torch.zeros_like(labels, dtype=torch.bool)
    targets[:, 1:] = labels[:, 1:] != -100  # token t's label, predicted at t - 1
    mask = targets[:, 1:]
    with trainer.accelerator.autocast():
        if "position_ids" in inputs or "attention_mask" not in inputs:  # padding-free: TRL's packed rows
            kwargs = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
            hidden = trunk(**kwargs, use_cache=False).last_hidden_state[:, :-1][mask]
        else:
            hidden = target_hidden(trunk, inputs["input_ids"], inputs["attention_mask"], targets,
                                   getattr(trainer, "shared_prefix", None), trainer.processing_class.pad_token_id or 0)
        logits = head(hidden)
    logp = torch.log_softmax(logits.float(), dim=-1)
    tgt = labels[:, 1:][mask]
    nll = -logp.gather(-1, tgt[:, None]).squeeze(-1)
    denom = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1)
    weights, extra = objective(logp, tgt, mask, inputs) if objective is not None else (None, 0.0)
    loss = ((nll if weights is None else nll * weights).sum() + extra) / denom
    with torch.no_grad():
        n = max(int(mask.sum()), 1)
        metrics = trainer._metrics["train"]
        metrics["entropy"].append(float(-(logp.exp() * logp).sum() / n))
        metrics["mean_token_accuracy"].append(float((logp.argmax(-1) == tgt).sum() / n))
        seen = inputs["attention_mask"].sum() if "attention_mask" in inputs else inputs["position_ids"].size(1)
        trainer._total_train_tokens += int(seen)
        metrics["num_tokens"] = [trainer._total_train_tokens]
    return loss


@contextlib.contextmanager
def small_adapter_saves(model, tokenizer=None):
    """Make `model.save_pretrained` (as called by Trainer checkpoints and mlflow) skip PEFT's full copy of
    the resized embedding matrices: the special-token rows are in the adapter already (trainable tokens).
    With `tokenizer`, every save also writes it next to the adapter."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        yield
        return
    original = model.save_pretrained

    @functools.wraps(original)
    def save_pretrained(path, *args, **kwargs):
        original(path, *args, **{**kwargs, "save_embedding_layers": False})
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    model.save_pretrained = save_pretrained
    try:
        yield
    finally:
        del model.save_pretrained


def expose_head_bias(model) -> None:
    """TRL's fused LM head reads `lm_head.weight` and `lm_head.bias`; PEFT's trainable-tokens wrapper
    serves `.weight` (merged with the trained rows) but raises on `.bias`. Give it the base layer's bias."""
    head = model.get_output_embeddings()
    adapter = getattr(head, "token_adapter", None)
    if adapter is not None and "bias" not in vars(head):
        head.bias = getattr(adapter.base_layer, "bias", None)


def log_model(model, tokenizer, model_dir: Path) -> None:
    """The PEFT model as an `mlflow.transformers` model referencing the LOCAL base folder (loads offline).

    Load it back with `load_logged_model(uri)`: the base needs its embeddings grown to the adapter's
    tokenizer first, which mlflow's own loader does not do (its `peft/` folder is a `load_trained` folder).
    """
    import importlib.metadata as md

    import mlflow

    # Explicit requirements: mlflow's inference would pin torchvision, which this CPU stack does not have.
    reqs = [f"{p}=={md.version(p)}" for p in ("torch", "transformers", "peft", "accelerate")]
    try:
        with small_adapter_saves(model, tokenizer):
            mlflow.transformers.log_model(
                transformers_model={"model": model, "tokenizer": tokenizer}, name="model", task="text-generation",
                base_model_path=str(Path(model_dir).resolve()), pip_requirements=reqs)
    except Exception as exc:
        raise TrackingError(f"MLflow log_model (transformers, PEFT) failed: {exc}") from exc


def load_logged_model(model_uri: str, dtype: str = "float32"):
    """(model, tokenizer) from an MLflow model logged by `log_model` (e.g. `runs:/<id>/model`)."""
    import mlflow
    import yaml

    local = Path(mlflow.artifacts.download_artifacts(model_uri))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["transformers"]
    base = flavor.get("model_local_base") or flavor.get("source_model_name")
    return load_trained(base, local / flavor.get("peft_adaptor", "peft"), dtype=dtype)
