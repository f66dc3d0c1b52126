"""The `hf` backend: a transformers model decoded by hand over one preallocated KV cache per session.

- Placement: `HFBackend(..., device="auto")` (`rcgrpo_tasks.engine.device.resolve_device`: CUDA when
  available; a CUDA request without CUDA is a ConfigError, never a silent CPU run); `from_model` keeps the
  model where it is. `describe()` says where it runs (device, dtype).
- Batching and the cache (`engine.hf_cache.CacheLayout`): every row of a `generate` call is decoded
  together in one preallocated cache; shared prompt prefixes are prefilled once, later calls append
  only each row's new tokens.
- Decode loop: one step = one forward of every row + sampling + bookkeeping, all device tensors updated in
  place; the host only checks "any row still live?" (every step on CPU, every `STOP_CHECK` steps on CUDA,
  where an idle row costs nothing) and reads the tokens once at the end. On CUDA the step is captured as a
  CUDA graph (`cuda_graphs`, default on there) and replayed; on CPU it runs eagerly.
- Ended rows leave the batch (CPU, `narrow_rows`): once at most half the rows are live, the live ones go on
  in a narrower batch (their cache copied, written back at the end); a CPU step costs with its rows, a CUDA
  one (graph, static shapes) does not. Guided rows keep their twins and never narrow.
- Sampling: `rcgrpo_tasks.engine.sampling` (counter-based noise per row: the same tokens whatever the batch).
- Reward-token guidance (`SamplingParams.guidance` > 0): every row gets a twin with the other reward token
  (`sampling.with_twins`), decoded in the same batch and cache; the row samples from the guided logits and the twin
  is fed the same token. Cost: twice the rows. Log-probs are those of the guided distribution.
- `rcgrpo_cpu` attention (`rcgrpo_tasks.engine.cpu_attention`; CPU models the backend loads itself and RL
  rollout snapshots): torch's GQA sdpa for prefill, a GQA-packed matmul-softmax for one-token decode.
"""

from __future__ import annotations

import secrets
from collections.abc import Hashable
from pathlib import Path

from rcgrpo_tasks.engine.backend import (
    DEFAULT_MAX_POSITIONS,
    Backend,
    Completion,
    SamplingParams,
    Session,
    decode_text,
    stop_token_ids,
)
from rcgrpo_tasks.engine.compute import check_resolved
from rcgrpo_tasks.engine.cpu_attention import CPU_ATTENTION, use_cpu_attention
from rcgrpo_tasks.engine.device import placement, resolve_device
from rcgrpo_tasks.engine.graphs import CPU, GRAPH, DecodeState, StepGraph, decode_path, graphs_wanted
from rcgrpo_tasks.engine.hf_cache import CacheLayout, CacheRows
from rcgrpo_tasks.engine.kvcache import decode_mask
from rcgrpo_tasks.engine.models import (
    ModelLoadError,
    check_adapter_dir,
    check_model_dir,
    load_trained,
)
from rcgrpo_tasks.engine.prefill import batched_prefill_wanted
from rcgrpo_tasks.engine.sampling import guided_logits, row_seed, sample_tokens, with_twins

BOOL_MASK_ATTENTION = ("sdpa", CPU_ATTENTION, "flex_attention")
"""Attention implementations that take a bool mask (True = attend); `eager` adds a float mask instead."""


