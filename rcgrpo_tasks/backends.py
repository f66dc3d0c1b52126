"""Generation backends behind one interface: token-id prompts in, sampled token ids + log-probs out.

`Backend.session()` returns a `Session` whose `generate(keys, prompts, sampling)` continues a set of
rollouts (one row per key). A session may keep state between calls; callers pass each row's WHOLE
sequence so far and the backend decides what it can reuse:
- `hf` (CPU default, also the in-memory model TRL trains: `HFBackend.from_model(model, tokenizer)`):
  transformers with a hand-written sampling loop over one batched KV cache per session. The prompt
  prefix shared by all rows (the system prompt + task of a GRPO group) is prefilled once and the cache
  row-copied; at later steps each row's cache is extended with only the new tokens (the tool
  observations and next user turn) instead of re-prefilling the conversation. Rows of different lengths
  share the cache through masked "holes" (position ids from the attention mask), compacted when holes
  dominate. Log-probs are those of the sampling distribution `softmax(logits / T)` (T = 1 when greedy) —
  what TRL recomputes for the GRPO ratio; top-p truncation is not folded in.
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
        try:  # sft.load_trained is THE loader of trained outputs (reward tokens, resized embeddings)
            model, tokenizer = sft.load_trained(path, adapter, dtype=dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # OSError, ValueError, peft shape mismatches (RuntimeError), ...
            where = f"adapter {adapter} on " if adapter else ""
            raise ModelLoadError(f"{where}model folder {path}: could not load: {exc}") from exc
        if merge_adapter and hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()  # plain weights decode faster than LoRA hooks
        model.to(device).eval()
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
        return HFSession(self)


CPU_ATTENTION = "rcgrpo_cpu"


def _cpu_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """sdpa, except one-token decode: a GQA-packed matmul + softmax (CPU sdpa with a mask is slow in bf16)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, _, d = query.shape
    hkv = key.shape[1]
    scores = torch.matmul(query.reshape(b, hkv, h // hkv, d), key.transpose(2, 3))
    scores = scores * (scaling if scaling is not None else d**-0.5)
    if attention_mask is not None:  # (b, 1, 1, L): bool (True = attend) or additive float
        scores = scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
            else scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def use_cpu_attention(model) -> bool:
    """Switch a CPU model to `_cpu_attention` (registered once with transformers' attention interfaces)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(CPU_ATTENTION, _cpu_attention)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    model.set_attn_implementation(CPU_ATTENTION)
    return True


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix, leaving every row at least one token of its own."""
    limit = min(len(s) for s in seqs) - 1
    first = seqs[0]
    for i in range(max(limit, 0)):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return max(limit, 0)


def _prefix_groups(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Rows grouped by shared prompt prefix: [(row indices, prefix length)].

    Greedy over the lexicographically sorted prompts: a row joins the current group when prefilling the
    group's (possibly shorter) common prefix once saves at least as many tokens as before. A GRPO group
    becomes one group; entries sharing a system prompt share it.
    """
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    groups: list[tuple[list[int], int]] = []
    cur, lcp = [order[0]], len(prompts[order[0]]) - 1
    for i in order[1:]:
        new = min(lcp, _common_prefix([prompts[cur[-1]], prompts[i]]))
        if new > 0 and len(cur) * new >= (len(cur) - 1) * lcp:
            cur.append(i)
            lcp = new
        else:
            groups.append((cur, lcp))
            cur, lcp = [i], len(prompts[i]) - 1
    groups.append((cur, lcp))
    return groups


class HFSession(Session):
    """One batched KV cache for a set of rows (rollouts); see the module docstring."""

    PREFILL_CHUNK = 2048  # max tokens per prefill forward (fewer forwards = faster prefill) ...
    ATTN_BUDGET = 2**24  # ... bounded so rows x chunk x cache length (x heads) stays ~1 GB
    COMPACT_AT = 0.5  # compact the cache when more than half of it is holes ...
    COMPACT_MIN = 512  # ... and it is at least this long

    def __init__(self, backend: HFBackend):
        self.b = backend
        self.cache = None
        self.mask = None  # (rows, cache_len) long: 1 = real token, 0 = hole
        self.keys: list[Hashable] = []
        self.covered: list[list[int]] = []  # per row: token ids whose K/V are in the cache
        self.gen = None

    def close(self) -> None:
        self.cache = self.mask = None

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import torch

        if not prompts:
            return []
        caps = list(max_new_tokens) if max_new_tokens is not None else [sampling.max_new_tokens] * len(prompts)
        if self.gen is None:
            self.gen = torch.Generator(device=self.b.model.device)
            self.gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        model = self.b.model
        was_training = model.training
        model.eval()  # no dropout while sampling, even for the model TRL is training
        try:
            with torch.inference_mode():
                self._align(list(keys), [list(p) for p in prompts])
                logits = self._prefill([p[len(c):] for p, c in zip(prompts, self.covered)])
                return self._decode(logits, sampling, caps)
        finally:
            model.train(was_training)

    # -- cache bookkeeping ---------------------------------------------------------------------------
    def _align(self, keys: list, prompts: list[list[int]]) -> None:
        """Keep/reorder cached rows that each prompt extends; otherwise start over from shared prefixes."""
        import torch

        if self.cache is not None and all(k in self.keys for k in keys):
            idx = [self.keys.index(k) for k in keys]
            if all(len(self.covered[i]) < len(p) and p[:len(self.covered[i])] == self.covered[i]
                   for i, p in zip(idx, prompts)):
                if idx != list(range(len(self.keys))):
                    self.cache.batch_select_indices(torch.tensor(idx))
                    self.mask = self.mask[idx]
                    self.covered = [self.covered[i] for i in idx]
                self.keys = keys
                return
        self.keys = keys
        self._prefill_prefixes(prompts, _prefix_groups(prompts))

    def _prefill_prefixes(self, prompts: list[list[int]], groups: list[tuple[list[int], int]]) -> None:
        """Prefill each group's shared prefix once (batch 1), then lay all rows out in one left-padded cache."""
        import torch
        from transformers import DynamicCache

        caches = []
        for rows, n in groups:
            self.cache, self.mask = DynamicCache(), torch.zeros((1, 0), dtype=torch.long)
            if n:
                self._forward_chunks(torch.tensor([prompts[rows[0]][:n]]), torch.ones((1, n), dtype=torch.long))
            caches.append(self.cache)
        width = max(n for _, n in groups)
        order = [i for rows, _ in groups for i in rows]
        perm = torch.tensor([order.index(i) for i in range(len(prompts))])
        prefix_len = {i: n for rows, n in groups for i in rows}
        self.covered = [list(p[:prefix_len[i]]) for i, p in enumerate(prompts)]
        self.mask = torch.tensor([[0] * (width - prefix_len[i]) + [1] * prefix_len[i] for i in order])[perm]
        holder = next((c for c, (_, n) in zip(caches, groups) if n), None)
        if holder is None:
            self.cache = DynamicCache()
            return
        for li, layer in enumerate(holder.layers):
            for attr in ("keys", "values"):
                parts = []
                for cache, (rows, n) in zip(caches, groups):
                    t = getattr(cache.layers[li], attr) if n else getattr(layer, attr)[:, :, :0]
                    t = torch.nn.functional.pad(t, (0, 0, width - n, 0))  # holes on the left, masked
                    parts.append(t.expand(len(rows), -1, -1, -1))
                setattr(layer, attr, torch.cat(parts)[perm.to(t.device)].contiguous())
        self.cache = holder

    def _forward_chunks(self, ids, new_mask):
        """Append `ids` (rows, S) with `new_mask` to the cache chunk by chunk; logits of the last column."""
        import torch

        base = self.mask.sum(1, keepdim=True)
        pos = base + new_mask.cumsum(1) - 1
        pos = torch.where(new_mask.bool(), pos, base.expand_as(pos))
        logits = None
        total = self.mask.shape[1] + ids.shape[1]
        chunk = max(1, min(self.PREFILL_CHUNK, self.ATTN_BUDGET // (ids.shape[0] * total)))
        for s in range(0, ids.shape[1], chunk):
            sl = slice(s, s + chunk)
            self.mask = torch.cat([self.mask, new_mask[:, sl]], dim=1)
            dev = self.b.model.device
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.b.autocast):
                out = self.b.model(input_ids=ids[:, sl].to(dev), attention_mask=self.mask.to(dev),
                                   position_ids=pos[:, sl].to(dev), past_key_values=self.cache,
                                   use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        return logits

    def _prefill(self, suffixes: list[list[int]]):
        """Append each row's new tokens (left-padded so every row ends at the last column)."""
        import torch

        width = max(len(s) for s in suffixes)
        ids = torch.full((len(suffixes), width), self.b.pad_id, dtype=torch.long)
        new_mask = torch.zeros((len(suffixes), width), dtype=torch.long)
        for i, s in enumerate(suffixes):
            ids[i, width - len(s):] = torch.tensor(s)
            new_mask[i, width - len(s):] = 1
            self.covered[i] = self.covered[i] + s
        logits = self._forward_chunks(ids, new_mask)
        self._maybe_compact()
        return logits

    def _maybe_compact(self) -> None:
        """Drop holes (rows re-left-aligned) once they dominate the cache; attention cost follows its length."""
        import torch

        rows, length = self.mask.shape
        valid = self.mask.sum(1)
        if length < self.COMPACT_MIN or valid.sum().item() > (1 - self.COMPACT_AT) * rows * length:
            return
        width = int(valid.max())
        index = torch.zeros((rows, width), dtype=torch.long)
        new_mask = torch.zeros((rows, width), dtype=torch.long)
        for i in range(rows):
            pos = self.mask[i].nonzero().squeeze(1)
            index[i, width - len(pos):] = pos
            new_mask[i, width - len(pos):] = 1
        for layer in self.cache.layers:
            gather = index.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.mask = new_mask

    # -- sampling --------------------------------------------------------------------------------------
    def _decode(self, logits, sampling: SamplingParams, caps: list[int]) -> list[Completion]:
        import torch

        rows = logits.shape[0]
        stops = self.b.stop_ids
        out_ids: list[list[int]] = [[] for _ in range(rows)]
        out_lp: list[list[float]] = [[] for _ in range(rows)]
        finish = [None] * rows
        for _ in range(max(caps)):
            tok, lp = _sample(logits, sampling, self.gen)
            feed = torch.full((rows, 1), self.b.pad_id, dtype=torch.long)
            live = torch.zeros((rows, 1), dtype=torch.long)
            for i, (t, l) in enumerate(zip(tok.tolist(), lp.tolist())):
                if finish[i]:
                    continue
                out_ids[i].append(t)
                out_lp[i].append(l)
                if t in stops:
                    finish[i] = "stop"
                elif len(out_ids[i]) >= caps[i]:
                    finish[i] = "length"
                else:  # feed the token back; a row's last token is left for its next prompt to cover
                    feed[i, 0], live[i, 0] = t, 1
                    self.covered[i].append(t)
            if all(finish):
                break
            logits = self._forward_chunks(feed, live)
        tokz = self.b.tokenizer
        return [Completion(ids, lps, _decode(tokz, ids, stops), f or "length")
                for ids, lps, f in zip(out_ids, out_lp, finish)]


def _sample(logits, sampling: SamplingParams, gen):
    """(token, log-prob under softmax(logits / T)) per row; greedy when T == 0."""
    import torch

    logits = logits.float()
    if sampling.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
    tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


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
