"""Loading models for decoding and training: folder checks, trained outputs (adapters, reward tokens), the
projections a LoRA adapts (`LORA_TARGETS`).

`load_trained` is THE loader of an sft-stage output (tokenizer with the reward tokens from the adapter
folder, base embeddings grown to it, LoRA + trained reward-token rows restored); the engine's backends,
the RL stage and the bench all load through it. Heavy imports happen inside the functions.
"""

from __future__ import annotations

from pathlib import Path

from rcgrpo_tasks.ops.inputs import InputError, read_json

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every attention and MLP projection of a Llama / Qwen / SmolLM2 block (what a LoRA adapts by default)."""


class ModelLoadError(ValueError):
    """A model folder or adapter is missing or malformed; the message names the path."""


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist (run `rcgrpo prepare-model` / `dvc repro prepare_model`)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {path} has no config.json (not a transformers model)")
    return path


def check_adapter_dir(adapter_dir: str | Path) -> Path:
    """A PEFT adapter folder (checked: config JSON, peft_type, weights) or a full fine-tuned model folder."""
    path = Path(adapter_dir)
    cfg = path / "adapter_config.json"
    if path.is_dir() and not cfg.exists() and (path / "config.json").is_file():
        return path  # a full fine-tune output (sft with full_finetune: true)
    if not path.is_dir() or not cfg.is_file():
        raise ModelLoadError(f"adapter {path}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        data = read_json(cfg)
    except InputError as exc:
        raise ModelLoadError(f"adapter {exc}") from exc
    if not isinstance(data, dict) or "peft_type" not in data:
        raise ModelLoadError(f"adapter {cfg}: missing 'peft_type'")
    if not any((path / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ModelLoadError(f"adapter {path}: no adapter_model.safetensors / adapter_model.bin")
    return path


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


def model_context(model_dir: str | Path) -> int:
    """max_position_embeddings from the model folder's config.json."""
    path = Path(model_dir) / "config.json"
    value = read_json(path).get("max_position_embeddings")
    if not isinstance(value, int):
        raise InputError(f"{path}: no integer max_position_embeddings")
    return value