class HFSession(CacheLayout, Session):
    """One batched KV cache for a set of rows (rollouts): laid out by `CacheLayout` (`hf_cache`), decoded
    here; see the module docstring."""

    def __init__(self, backend: HFBackend):
        self.b = backend
        self.st: CacheRows | None = None
        self.keys: list[Hashable] = []
        self.covered: list[list[int]] = []  # per row: token ids whose K/V are in the cache
        self.seeds: dict[Hashable, int] = {}
        self.base_seed: int | None = None

    def close(self) -> None:
        self.st = None

    def seed_rows(self, seeds) -> None:
        self.seeds.update(seeds)

    @property
    def cache(self):
        return self.st.cache if self.st else None

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import torch

        if not prompts:
            return []
        caps = list(max_new_tokens) if max_new_tokens is not None else [sampling.max_new_tokens] * len(prompts)
        n, keys, prompts = len(prompts), list(keys), [list(p) for p in prompts]
        if sampling.guidance:
            keys, prompts, caps = with_twins(keys, prompts, caps, sampling.guidance_pair)
        if self.base_seed is None:
            self.base_seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        model = self.b.model
        was_training = model.training
        model.eval()  # no dropout while sampling, even for the model TRL is training
        try:
            with torch.inference_mode():
                self._align(keys, prompts, max(caps))
                logits = self._prefill([p[len(c):] for p, c in zip(prompts, self.covered)], max(caps))
                return self._decode(logits, sampling, caps)[:n]
        finally:
            model.train(was_training)

    # -- decoding --------------------------------------------------------------------------------------
    def _decode(self, logits, sampling: SamplingParams, caps: list[int]) -> list[Completion]:

        st, dev = self.st, self.b.model.device
        steps = max(caps)
        d = DecodeState(st.cache.n, caps, steps, self._row_seeds(), sorted(self.b.stop_ids), dev)
        d.record(*self._sample(logits, sampling, d.seeds))
        runner = self._runner(d, sampling)
        check = self.b.stop_check_every
        narrow = self.b.narrow_rows and not sampling.guidance and decode_path(dev.type, self.b.cuda_graphs) == CPU
        outer: list = []  # the states narrowed from, outermost first
        done = 1
        try:
            for t in range(1, steps):
                if t % check == 0:
                    live = int(d.live.sum())
                    if not live:
                        break
                    if narrow and 2 * live <= len(d.live):
                        d = self._narrow(d, outer)
                        runner = self._runner(d, sampling)
                runner(t)
                done += 1
        finally:
            while outer:
                d = self._widen(d, *outer.pop())
        st.cache.advance(done - 1)  # every step but the first sampled one fed a column
        return self._completions(d.out_tok[:, :done].tolist(), d.out_lp[:, :done].tolist())

    def _narrow(self, d: DecodeState, outer: list) -> DecodeState:
        """Decode on only the live rows from here on (CPU): a step costs with the rows it carries (docs/engine.md,
        "Ended rows leave the batch"), and a seeded row samples the same tokens in any batch. The live rows'
        cache (own columns so far; shared prefixes stay shared) and state are copied into a narrower session
        state; `_widen` writes them back. Ended rows are untouched: their cache and outputs are final."""
        st = self.st
        index = d.live.nonzero().squeeze(1)
        column = int(d.write_at)
        outer.append((st, d, index, column))
        self.st = st.take(index, st.cache.capacity, width=column)
        return d.select(index)

    def _widen(self, d: DecodeState, st: CacheRows, full: DecodeState, index, column: int) -> DecodeState:
        """Write narrowed rows `index` back (the columns they fed since `column`, mask, positions, outputs)."""
        st.put(self.st, index, column, int(d.write_at) - column)
        full.put(index, d)
        self.st = st
        return full

    def _row_seeds(self):
        import torch

        vals = [self.seeds[k] if k in self.seeds else row_seed(self.base_seed, k) for k in self.keys]
        return torch.tensor(vals, dtype=torch.int64, device=self.b.model.device)

    def _step(self, d: DecodeState, sampling: SamplingParams, attend: int) -> None:
        """One decode step on device tensors only (graph-safe): feed each live row's last token, sample the next."""
        import torch

        st = self.st
        feed = torch.where(d.live, d.tok, self.b.pad_id)[:, None]
        st.mask.index_copy_(1, d.write_at, d.live[:, None])
        st.cache.write_at, st.cache.attend = d.write_at, attend
        try:
            with torch.autocast(st.mask.device.type, dtype=torch.bfloat16, enabled=self.b.autocast,
                                cache_enabled=False):
                out = self.b.model(input_ids=feed, position_ids=st.nreal[:, None],
                                   attention_mask=decode_mask(st.mask, attend, self.b.additive_mask),
                                   past_key_values=st.cache, use_cache=True, logits_to_keep=1,
                                   **st.cache.attention_kwargs())
        finally:
            st.cache.write_at = None
        st.nreal.add_(d.live.long())
        d.write_at.add_(1)
        d.t.add_(1)
        d.record(*self._sample(out.logits[:, -1, :], sampling, d.seeds))

    def _sample(self, logits, sampling: SamplingParams, seeds):
        """Each row's next token and log-prob; with guidance the first half of the rows (the goals) sample
        from the guided logits with their own seeds and their twins (second half) take the same token."""
        if not sampling.guidance:
            return sample_tokens(logits, sampling, seeds, self.st.nreal)
        n = logits.shape[0] // 2
        tok, lp = sample_tokens(guided_logits(logits[:n], logits[n:], sampling.guidance), sampling, seeds[:n],
                                self.st.nreal[:n])
        return tok.repeat(2), lp.repeat(2)

    def _runner(self, d: DecodeState, sampling: SamplingParams):
        """`step(t)`: attention over the whole capacity (masked columns add exactly 0): on CPU eagerly, since
        attending a column slice of the buffers makes CPU's bf16 matmul copy every row's cache at every
        step (measured: docs/log.md, "Engine"); on CUDA a captured graph of
        `_step`, captured after one eager step (the warm-up) and replayed. Eager CUDA reads the columns in use."""
        st, path = self.st, decode_path(self.st.mask.device.type, self.b.cuda_graphs)
        if path == CPU:
            return lambda t: self._step(d, sampling, st.cache.capacity)
        if path != GRAPH:
            return lambda t: self._step(d, sampling, st.cache.n + t)
        graph = StepGraph(lambda: self._step(d, sampling, st.cache.capacity), st.mask.device, self.b.model)
        return lambda t: graph.run()

    def _completions(self, toks: list[list[int]], lps: list[list[float]]) -> list[Completion]:
        """Per row: the tokens it sampled (recorded while live); all but the last were fed to the cache."""
        stops, tokz = self.b.stop_ids, self.b.tokenizer
        out = []
        for i, (row, lp) in enumerate(zip(toks, lps)):
            k = next((j for j, t in enumerate(row) if t < 0), len(row))
            ids, lp = row[:k], lp[:k]
            self.covered[i] += ids[:-1]
            finish = "stop" if ids[-1] in stops else "length"
            out.append(Completion(ids, lp, decode_text(tokz, ids, stops), finish))
        return out


