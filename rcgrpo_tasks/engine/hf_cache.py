"""How the `hf` backend lays out one session's KV cache: prefill, reuse across calls, compaction
(`engine.hf.HFSession` decodes over it).

- Batching: every row of a `generate` call is decoded together (the rollout loop hands over every group of
  a batch). Each prompt prefix several rows share is prefilled once at batch 1, on top of the shorter one it
  extends (`prefix_layout.prefix_tree`: a system prompt several entries share, each entry's task on it, a GRPO
  group's rows up to their reward token, the rows with the same token past it), and copied into its rows, all
  rows laid out left-padded in one cache (`rcgrpo_tasks.engine.kvcache`).
- CUDA prefill (`batched_prefill`, `rcgrpo_tasks.engine.prefill`): there the number of forwards is what
  costs, so a new set of rows is prefilled by length bucket instead: each prompt rows share once, in a few
  left-padded batches per bucket, its K/V copied into its rows; the prefix tree above is the CPU's.
- Shared prefixes (CPU attention): each of those prefixes is stored once, as a block the rows that end there
  read in attention (`prefix_layout.SharedPrefixes`), not copied into every row; the rows hold what follows it.
- KV reuse: a later call appends only each row's new tokens (observations, next user turn), never
  re-prefilling. Rows of different lengths share the cache through masked holes (position ids count real
  tokens), compacted once holes exceed `COMPACT_AT`; rows whose keys disappear are dropped. A span of new
  columns only some rows use (one long tool reply) is computed for those rows alone (`ragged_segments`).
"""

from __future__ import annotations

from rcgrpo_tasks.engine.kvcache import plan_capacity, prefill_mask, slot_cache_class
from rcgrpo_tasks.engine.prefill import left_padded, plan_prefill
from rcgrpo_tasks.engine.prefix_layout import (
    PrefixNode,
    SharedPrefixes,
    prefix_lengths,
    prefix_tree,
    ragged_segments,
    walk,
)
from rcgrpo_tasks.engine.shared_prefix import last_positions


class CacheRows:
    """A cache and its per-row bookkeeping on the model's device: `mask` (rows, capacity) bool = real token,
    `nreal` (rows,) int64 = real tokens per row (= the next token's position id)."""

    def __init__(self, rows: int, capacity: int, device):
        import torch

        self.cache = slot_cache_class()(rows, capacity)
        self.mask = torch.zeros((rows, capacity), dtype=torch.bool, device=device)
        self.nreal = torch.zeros(rows, dtype=torch.int64, device=device)

    def take(self, index, capacity: int, width: int | None = None) -> CacheRows:
        """Rows `index` (int64 tensor) alone, copied: their cache columns [0, width) (default: the cache's n)
        with room for `capacity`, their mask (to `capacity`) and positions; `put` writes them back."""
        sub = CacheRows.__new__(CacheRows)
        sub.cache = self.cache.take_rows(index, capacity, width)
        sub.mask, sub.nreal = self.mask[index, :capacity], self.nreal[index]
        return sub

    def put(self, sub: CacheRows, index, start: int, width: int) -> None:
        """Write columns [start, start + width) of `sub` (a `take` of rows `index`) back, with its mask and
        positions; the other rows get holes in those columns."""
        self.cache.put_columns(sub.cache, index, start, width)
        self.mask[:, start:start + width] = False
        self.mask[index, start:start + width] = sub.mask[:, start:start + width]
        self.nreal[index] = sub.nreal

    def reserve(self, needed: int) -> None:
        """Room for `needed` columns (cache buffers and mask grow together)."""
        import torch

        old = self.cache.capacity
        if self.cache.reserve(needed):
            mask = torch.zeros((self.mask.shape[0], self.cache.capacity), dtype=torch.bool, device=self.mask.device)
            mask[:, :old] = self.mask
            self.mask = mask


class CacheLayout:
    """The cache side of an `HFSession`: `self.b` (the backend: model, pad id, prefill switches), `self.st`
    (the `CacheRows`), `self.keys` and `self.covered` (per row: token ids whose K/V are in the cache)."""

    PREFILL_CHUNK = 2048  # max tokens per prefill forward (fewer forwards = faster prefill) ...
    ATTN_BUDGET = 2**24  # ... bounded so rows x chunk x cache length (x heads) stays ~1 GB
    COMPACT_AT = 0.5  # compact the cache when more than half of it is holes ...
    COMPACT_MIN = 512  # ... and it is at least this long
    RAGGED_MIN = 64  # a suffix span only some rows use runs on those rows alone when at least this long
    PREFIX_MIN = 16  # a shared prefix leaf shorter than this joins the rows' rests (`prefix_tree`'s min_len)

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
        self.st = st = CacheRows(len(prompts), plan_capacity(0, width + longest_rest + reserve), dev)
        st.cache.shared = shared

        def visit(node: PrefixNode, parent: CacheRows | None) -> None:
            ids = prompts[node.row][node.start:node.end]
            if parent is None:
                cur = CacheRows(1, node.end, dev)
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
        st.cache.advance(width)  # raises where the rows' prefixes were never stored
        self.covered = [list(p[:prefix_len[i]]) for i, p in enumerate(prompts)]

    def _prefill_batched(self, prompts: list[list[int]], reserve: int) -> None:
        """The CUDA path (`engine.prefill`): each prompt rows share, less its last token, prefilled once in
        left-padded batches by length bucket, copied into its rows right-aligned at `width` (`_prefill`: the rest)."""
        import torch

        dev, plan = self.b.model.device, plan_prefill(prompts)
        width = max(len(h) for h in plan.heads)
        rest = max(len(p) - len(h) for p, h in zip(prompts, plan.heads))
        self.st = st = CacheRows(len(prompts), plan_capacity(0, width + rest + reserve), dev)
        for batch in plan.batches:
            sub = CacheRows(len(batch), max(len(plan.distinct[k]) for k in batch), dev)
            self._append(sub, *left_padded([plan.distinct[k] for k in batch], self.b.pad_id))
            rows = torch.tensor([r for k in batch for r in plan.rows_of[k]], device=dev)
            take = torch.tensor([j for j, k in enumerate(batch) for _ in plan.rows_of[k]], device=dev)
            st.cache.place(sub.cache, rows, width - sub.cache.n, take)
            st.mask[rows, width - sub.cache.n:width] = sub.mask[take]
            st.nreal[rows] = sub.nreal[take]
        st.cache.advance(width)  # raises where the rows' prefixes were never stored
        self.covered = [list(h) for h in plan.heads]  # per row: its own list (extended in place later)

    def _extend(self, one: CacheRows, ids: list[int]) -> CacheRows:
        """A copy of batch-1 prefix cache `one` with `ids` appended (a longer shared prefix)."""
        import torch

        n, dev = one.cache.n, self.b.model.device
        two = CacheRows.__new__(CacheRows)
        two.cache = one.cache.take_rows(torch.tensor([0], device=dev), n + len(ids))
        two.mask = torch.zeros((1, n + len(ids)), dtype=torch.bool, device=dev)
        two.mask[:, :n] = True
        two.nreal = one.nreal.clone()
        self._append(two, torch.tensor([ids]), torch.ones((1, len(ids)), dtype=torch.bool))
        return two

    def _append(self, st: CacheRows, ids, new_mask):
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
        sub = st.take(index, start + q)
        self._append(sub, ids[rows], new_mask[rows])
        st.put(sub, index, start, q)
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
