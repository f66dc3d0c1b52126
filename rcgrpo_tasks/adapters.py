"""Trainable reward tokens on PEFT adapters: add them, train through TRL, save small, load back.

Shared by the sft stage (training), controllability / RL / evaluate (loading) and the bench:
- `add_special_tokens`: reward tokens (and any extra) as special tokens with single ids; embeddings grown.
- `load_trained(model_dir, adapter_dir)`: THE loader of an sft-stage output — tokenizer from the adapter
  folder, base embeddings grown to it, `PeftModel.from_pretrained` (LoRA + trained reward-token rows);
  a full fine-tune folder loads as a plain model. `load_logged_model(uri)`: the same from MLflow.
- `small_adapter_saves`: adapters without PEFT's copy of the resized embedding matrices (the trained rows
  are in the adapter as trainable tokens); `log_model`: the adapter as an `mlflow.transformers` model.
- `compact_head_loss`, `expose_head_bias`: the CPU loss path and a PEFT/TRL compatibility shim.
Heavy imports (torch, transformers, peft, mlflow) happen inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from rcgrpo_tasks.io import InputError


def add_special_tokens(tokenizer, model, tokens: tuple[str, ...], seed: int = 0) -> list[int]:
    """Add `tokens` as special tokens (single ids), grow the embeddings if needed; returns their ids.

    New rows are drawn from the old rows' mean and covariance (transformers' `mean_resizing`) under `seed`,
    so a run and its resumption start from the same rows."""
    import torch

    new = [t for t in tokens if t not in tokenizer.get_vocab()]
    if new:
        tokenizer.add_special_tokens({"extra_special_tokens": new}, replace_extra_special_tokens=False)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    for tok, i in zip(tokens, ids):
        if tokenizer(tok, add_special_tokens=False)["input_ids"] != [i]:
            raise RuntimeError(f"{tok} does not encode to the single id {i}")
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        # Never shrink: Qwen-style checkpoints carry spare rows beyond the tokenizer.
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model.resize_token_embeddings(len(tokenizer))
    return ids


def compact_head_loss(trainer, model, inputs: dict, num_items_in_batch=None):
    """Token-mean NLL projecting only the labelled (assistant) positions through the LM head.

    TRL's fused head scores every position on devices without Triton; assistant tokens are a small share
    of these chats (long system prompts and tool outputs), so this skips most of the 49k-wide head work.
    Same loss and the same logged metrics (entropy, token accuracy, token count) as TRL's path.
    """
    import torch
    from peft import PeftModel

    inner = trainer.accelerator.unwrap_model(model)
    hf = inner.get_base_model() if isinstance(inner, PeftModel) else inner
    backbone = getattr(hf, hf.base_model_prefix)
    kwargs = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
    target = inputs["labels"][:, 1:]
    mask = target != -100
    with trainer.accelerator.autocast():
        hidden = backbone(**kwargs, use_cache=False).last_hidden_state[:, :-1]
        logits = hf.get_output_embeddings()(hidden[mask])
    logp = torch.log_softmax(logits.float(), dim=-1)
    tgt = target[mask]
    nll = -logp.gather(-1, tgt[:, None]).squeeze(-1)
    denom = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1)
    loss = nll.sum() / denom
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

    from rcgrpo_tasks.tracking import TrackingError

    # Explicit requirements: mlflow's inference would pin torchvision, which this CPU stack does not have.
    reqs = [f"{p}=={md.version(p)}" for p in ("torch", "transformers", "peft", "accelerate")]
    try:
        with small_adapter_saves(model, tokenizer):
            mlflow.transformers.log_model(
                transformers_model={"model": model, "tokenizer": tokenizer}, name="model", task="text-generation",
                base_model_path=str(Path(model_dir).resolve()), pip_requirements=reqs)
    except Exception as exc:
        raise TrackingError(f"MLflow log_model (transformers, PEFT) failed: {exc}") from exc


def load_trained(model_dir: str | Path, adapter_dir: str | Path | None = None, dtype: str = "float32",
                 is_trainable: bool = False):
    """(model, tokenizer) of a trained sft/rctp output — THE way every consumer loads one.

    PEFT adapter folder: tokenizer from the adapter folder (it has the reward tokens), base embeddings
    grown to it, then `PeftModel.from_pretrained` (restores LoRA + the reward-token rows). A full
    fine-tune output folder loads as a plain model. No adapter: the base model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    adapter = Path(adapter_dir) if adapter_dir else None
    if adapter is not None and (adapter / "adapter_config.json").is_file():
        from peft import PeftModel

        tok_src = adapter if (adapter / "tokenizer_config.json").is_file() else Path(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(tok_src)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=is_trainable), tokenizer
    if adapter is not None and not (adapter / "config.json").is_file():
        raise InputError(f"{adapter}: neither a PEFT adapter (adapter_config.json) nor a model folder")
    src = adapter if adapter is not None else Path(model_dir)
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype), AutoTokenizer.from_pretrained(src)


def load_logged_model(model_uri: str, dtype: str = "float32"):
    """(model, tokenizer) from an MLflow model logged by `log_model` (e.g. `runs:/<id>/model`)."""
    import mlflow
    import yaml

    local = Path(mlflow.artifacts.download_artifacts(model_uri))
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["transformers"]
    base = flavor.get("model_local_base") or flavor.get("source_model_name")
    return load_trained(base, local / flavor.get("peft_adaptor", "peft"), dtype=dtype)