class HFBackend(Backend):
    """transformers model + tokenizer on `device` (auto | cpu | cuda | cuda:N); `dtype`: float32 | bfloat16, as
    the stage resolved it (`engine.compute.resolve_compute`: THE dtype rule); `auto` is refused here, never
    silently float32. `cuda_graphs`: capture the
    decode step on CUDA (None = on for CUDA; never used on CPU)."""

    name = "hf"
    STOP_CHECK_CUDA = 8
    """On CUDA the host asks "any row live?" every this many steps (a sync stalls the GPU queue)."""

    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None, dtype: str = "float32",
                 device: str = "auto", merge_adapter: bool = True, cuda_graphs: bool | None = None):
        import torch

        place = resolve_device(device)  # before loading: a bad device fails fast
        path = check_model_dir(model_dir)
        adapter = check_adapter_dir(adapter_dir) if adapter_dir else None
        dtype = check_resolved(dtype, "hf backend dtype")  # THE dtype rule: the stage resolved it (`engine.compute`)
        # An adapter is merged in float32 and the result cast to `dtype`, exactly as `rl` saves its merged
        # policies: otherwise an RL run that changed nothing (all-zero advantages) would decode differently
        # from its init only through bf16 merge rounding (greedy outputs diverge).
        load_dtype = "float32" if adapter and merge_adapter else dtype
        try:  # load_trained is THE loader of trained outputs (reward tokens, resized embeddings)
            model, tokenizer = load_trained(path, adapter, dtype=load_dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # OSError, ValueError, peft shape mismatches (RuntimeError), ...
            where = f"adapter {adapter} on " if adapter else ""
            raise ModelLoadError(f"{where}model folder {path}: could not load: {exc}") from exc
        if merge_adapter and hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()  # plain weights decode faster than LoRA hooks
        model.to(device=place, dtype=getattr(torch, dtype)).eval()
        use_cpu_attention(model)
        self._init(model, tokenizer, cuda_graphs=cuda_graphs)
        self.info = {"backend": "hf", "model": str(path), "adapter": str(adapter) if adapter else None,
                     **placement(model)}

    @classmethod
    def from_model(cls, model, tokenizer, autocast: bool = False, cuda_graphs: bool | None = None) -> "HFBackend":
        """Wrap an in-memory (possibly PEFT-wrapped, training-mode) model where it is; generation runs in eval mode.

        `autocast`: run forwards under bf16 autocast (the caller decides by THE dtype rule, `engine.dtype`;
        faster matmuls on fp32 weights where the device has them, log-probs then bf16-precise).
        """
        self = cls.__new__(cls)
        self._init(model, tokenizer, autocast, cuda_graphs)
        self.info = {"backend": "hf", "model": "<in-memory>", "adapter": None, "autocast": self.autocast,
                     **placement(model)}
        return self

    def _init(self, model, tokenizer, autocast: bool = False, cuda_graphs: bool | None = None) -> None:
        import torch

        self.model, self.tokenizer = model, tokenizer
        on_cuda = model.device.type == "cuda"
        self.autocast = bool(autocast)
        self.cuda_graphs = graphs_wanted(model.device.type, cuda_graphs)
        self.stop_check_every = self.STOP_CHECK_CUDA if on_cuda else 1
        self.narrow_rows = True  # CPU: ended rows leave the decode batch (`HFSession._narrow`); False: never
        self.max_positions = int(getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS)
        self._stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        self.additive_mask = None if attn in BOOL_MASK_ATTENTION else next(model.parameters()).dtype
        if attn not in BOOL_MASK_ATTENTION + ("eager",):
            raise ModelLoadError(f"hf backend: attention {attn!r} cannot take its padding mask; load the model "
                                 f"with attn_implementation='sdpa' or 'eager'")
        if self.additive_mask is not None and self.autocast:
            self.additive_mask = torch.bfloat16
        self.shared_prefixes = attn == CPU_ATTENTION  # prefixes stored once: the attention that reads them
        self.batched_prefill = batched_prefill_wanted(model.device.type)  # forwards by length bucket, not node

    def exact_model(self):
        """This backend's model in float32, for what is measured from forward passes (the teacher-forced
        margin): the model itself where its weights are float32 and no autocast runs, else the same folders
        loaded again in float32 on the same device, merged as here. bf16 moves a sequence's summed log-prob by
        as much as the margin it would measure, and on the CPU measured it was slower too (docs/log.md)."""
        import torch

        if next(self.model.parameters()).dtype == torch.float32 and not self.autocast:
            return self.model
        if self.info.get("model") in (None, "<in-memory>"):
            raise ValueError("exact_model: an in-memory model not in float32 has no folder to reload")
        return HFBackend(self.info["model"], self.info["adapter"], dtype="float32",
                         device=str(self.model.device), cuda_graphs=False).model

    @property
    def stop_ids(self) -> set[int]:
        return self._stops

    def describe(self) -> dict:
        return dict(self.info)

    def session(self) -> Session:
        return HFSession(self)
