"""Generation backends behind one interface: token-id prompts in, sampled token ids + log-probs out.

`Backend.session()` returns a `Session` whose `generate(keys, prompts, sampling)` continues a set of
rollouts (one row per key). A session may keep state between calls; callers pass each row's WHOLE
sequence so far and the backend decides what it can reuse:
- `hf` (CPU default, also the in-memory model TRL trains: `HFBackend.from_model(model, tokenizer)`):
  transformers with a hand-written sampling loop over one batched KV cache per session
  (`rcgrpo_tasks/hf_session.py`): prompt prefixes shared by rows (the system prompt + task of a GRPO
  group) are prefilled once, and at later steps each row's cache is extended with only the new tokens
  (tool observations, next user turn) instead of re-prefilling the conversation. Log-probs are those of
  the sampling distribution `softmax(logits / T)` (T = 1 when greedy) — what TRL recomputes for the GRPO
  ratio; top-p truncation is not folded in.
- `vllm` (GPU workers, extra `[gpu]`): vLLM's offline engine with automatic prefix caching (the same
  reuse, done by vLLM) and LoRA requests for adapters. Import-guarded; untested on CPU machines.
- `scripted`: a policy from a script or callable (tests, expert/gold replay); no model.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

DEFAULT_MAX_POSITIONS = 8192


class ModelLoadError(ValueError):
    """A model folder or adapter is missing or malformed; the message names the path."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    max_new_tokens: int = 256
    """Per model output (one step)."""
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(f"invalid sampling params {self}")


@dataclass
class Completion:
    token_ids: list[int]
    """Sampled ids, including the stop token when the model produced one."""
    logprobs: list[float]
    text: str
    """Decoded text without the stop token."""
    finish_reason: str
    """`stop` (a stop token) or `length`."""


class Session:
    """Continues a set of rollouts; see module docstring."""

    def generate(self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None) -> list[Completion]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Backend:
    name = "base"
    tokenizer: Any
    max_positions: int = DEFAULT_MAX_POSITIONS

    def session(self) -> Session:
        raise NotImplementedError

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        """One-shot batch generation (a fresh session)."""
        sess = self.session()
        try:
            return sess.generate(list(range(len(prompts))), prompts, sampling)
        finally:
            sess.close()

    def describe(self) -> dict:
        return {"backend": self.name}

    @property
    def stop_ids(self) -> set[int]:
        return stop_token_ids(self.tokenizer)


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(generation_config, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra] if extra is not None else [])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # ChatML turn end, eos or not
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return ids


