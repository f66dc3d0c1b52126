"""The `hf` session's KV cache: preallocated per-layer buffers shared by all rows, plus their attention masks,
and the prompt layout it is filled in (`prefix_tree`: which prefixes are prefilled once; `SharedPrefixes`:
which are stored once).

Layout: per layer K and V of shape (rows, kv_heads, capacity, head_dim); columns [0, n) are in use and
every row ends at column n - 1 (rows are left-padded; a column a row does not use is a "hole", masked).
Writes go in place (no `torch.cat` per token, which would copy the whole cache at every decode step), and
decode attention reads the whole capacity (on CPU, where a column slice costs a copy of the cache, and in the
static shapes of a captured CUDA graph) or the view [:, :, :n] (eager CUDA). The capacity is what the rows
need (tokens so far + this call's new tokens), grown by `GROWTH` only when a call needs more, one layer at a
time so the peak stays near one copy. Buffers start zeroed: holes always hold finite values, so a masked
column contributes exactly 0.

Shared prefixes (`SlotCache.shared`, CPU attention only): a prompt prefix that several rows share (a GRPO
group's prompt up to its reward token, a system prompt) is stored ONCE, as a "block" beside the rows' own
columns, and decode and prefill attention read it once per block instead of once per row
(`engine.cpu_attention`). The rows' own columns then hold only what follows their block. On a CPU a decode
step over many rows is bound by reading K/V: 40 rows x ~770 prompt columns read 40 copies of 8 prompts.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

GROWTH = 1.25
"""Minimum growth factor of the capacity when a call needs more columns (fewer re-allocations and graph captures)."""
ALIGN = 64
"""Capacities are multiples of this (aligned rows for the attention kernels)."""
SHARED_KWARG = "rcgrpo_shared"
"""The forward keyword that carries a cache's `SharedPrefixes` to the attention function."""


def plan_capacity(current: int, needed: int) -> int:
    """The capacity to hold `needed` columns: `current` when it suffices, else >= GROWTH x current, aligned."""
    if needed <= current:
        return current
    return ALIGN * math.ceil(max(needed, current * GROWTH if current else 0) / ALIGN)


