"""The `hf` backend: a transformers model decoded by hand over one preallocated KV cache per session.

- Placement: `HFBackend(..., device="auto")` (`rcgrpo_tasks.engine.device.resolve_device`: CUDA when
  available; a CUDA request without CUDA is a ConfigError, never a silent CPU run); `from_model` keeps the
  model where it is. `describe()` says where it runs (device, dtype).
- Batching: every row of a `generate` call is decoded together (the rollout loop hands over every group of
  a batch). Each prompt prefix several rows share is prefilled once at batch 1, on top of the shorter one it
  extends (`kvcache.prefix_tree`: a system prompt several entries share, each entry's task on it, a GRPO
  group's rows up to their reward token, the rows with the same token past it), and copied into its rows, all
  rows laid out left-padded in one cache (`rcgrpo_tasks.engine.kvcache`).
- CUDA prefill (`batched_prefill`, `rcgrpo_tasks.engine.prefill`): there the number of forwards is what
  costs, so a new set of rows is prefilled by length bucket instead: each prompt rows share once, in a few
  left-padded batches per bucket, its K/V copied into its rows; the prefix tree above is the CPU's.
- Shared prefixes (CPU attention): each of those prefixes is stored once, as a block the rows that end there
  read in attention (`kvcache.SharedPrefixes`), not copied into every row; the rows hold what follows it.
- KV reuse: a later call appends only each row's new tokens (observations, next user turn), never
  re-prefilling. Rows of different lengths share the cache through masked holes (position ids count real
  tokens), compacted once holes exceed `COMPACT_AT`; rows whose keys disappear are dropped. A span of new
  columns only some rows use (one long tool reply) is computed for those rows alone (`ragged_segments`).
- Decode loop: one step = one forward of every row + sampling + bookkeeping, all device tensors updated in
  place; the host only checks "any row still live?" (every step on CPU, every `STOP_CHECK` steps on CUDA,
  where an idle row costs nothing) and reads the tokens once at the end. On CUDA the step is captured as a
  CUDA graph (`cuda_graphs`, default on there) and replayed; on CPU it runs eagerly.
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
from rcgrpo_tasks.engine.cpu_attention import CPU_ATTENTION, use_cpu_attention
from rcgrpo_tasks.engine.device import placement, resolve_device
from rcgrpo_tasks.engine.graphs import CPU, GRAPH, DecodeState, StepGraph, decode_path, graphs_wanted
from rcgrpo_tasks.engine.kvcache import (
    PrefixNode,
    SharedPrefixes,
    decode_mask,
    plan_capacity,
    prefill_mask,
    prefix_lengths,
    prefix_tree,
    ragged_segments,
    slot_cache_class,
    walk,
)
from rcgrpo_tasks.engine.models import (
    ModelLoadError,
    bf16_supported,
    check_adapter_dir,
    check_model_dir,
    last_positions,
    load_trained,
)
from rcgrpo_tasks.engine.prefill import batched_prefill_wanted, left_padded, plan_prefill
from rcgrpo_tasks.engine.sampling import guided_logits, row_seed, sample_tokens, with_twins

BOOL_MASK_ATTENTION = ("sdpa", CPU_ATTENTION, "flex_attention")
"""Attention implementations that take a bool mask (True = attend); `eager` adds a float mask instead."""


class _Rows:
    """A cache and its per-row bookkeeping on the model's device: `mask` (rows, capacity) bool = real token,
    `nreal` (rows,) int64 = real tokens per row (= the next token's position id)."""

    def __init__(self, rows: int, capacity: int, device):
        import torch

        self.cache = slot_cache_class()(rows, capacity)
        self.mask = torch.zeros((rows, capacity), dtype=torch.bool, device=device)
        self.nreal = torch.zeros(rows, dtype=torch.int64, device=device)

    def reserve(self, needed: int) -> None:
        """Room for `needed` columns (cache buffers and mask grow together)."""
        import torch

        old = self.cache.capacity
        if self.cache.reserve(needed):
            mask = torch.zeros((self.mask.shape[0], self.cache.capacity), dtype=torch.bool, device=self.mask.device)
            mask[:, :old] = self.mask
            self.mask = mask


class HFSession(Session):
    """One batched KV cache for a set of rows (rollouts); see the module docstring."""

    PREFILL_CHUNK = 2048  # max tokens per prefill forward (fewer forwards = faster prefill) ...
    ATTN_BUDGET = 2**24  # ... bounded so rows x chunk x cache length (x heads) stays ~1 GB
    COMPACT_AT = 0.5  # compact the cache when more than half of it is holes ...
    COMPACT_MIN = 512  # ... and it is at least this long
    RAGGED_MIN = 64  # a suffix span only some rows use runs on those rows alone when at least this long
    PREFIX_MIN = 16  # a shared prefix leaf shorter than this joins the rows' rests (`prefix_tree`'s min_len)

    def __init__(self, backend: HFBackend):
        self.b = backend
        self.st: _Rows | None = None
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

    # -- cache bookkeeping ---------------------------------------------------------------------------
    def _align(self, keys: list, prompts: list[list[int]], reserve: int) -> None:
        """Keep/reorder cached rows that each prompt extends; otherwise start over from shared prefixes."""
        import torch

        if self.st is not None and all(k in self.keys for k in keys):
            idx = [self.keys.index(k) for k in keys]
            if all(len(self.covered[i]) < len(p) and p[:len(self.covered[i])] == self.covered[i]
                   for i, p in zip(idx, prompts)):
                if idx != list(range(len(self.keys))):
                    index = torch.tensor(idx, device=self.st.mask.device)
                    self.st.cache.select_rows(index)
                    self.st.mask, self.st.nreal = self.st.mask[index], self.st.nreal[index]
                    self.covered = [self.covered[i] for i in idx]
                self.keys = keys
                return
        self.keys = keys
        if self.b.batched_prefill:
            self._prefill_batched(prompts, reserve)
        else:
            self._prefill_prefixes(prompts, prefix_tree(prompts, self.PREFIX_MIN), reserve)

    def _prefill_prefixes(self, prompts: list[list[int]], tree: list[PrefixNode], reserve: int) -> None:
        """Prefill each shared prefix of `tree` once (batch 1) on top of its parent's, depth first, and give it
        to the rows that end there: as one block of the cache's `SharedPrefixes` (CPU attention), else copied
        into each row, right-aligned at column `width` (the longest prefix); the cache is sized for the call."""
        import torch

        dev = self.b.model.device
        prefix_len = prefix_lengths(tree, len(prompts))
        ends = [node for node in walk(tree) if node.ends]
        shared = SharedPrefixes.plan([n.ends for n in ends], [n.end for n in ends], len(prompts), dev) \
            if self.b.shared_prefixes and ends else None
        width = 0 if shared is not None else max(prefix_len)
        longest_rest = max(len(p) - prefix_len[i] for i, p in enumerate(prompts))
        self.st = st = _Rows(len(prompts), plan_capacity(0, width + longest_rest + reserve), dev)
        st.cache.shared = shared

        def visit(node: PrefixNode, parent: _Rows | None) -> None:
            ids = prompts[node.row][node.start:node.end]
            if parent is None:
                cur = _Rows(1, node.end, dev)
                self._append(cur, torch.tensor([ids]), torch.ones((1, len(ids)), dtype=torch.bool))
            else:
                cur = self._extend(parent, ids)
            if node.ends:
                index = torch.tensor(node.ends, device=dev)
                if shared is not None:
                    shared.put(ends.index(node), cur.cache)
                else:
                    st.cache.place(cur.cache, index, width - node.end)
                    st.mask[index, width - node.end:width] = True
                st.nreal[index] = node.end
            for child in node.children:
                visit(child, cur)

        for root in tree:
            visit(root, None)
        st.cache.n = width
        self.covered = [list(p[:prefix_len[i]]) for i, p in enumerate(prompts)]

    def _prefill_batched(self, prompts: list[list[int]], reserve: int) -> None:
        """The CUDA path (`engine.prefill`): each prompt rows share, less its last token, prefilled once in
        left-padded batches by length bucket, copied into its rows right-aligned at `width` (`_prefill`: the rest)."""
        import torch

        dev, plan = self.b.model.device, plan_prefill(prompts)
        width = max(len(h) for h in plan.heads)
        rest = max(len(p) - len(h) for p, h in zip(prompts, plan.heads))
        self.st = st = _Rows(len(prompts), plan_capacity(0, width + rest + reserve), dev)
        for batch in plan.batches:
            sub = _Rows(len(batch), max(len(plan.distinct[k]) for k in batch), dev)
            self._append(sub, *left_padded([plan.distinct[k] for k in batch], self.b.pad_id))
            rows = torch.tensor([r for k in batch for r in plan.rows_of[k]], device=dev)
            take = torch.tensor([j for j, k in enumerate(batch) for _ in plan.rows_of[k]], device=dev)
            st.cache.place(sub.cache, rows, width - sub.cache.n, take)
            st.mask[rows, width - sub.cache.n:width] = sub.mask[take]
            st.nreal[rows] = sub.nreal[take]
        st.cache.n = width
        self.covered = [list(h) for h in plan.heads]  # per row: its own list (extended in place later)

    def _extend(self, one: _Rows, ids: list[int]) -> _Rows:
        """A copy of batch-1 prefix cache `one` with `ids` appended (a longer shared prefix)."""
        import torch

        n, dev = one.cache.n, self.b.model.device
        two = _Rows.__new__(_Rows)
        two.cache = one.cache.take_rows(torch.tensor([0], device=dev), n + len(ids))
        two.mask = torch.zeros((1, n + len(ids)), dtype=torch.bool, device=dev)
        two.mask[:, :n] = True
        two.nreal = one.nreal.clone()
        self._append(two, torch.tensor([ids]), torch.ones((1, len(ids)), dtype=torch.bool))
        return two

    def _append(self, st: _Rows, ids, new_mask):
        """Append `ids` (rows, S; CPU) with `new_mask` (bool) to `st` chunk by chunk; logits of the last column."""
        import torch

        dev = self.b.model.device
        ids, new_mask = ids.to(dev), new_mask.to(dev)
        pos = st.nreal[:, None] + new_mask.long().cumsum(1) - 1
        pos = torch.where(new_mask, pos, st.nreal[:, None])
        rows, width = ids.shape
        blocks = st.cache.shared.width if st.cache.shared is not None else 0
        chunk = max(1, min(self.PREFILL_CHUNK, self.ATTN_BUDGET // (rows * (blocks + st.cache.n + width))))
        logits = None
        for s in range(0, width, chunk):
            q = min(chunk, width - s)
            start = st.cache.n
            st.mask[:, start:start + q] = new_mask[:, s:s + q]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.b.autocast):
                out = self.b.model(input_ids=ids[:, s:s + q], position_ids=pos[:, s:s + q],
                                   attention_mask=prefill_mask(st.mask, start, q, self.b.additive_mask),
                                   past_key_values=st.cache, use_cache=True, logits_to_keep=last_positions(1, q, dev),
                                   **st.cache.attention_kwargs())
            st.cache.advance(q)
            logits = out.logits[:, -1, :]
        st.nreal += new_mask.sum(1)
        return logits

    def _prefill(self, suffixes: list[list[int]], reserve: int):
        """Append each row's new tokens (left-padded so every row ends at the last column)."""
        import torch

        width = max(len(s) for s in suffixes)
        ids = torch.full((len(suffixes), width), self.b.pad_id, dtype=torch.long)
        new_mask = torch.zeros((len(suffixes), width), dtype=torch.bool)
        for i, s in enumerate(suffixes):
            ids[i, width - len(s):] = torch.tensor(s)
            new_mask[i, width - len(s):] = True
            self.covered[i] = self.covered[i] + s
        self.st.reserve(self.st.cache.n + width + reserve)
        logits = None
        for a, b, rows in ragged_segments([len(s) for s in suffixes], self.RAGGED_MIN):
            part = ids[:, a:b], new_mask[:, a:b]
            logits = self._append(self.st, *part) if rows is None else self._append_rows(rows, *part)
        self._maybe_compact()
        return logits

    def _append_rows(self, rows: list[int], ids, new_mask) -> None:
        """`_append` on rows `rows` alone (a copy of their cache); the other rows get holes in these columns."""
        import torch

        st, start, q = self.st, self.st.cache.n, ids.shape[1]
        index = torch.tensor(rows, device=st.mask.device)
        sub = _Rows.__new__(_Rows)
        sub.cache, sub.mask, sub.nreal = st.cache.take_rows(index, start + q), st.mask[index, :start + q], st.nreal[index]
        self._append(sub, ids[rows], new_mask[rows])
        st.cache.put_columns(sub.cache, index, start, q)
        st.mask[:, start:start + q] = False
        st.mask[index, start:start + q] = sub.mask[:, start:]
        st.nreal[index] = sub.nreal
        st.cache.advance(q)

    def _maybe_compact(self) -> None:
        """Drop holes (rows re-left-padded) once they dominate the cache; attention cost follows its length."""
        import torch

        st = self.st
        n, rows = st.cache.n, st.mask.shape[0]
        valid = st.mask[:, :n].sum(1)
        if n < self.COMPACT_MIN or int(valid.sum()) > (1 - self.COMPACT_AT) * rows * n:
            return
        width = int(valid.max())
        keep, index = torch.sort(st.mask[:, :n].to(torch.uint8), dim=1, stable=True)  # holes first, order kept
        st.cache.gather_columns(index[:, n - width:], width)
        st.mask = torch.zeros_like(st.mask)
        st.mask[:, :width] = keep[:, n - width:].bool()

    # -- decoding --------------------------------------------------------------------------------------
    def _decode(self, logits, sampling: SamplingParams, caps: list[int]) -> list[Completion]:

        st, dev = self.st, self.b.model.device
        steps = max(caps)
        d = DecodeState(st.cache.n, caps, steps, self._row_seeds(), sorted(self.b.stop_ids), dev)
        d.record(*self._sample(logits, sampling, d.seeds))
        runner = self._runner(d, sampling)
        check = self.b.stop_check_every
        done = 1
        for t in range(1, steps):
            if t % check == 0 and not bool(d.live.any()):
                break
            runner(t)
            done += 1
        st.cache.n += done - 1  # every step but the first sampled one fed a column
        return self._completions(d.out_tok[:, :done].tolist(), d.out_lp[:, :done].tolist())

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
        step (3x slower attention at 40 rows x 800 columns; equal in float32); on CUDA a captured graph of
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
    """transformers model + tokenizer on `device` (auto | cpu | cuda | cuda:N); `dtype`: float32 | bfloat16 |
    auto (bf16 on CUDA and on CPUs with native bf16). `cuda_graphs`: capture the decode step on CUDA
    (None = on for CUDA; never used on CPU)."""

    name = "hf"
    STOP_CHECK_CUDA = 8
    """On CUDA the host asks "any row live?" every this many steps (a sync stalls the GPU queue)."""

    def __init__(self, model_dir: str | Path, adapter_dir: str | Path | None = None, dtype: str = "float32",
                 device: str = "auto", merge_adapter: bool = True, cuda_graphs: bool | None = None):
        import torch

        place = resolve_device(device)  # before loading: a bad device fails fast
        path = check_model_dir(model_dir)
        adapter = check_adapter_dir(adapter_dir) if adapter_dir else None
        if dtype == "auto":
            native = torch.cuda.is_bf16_supported() if place.type == "cuda" else bf16_supported()
            dtype = "bfloat16" if native else "float32"
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

        `autocast`: run forwards under bf16 autocast where the device has native bf16 (faster matmuls on fp32
        weights; log-probs then bf16-precise).
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
        self.autocast = bool(autocast) and (on_cuda or bf16_supported())
        self.cuda_graphs = graphs_wanted(model.device.type, cuda_graphs)
        self.stop_check_every = self.STOP_CHECK_CUDA if on_cuda else 1
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

    @property
    def stop_ids(self) -> set[int]:
        return self._stops

    def describe(self) -> dict:
        return dict(self.info)

    def session(self) -> Session:
        return HFSession(self)
