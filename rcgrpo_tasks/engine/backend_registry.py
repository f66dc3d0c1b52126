"""`load_backend(name, ...)`: the registry of generation backends (`hf`, `vllm`) behind `engine.backend`."""

from __future__ import annotations

from pathlib import Path

from rcgrpo_tasks.engine.backend import Backend
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.vllm import VLLMBackend


def load_backend(name: str, model_dir: str | Path, adapter_dir: str | Path | None = None, **kwargs) -> Backend:
    """`hf` or `vllm` backend for a model folder (+ optional PEFT adapter folder)."""
    if name == "hf":
        return HFBackend(model_dir, adapter_dir, **kwargs)
    if name == "vllm":
        return VLLMBackend(model_dir, adapter_dir, **kwargs)
    raise ValueError(f"unknown backend {name!r}; expected 'hf' or 'vllm'")