@functools.cache
def slot_cache_class():
    """The `SlotCache` class (built on first use: transformers is imported lazily)."""
    from transformers.cache_utils import Cache

    class SlotCache(Cache):
        """transformers `Cache` over preallocated buffers; see the module docstring.

        Prefill: a forward appending `s` tokens writes columns [n, n + s) of every layer, then the session
        advances `n`. Decode step (`write_at` set): the one new column goes to the device index `write_at`
        and attention reads columns [0, attend) (no Python int that a captured CUDA graph would freeze).
        """

        def __init__(self, rows: int, capacity: int):
            super().__init__(layers=[])
            self.rows, self.capacity, self.n = rows, capacity, 0
            self.keys: list = []
            self.values: list = []
            self.write_at = None  # decode steps: (1,) int64 device tensor, the column they write
            self.attend = 0  # decode steps: attention reads columns [0, attend)
            self.shared: SharedPrefixes | None = None  # prefixes stored once (blocks), read before the own columns

        # -- transformers' Cache interface (what attention layers and mask code call) ------------------
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            import torch

            if layer_idx == len(self.keys):  # first use of this layer: shapes, dtype and device from the model
                shape = (self.rows, key_states.shape[1], self.capacity, key_states.shape[3])
                self.keys.append(torch.zeros(shape, dtype=key_states.dtype, device=key_states.device))
                self.values.append(torch.zeros(shape[:3] + (value_states.shape[3],), dtype=value_states.dtype,
                                               device=value_states.device))
            k, v = self.keys[layer_idx], self.values[layer_idx]
            if self.write_at is not None:  # a decode step: no Python int that a captured graph would freeze
                k.index_copy_(2, self.write_at, key_states.to(k.dtype))
                v.index_copy_(2, self.write_at, value_states.to(v.dtype))
                return k[:, :, :self.attend], v[:, :, :self.attend]
            s = key_states.shape[2]
            if self.n + s > self.capacity:
                raise RuntimeError(f"KV cache overflow: {self.n} + {s} columns > capacity {self.capacity}")
            k[:, :, self.n:self.n + s] = key_states
            v[:, :, self.n:self.n + s] = value_states
            return k[:, :, :self.n + s], v[:, :, :self.n + s]

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.n

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return (self.attend if self.write_at is not None else self.n + query_length), 0

        def get_max_length(self, layer_idx: int | None = None) -> int:
            return self.capacity

        # -- the session's operations --------------------------------------------------------------------
        def advance(self, s: int) -> None:
            self.n += s

        def nbytes(self) -> int:
            own = sum(t.numel() * t.element_size() for t in self.keys + self.values)
            return own + (self.shared.nbytes() if self.shared is not None else 0)

        def attention_kwargs(self) -> dict:
            """What a forward over this cache passes to the attention function (its shared prefixes)."""
            return {} if self.shared is None else {SHARED_KWARG: self.shared}

        def reserve(self, needed: int) -> bool:
            """Make room for `needed` columns (`plan_capacity`); True when the buffers were re-allocated."""
            import torch

            capacity = plan_capacity(self.capacity, needed)
            if capacity == self.capacity:
                return False
            for buffers in (self.keys, self.values):
                for i, old in enumerate(buffers):  # one layer at a time: the peak is one layer's extra copy
                    new = torch.zeros(old.shape[:2] + (capacity,) + old.shape[3:], dtype=old.dtype, device=old.device)
                    new[:, :, :self.n] = old[:, :, :self.n]
                    buffers[i] = new
                    del old
            self.capacity = capacity
            return True

        def select_rows(self, index) -> None:
            """Keep rows `index` (an int64 tensor), in that order."""
            for buffers in (self.keys, self.values):
                for i, old in enumerate(buffers):
                    buffers[i] = old.index_select(0, index.to(old.device))
            if self.shared is not None:
                self.shared = self.shared.select(index, self.rows)
            self.rows = len(index)

        def gather_columns(self, index, width: int) -> None:
            """Row r keeps columns index[r] (rows, width) as its new columns [0, width): compaction."""
            import torch

            for buffers in (self.keys, self.values):
                for i, old in enumerate(buffers):
                    idx = index.to(old.device)[:, None, :, None].expand(-1, old.shape[1], -1, old.shape[3])
                    new = torch.zeros_like(old)
                    new[:, :, :width] = old.gather(2, idx)
                    buffers[i] = new
                    del old
            self.n = width

        def take_rows(self, index, capacity: int, width: int | None = None):
            """A new cache holding rows `index` (int64 tensor): their columns [0, width) (default: [0, n); a
            decode in flight has written past n), room for `capacity`."""
            width = self.n if width is None else width
            sub = type(self)(len(index), capacity)
            sub.n = self.n
            sub.shared = self.shared.select(index, self.rows) if self.shared is not None else None
            for src, dst in ((self.keys, sub.keys), (self.values, sub.values)):
                for t in src:
                    new = t.new_zeros((len(index), t.shape[1], capacity) + t.shape[3:])
                    new[:, :, :width] = t[index.to(t.device), :, :width]
                    dst.append(new)
            return sub

        def put_columns(self, sub, index, start: int, width: int) -> None:
            """Write columns [start, start + width) of `sub` (a `take_rows` cache) back into rows `index`."""
            cols = slice(start, start + width)
            for src, dst in ((sub.keys, self.keys), (sub.values, self.values)):
                for t, d in zip(src, dst):
                    d[index.to(d.device), :, cols] = t[:, :, cols]

        def place(self, prefix, rows, start: int, take=None) -> None:
            """Copy batch-1 cache `prefix` (its n columns) into rows `rows` (int64 tensor), columns [start, start + n),
            or with `take` (int64 tensor) its row take[i] into rows[i]; allocates this cache's buffers like
            `prefix`'s on first use."""
            import torch

            if not self.keys:
                for src, buffers in ((prefix.keys, self.keys), (prefix.values, self.values)):
                    for t in src:
                        buffers.append(torch.zeros((self.rows, t.shape[1], self.capacity, t.shape[3]),
                                                   dtype=t.dtype, device=t.device))
            cols = slice(start, start + prefix.n)
            for src, buffers in ((prefix.keys, self.keys), (prefix.values, self.values)):
                for t, dst in zip(src, buffers):
                    dst[rows.to(dst.device), :, cols] = t[:, :, :prefix.n] if take is None else t[take, :, :prefix.n]

    return SlotCache