def _decode(tokenizer, ids: list[int], stops: set[int]) -> str:
    body = ids[:-1] if ids and ids[-1] in stops else ids
    return tokenizer.decode(body, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- scripted
class ScriptedBackend(Backend):
    """A policy without a model: `policy(key, step, prompt_ids) -> text`, or per-key lists of texts.

    Completions are the text's tokens plus the stop token, with log-prob 0.0. When a list script runs out
    the policy answers "" (ends the turn / episode).
    """

    name = "scripted"

    def __init__(self, tokenizer, policy: Callable[[Hashable, int, list[int]], str] | dict | list,
                 max_positions: int = DEFAULT_MAX_POSITIONS):
        self.tokenizer, self.max_positions = tokenizer, max_positions
        if callable(policy):
            self.policy = policy
        else:
            scripts = dict(enumerate(policy)) if isinstance(policy, list) else dict(policy)
            self.policy = lambda key, step, _ids: (scripts[key][step] if step < len(scripts[key]) else "")
        self.eos = tokenizer.eos_token_id

    def session(self) -> Session:
        return _ScriptedSession(self)


class _ScriptedSession(Session):
    def __init__(self, backend: ScriptedBackend):
        self.b, self.steps = backend, {}

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        out = []
        for i, (key, prompt) in enumerate(zip(keys, prompts)):
            step = self.steps.get(key, 0)
            self.steps[key] = step + 1
            text = self.b.policy(key, step, list(prompt))
            ids = self.b.tokenizer.encode(text, add_special_tokens=False)
            cap = max_new_tokens[i] if max_new_tokens is not None else sampling.max_new_tokens
            finish = "stop" if len(ids) < cap else "length"
            ids = ids[:cap - 1] + [self.b.eos] if finish == "stop" else ids[:cap]
            out.append(Completion(ids, [0.0] * len(ids), _decode(self.b.tokenizer, ids, {self.b.eos}), finish))
        return out


# ---------------------------------------------------------------------------------------------------- hf
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
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"adapter {cfg}: invalid JSON: {exc}") from exc
    if not isinstance(data, dict) or "peft_type" not in data:
        raise ModelLoadError(f"adapter {cfg}: missing 'peft_type'")
    if not any((path / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ModelLoadError(f"adapter {path}: no adapter_model.safetensors / adapter_model.bin")
    return path


def bf16_supported() -> bool:
    """True when this CPU has native bf16 matmuls (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


class HFBackend(Backend):
    """transformers model + tokenizer; `dtype`: float32 | bfloat16 | auto (bf16 where the CPU supports it)."""

    name = "hf"

    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None, dtype: str = "float32",
                 device: str = "cpu", merge_adapter: bool = True):
        from rcgrpo_tasks import sft

        path = check_model_dir(model_dir)
        adapter = check_adapter_dir(adapter_dir) if adapter_dir else None
        if dtype == "auto":
            dtype = "bfloat16" if (device != "cpu" or bf16_supported()) else "float32"
        # An adapter is merged in float32 and the result cast to `dtype`, exactly as `rl` saves its merged
        # policies: otherwise an RL run that changed nothing (all-zero advantages) would decode differently
        # from its init only through bf16 merge rounding (measured: greedy outputs diverged).
        load_dtype = "float32" if adapter and merge_adapter else dtype
        try:  # sft.load_trained is THE loader of trained outputs (reward tokens, resized embeddings)
            model, tokenizer = sft.load_trained(path, adapter, dtype=load_dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # OSError, ValueError, peft shape mismatches (RuntimeError), ...
            where = f"adapter {adapter} on " if adapter else ""
            raise ModelLoadError(f"{where}model folder {path}: could not load: {exc}") from exc
        if merge_adapter and hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()  # plain weights decode faster than LoRA hooks
        import torch

        model.to(device=device, dtype=getattr(torch, dtype)).eval()
        from rcgrpo_tasks.hf_session import use_cpu_attention

        use_cpu_attention(model)
        self._init(model, tokenizer)
        self.info = {"backend": "hf", "model": str(path), "adapter": str(adapter) if adapter else None,
                     "dtype": dtype}

    @classmethod
    def from_model(cls, model, tokenizer, autocast: bool = False) -> "HFBackend":
        """Wrap an in-memory (possibly PEFT-wrapped, training-mode) model; generation runs in eval mode.

        `autocast`: run forwards under bf16 autocast where the CPU has native bf16 (faster matmuls on fp32
        weights; log-probs then bf16-precise).
        """
        self = cls.__new__(cls)
        self._init(model, tokenizer, autocast)
        self.info = {"backend": "hf", "model": "<in-memory>", "adapter": None, "autocast": self.autocast,
                     "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
        return self

    def _init(self, model, tokenizer, autocast: bool = False) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.autocast = bool(autocast) and (model.device.type != "cpu" or bf16_supported())
        self.max_positions = int(getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS)
        self._stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @property
    def stop_ids(self) -> set[int]:
        return self._stops

    def describe(self) -> dict:
        return dict(self.info)

    def session(self) -> Session:
        from rcgrpo_tasks.hf_session import HFSession

        return HFSession(self)


# -------------------------------------------------------------------------------------------------- vllm
class VLLMBackend(Backend):
    """vLLM offline engine (GPU). Prefix caching reuses shared prompts and each row's conversation so far."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.85, max_lora_rank: int = 64, **engine_kwargs):
        try:
            import vllm
        except ImportError as exc:
            raise ModelLoadError("backend 'vllm' needs the GPU extra: `pip install '.[gpu]'` on a CUDA host") from exc
        path = check_model_dir(model_dir)
        adapter = check_adapter_dir(adapter_dir) if adapter_dir else None
        self.llm = vllm.LLM(model=str(path), dtype=dtype, enable_prefix_caching=True,
                            enable_lora=adapter is not None, max_lora_rank=max_lora_rank,
                            gpu_memory_utilization=gpu_memory_utilization, **engine_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_positions = self.llm.llm_engine.model_config.max_model_len
        self.lora = vllm.lora.request.LoRARequest("adapter", 1, str(adapter)) if adapter else None
        self.info = {"backend": "vllm", "model": str(path), "adapter": str(adapter) if adapter else None}

    def describe(self) -> dict:
        return dict(self.info)

    def session(self) -> Session:
        return _VLLMSession(self)


class _VLLMSession(Session):
    _seeds = itertools.count()

    def __init__(self, backend: VLLMBackend):
        self.b = backend

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import vllm
        from vllm.inputs import TokensPrompt

        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        params = [vllm.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=cap, logprobs=0,
            seed=None if sampling.seed is None else sampling.seed + next(self._seeds),
            stop_token_ids=sorted(self.b.stop_ids)) for cap in caps]
        outs = self.b.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                   lora_request=self.b.lora, use_tqdm=False)
        result = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = [lp[t].logprob for t, lp in zip(ids, o.logprobs)]
            finish = "stop" if ids and ids[-1] in self.b.stop_ids else "length"
            result.append(Completion(ids, lps, _decode(self.b.tokenizer, ids, self.b.stop_ids), finish))
        return result


def load_backend(name: str, model_dir: str | Path, adapter_dir: str | Path | None = None, **kwargs) -> Backend:
    """`hf` or `vllm` backend for a model folder (+ optional PEFT adapter folder)."""
    if name == "hf":
        return HFBackend(model_dir, adapter_dir, **kwargs)
    if name == "vllm":
        return VLLMBackend(model_dir, adapter_dir, **kwargs)
    raise ValueError(f"unknown backend {name!r}; expected 'hf' or 'vllm'")
