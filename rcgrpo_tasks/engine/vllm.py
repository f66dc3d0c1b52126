"""The `vllm` backends (GPU workers, extra `[gpu]`; untested on CPU machines).

- `VLLMBackend`: vLLM's offline engine with automatic prefix caching and LoRA requests for adapters; loads
  a model folder, or wraps an engine someone else manages (`from_llm`: the one TRL keeps in sync with the
  policy it trains). Import-guarded: on a machine without vLLM it fails with ModelLoadError.
- `VLLMServerBackend`: completions from a vLLM server through a client with TRL's `VLLMClient.generate`
  interface (`trl vllm-serve`), one request per row, which the server batches.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from rcgrpo_tasks.engine.backend import DEFAULT_MAX_POSITIONS, Backend, Completion, Session, decode_text
from rcgrpo_tasks.engine.models import ModelLoadError, check_adapter_dir, check_model_dir


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
        llm = vllm.LLM(model=str(path), dtype=dtype, enable_prefix_caching=True, enable_lora=adapter is not None,
                       max_lora_rank=max_lora_rank, gpu_memory_utilization=gpu_memory_utilization, **engine_kwargs)
        lora = vllm.lora.request.LoRARequest("adapter", 1, str(adapter)) if adapter else None
        self._init(llm, llm.get_tokenizer(), lora, str(path), str(adapter) if adapter else None)

    @classmethod
    def from_llm(cls, llm, tokenizer, model: str = "<in-process>") -> VLLMBackend:
        """Wrap an existing `vllm.LLM` (no adapter request), e.g. the engine TRL's `colocate` mode manages."""
        self = cls.__new__(cls)
        self._init(llm, tokenizer, None, model, None)
        return self

    def _init(self, llm, tokenizer, lora, model: str, adapter: str | None) -> None:
        self.llm, self.tokenizer, self.lora = llm, tokenizer, lora
        self.max_positions = llm.llm_engine.model_config.max_model_len
        self.info = {"backend": "vllm", "model": model, "adapter": adapter}

    def describe(self) -> dict:
        return dict(self.info)

    def session(self) -> Session:
        return _VLLMSession(self)


def refuse_guidance(sampling) -> None:
    """vLLM samples each request on its own: it cannot mix two contexts' logits per token (the `hf` backend
    can). A guided request is an error, never a silently unguided one."""
    if sampling.guidance:
        raise ValueError("guidance > 0 needs the hf backend (vLLM cannot combine two contexts' logits)")


class _VLLMSession(Session):
    _seeds = itertools.count()

    def __init__(self, backend: VLLMBackend):
        self.b = backend

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import vllm
        from vllm.inputs import TokensPrompt

        refuse_guidance(sampling)
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
            result.append(Completion(ids, lps, decode_text(self.b.tokenizer, ids, self.b.stop_ids), finish))
        return result


class VLLMServerBackend(Backend):
    """A vLLM server behind `client.generate(prompts, n, temperature, top_p, max_tokens, logprobs)` (TRL's
    `VLLMClient`): token-id prompts in, `{"completion_ids", "logprobs"}` out. No sampling seed: the server
    draws its own; the stop tokens are the tokenizer's (the server stops at its model's EOS)."""

    name = "vllm"

    def __init__(self, client, tokenizer, max_positions: int = DEFAULT_MAX_POSITIONS, model: str = "<server>"):
        self.client, self.tokenizer, self.max_positions = client, tokenizer, max_positions
        self.info = {"backend": "vllm", "model": model, "adapter": None}

    def describe(self) -> dict:
        return dict(self.info)

    def session(self) -> Session:
        return _ServerSession(self)


class _ServerSession(Session):
    def __init__(self, backend: VLLMServerBackend):
        self.b = backend

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        refuse_guidance(sampling)
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        stops = self.b.stop_ids
        out = []
        for prompt, cap in zip(prompts, caps):  # per-row caps; the server batches concurrent requests
            r = self.b.client.generate([list(prompt)], n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                       max_tokens=cap, logprobs=0)
            ids, lps = r["completion_ids"][0], [lp[0] for lp in r["logprobs"][0]]
            finish = "stop" if ids and ids[-1] in stops else "length"
            out.append(Completion(ids, lps, decode_text(self.b.tokenizer, ids, stops), finish))
        return out