def ragged_segments(lengths: list[int], min_cols: int) -> list[tuple[int, int, list[int] | None]]:
    """Plan the prefill of right-aligned suffixes (row i fills columns [W - len_i, W), W = the longest):
    [(start, end, rows)], rows None = every row. A column span that only some rows use is run on those rows
    alone, so one long tool reply does not cost every row its length in padded compute; a span shorter
    than `min_cols` joins the next one (whose rows include its rows: the suffixes are right-aligned).
    The last span always holds every row (their last-column logits come from it)."""
    width = max(lengths)
    starts = sorted({width - n for n in lengths if n > 0})
    segs, carry = [], None
    for k, a in enumerate(starts):
        b = starts[k + 1] if k + 1 < len(starts) else width
        last, first = b == width, (a if carry is None else carry)
        if b - first < min_cols and not last:
            carry = first
            continue
        carry = None
        rows = [i for i, n in enumerate(lengths) if n > 0 and width - n <= a]  # every row with a token in [first, b)
        segs.append((first, b, None if last or len(rows) == len(lengths) else rows))
    return segs


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config (Llama/Qwen/Mistral-style full attention)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of K and V that one token occupies in the cache (all layers)."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def decode_mask(mask, kv_len: int, additive_dtype=None):
    """Attention mask of a one-token step: (rows, 1, 1, kv_len) from the (rows, capacity) bool column mask."""
    m = mask[:, None, None, :kv_len]
    return m if additive_dtype is None else _additive(m, additive_dtype)


def prefill_mask(mask, start: int, q_len: int, additive_dtype=None):
    """Attention mask of a chunk whose queries sit at columns [start, start + q_len): a key is visible when
    it is a row's token at or before the query's column. A query always sees itself, so a padded query
    (a hole) attends to something and its K/V stay finite."""
    import torch

    kv_len = start + q_len
    kpos = torch.arange(kv_len, device=mask.device)
    qpos = torch.arange(start, kv_len, device=mask.device)
    causal = kpos[None, :] <= qpos[:, None]
    m = (mask[:, None, None, :kv_len] & causal[None, None]) | (kpos[None, :] == qpos[:, None])[None, None]
    return m if additive_dtype is None else _additive(m, additive_dtype)


def _additive(m, dtype):
    """Bool mask -> additive float mask (0 / dtype min) for attention implementations that add the mask."""
    import torch

    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)


@dataclass
class PrefixNode:
    """A node of `prefix_tree`: it appends tokens [start, end) of its rows' prompts (equal there) to its
    parent's prefix. `ends`: the rows whose prefilled prefix is exactly [0, end); `children` extend it."""

    start: int
    end: int
    ends: list[int]
    children: list[PrefixNode]

    @property
    def row(self) -> int:
        """A row under this node (every node has one: a leaf ends rows)."""
        return self.ends[0] if self.ends else self.children[0].row


def walk(tree: list[PrefixNode]) -> Iterator[PrefixNode]:
    """Every node of `tree`, parents before their children."""
    for node in tree:
        yield node
        yield from walk(node.children)


def prefix_lengths(tree: list[PrefixNode], rows: int) -> list[int]:
    """Per row, the length of its prefilled prefix in `tree` (0: the row is in no node)."""
    lengths = [0] * rows
    for node in walk(tree):
        for i in node.ends:
            lengths[i] = node.end
    return lengths


def prefix_tree(prompts: list[list[int]], min_len: int = 1) -> list[PrefixNode]:
    """The roots of the radix tree of the prompts' shared prefixes: every distinct shared prefix is prefilled
    once, at batch 1, on top of its parent's (a system prompt several entries share, each entry's task on it,
    a GRPO group's rows up to their reward token, the rows with the same token past it).

    A row's prefilled prefix is the longest prefix it shares with another row, leaving it at least one token
    of its own (its last-column logits come from the batched prefill of the rows' rests); a row that shares
    nothing, or would be alone under a node, is prefilled with the other rows' rests instead. A leaf that
    adds fewer than `min_len` tokens to its parent is not a node: its rows end at the parent (a forward at
    batch 1 costs more than a few more tokens in the batched rests; a root that short leaves the tree).
    """
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    lcp = [_lcp(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]
    plen = {i: min(max(lcp[k - 1] if k else 0, lcp[k] if k < len(lcp) else 0), len(prompts[i]) - 1)
            for k, i in enumerate(order)}
    roots, _ = _subtree(prompts, [i for i in order if plen[i] > 0], plen, 0)
    return [r for r in roots if not _prune(r, min_len)]


def _prune(node: PrefixNode, min_len: int) -> bool:
    """Fold leaves shorter than `min_len` into their parents, bottom up; True when `node` itself is one."""
    kept = []
    for child in node.children:
        if _prune(child, min_len):
            node.ends += child.ends
        else:
            kept.append(child)
    node.children = kept
    return not kept and node.end - node.start < min_len


def _subtree(prompts, rows: list[int], plen: dict[int, int], depth: int) -> tuple[list[PrefixNode], list[int]]:
    """(nodes below `depth` for `rows`, sorted and each sharing past `depth`; rows left alone, which end at
    `depth`)."""
    nodes, alone = [], []
    for _, run in itertools.groupby(rows, key=lambda i: prompts[i][depth]):
        run = list(run)
        if len(run) == 1:
            alone += run
            continue
        end = min(min(plen[i] for i in run), _lcp(prompts[run[0]], prompts[run[-1]]))
        children, back = _subtree(prompts, [i for i in run if plen[i] > end], plen, end)
        nodes.append(PrefixNode(depth, end, [i for i in run if plen[i] == end] + back, children))
    return nodes, alone


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


@dataclass
class SharedPrefixes:
    """Prompt prefixes stored once ("blocks") for the rows that share them; see the module docstring.

    `keys`, `values`: per layer (blocks, kv_heads, width, head_dim), block b's prefix in columns [0, length_b);
    `bias` (blocks, 1, 1, width) float32: 0 on a block's columns, -inf past its length; `slots`
    (blocks x per_block,) int64: the row in each slot of each block (`rows` = an empty slot); `of_row` (rows,)
    int64: each row's slot (blocks x per_block = no block). A row with a block holds only what follows
    the block in its own columns (position ids count the block)."""

    keys: list
    values: list
    bias: object
    slots: object
    of_row: object
    per_block: int

    @classmethod
    def plan(cls, blocks: list[list[int]], lengths: list[int], rows: int, device) -> SharedPrefixes:
        """Empty blocks for `blocks` (the rows of each) of prefix `lengths`; `put` fills each block's K/V."""
        import torch

        per_block = max(len(b) for b in blocks)
        slots = torch.full((len(blocks) * per_block,), rows, dtype=torch.int64)
        of_row = torch.full((rows,), len(blocks) * per_block, dtype=torch.int64)
        for b, members in enumerate(blocks):
            at = b * per_block + torch.arange(len(members))
            slots[at] = torch.tensor(members)
            of_row[members] = at
        bias = torch.zeros((len(blocks), 1, 1, max(lengths)), dtype=torch.float32)
        for b, n in enumerate(lengths):
            bias[b, ..., n:] = float("-inf")
        return cls([], [], bias.to(device), slots.to(device), of_row.to(device), per_block)

    def put(self, block: int, prefix) -> None:
        """Copy batch-1 cache `prefix` (its n columns) into block `block` (buffers allocated on first use)."""
        import torch

        if not self.keys:
            blocks, width = self.bias.shape[0], self.bias.shape[-1]
            for src, dst in ((prefix.keys, self.keys), (prefix.values, self.values)):
                for t in src:
                    dst.append(torch.zeros((blocks, t.shape[1], width, t.shape[3]), dtype=t.dtype, device=t.device))
        for src, dst in ((prefix.keys, self.keys), (prefix.values, self.values)):
            for t, d in zip(src, dst):
                d[block, :, :prefix.n] = t[0, :, :prefix.n]

    def select(self, index, rows: int) -> SharedPrefixes:
        """The same blocks for rows `index` (int64 tensor) of the `rows` they served, in that order (the
        buffers are shared, not copied)."""
        import dataclasses

        import torch

        index = index.to(self.slots.device)
        inverse = torch.full((rows + 1,), len(index), dtype=torch.int64, device=index.device)
        inverse[index] = torch.arange(len(index), device=index.device)
        return dataclasses.replace(self, slots=inverse[self.slots], of_row=self.of_row[index])

    @property
    def width(self) -> int:
        return self.bias.shape[-1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)
