"""The `hf` session's KV cache: preallocated per-layer buffers shared by all rows, plus their attention masks
(the prompt layout it is filled in: `engine.prefix_layout`).

Layout: per layer K and V of shape (rows, kv_heads, capacity, head_dim); columns [0, n) are in use and
every row ends at column n - 1 (rows are left-padded; a column a row does not use is a "hole", masked).
Writes go in place (no `torch.cat` per token, which would copy the whole cache at every decode step), and
decode attention reads the whole capacity (on CPU, where a column slice costs a copy of the cache, and in the
static shapes of a captured CUDA graph) or the view [:, :, :n] (eager CUDA). The capacity is what the rows
need (tokens so far + this call's new tokens), grown by `GROWTH` only when a call needs more, one layer at a
time so the peak stays near one copy. Buffers start zeroed: holes always hold finite values, so a masked
column contributes exactly 0.

Every path that writes rows into a cache (a prefill forward, `place`, `put_columns`) allocates its buffers
first where it has none, and a cache that counts columns it never stored raises (`check_stored`): a write
never lands nowhere.
"""

from __future__ import annotations

import functools
import math

from rcgrpo_tasks.engine.prefix_layout import SharedPrefixes

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

            if layer_idx == len(self.keys):  # first use of this layer: shapes, dtype and device from the model
                self.check_stored()
                self.keys.append(self._zeros(key_states))
                self.values.append(self._zeros(value_states))
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
            self.check_stored()

        def check_stored(self, before: int | None = None) -> None:
            """Raise unless columns [0, `before`) (default: [0, n)) have buffers to live in: a cache that
            counts columns it never stored would attend to zeros where a row's own tokens should be."""
            if (self.n if before is None else before) > 0 and not self.keys:
                raise RuntimeError(f"KV cache: columns [0, {self.n if before is None else before}) were never "
                                   "stored (no buffers): a write went nowhere")

        def _zeros(self, like):
            """A zeroed buffer for one layer like `like` (any cache's per-layer K or V, or a layer's new
            states), at this cache's rows and capacity."""
            import torch

            return torch.zeros((self.rows, like.shape[1], self.capacity, like.shape[3]), dtype=like.dtype,
                               device=like.device)

        def allocate_like(self, other_keys: list, other_values: list) -> None:
            """Give this cache its buffers (every layer, zeroed) shaped like another cache's, where it has none
            yet: every path that writes rows into this cache calls it first, so no write can land nowhere."""
            if self.keys:
                return
            self.check_stored()
            self.keys.extend(self._zeros(t) for t in other_keys)
            self.values.extend(self._zeros(t) for t in other_values)

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

            self.check_stored()
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
            self.check_stored(before=width)
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
            """Write columns [start, start + width) of `sub` (a `take_rows` cache) back into rows `index`
            (allocating this cache's buffers where it has none yet: a batch's first span may be one only some
            rows use)."""
            if width and not sub.keys:
                raise RuntimeError("KV cache: put_columns from a cache that stored nothing")
            self.allocate_like(sub.keys, sub.values)
            cols = slice(start, start + width)
            for src, dst in ((sub.keys, self.keys), (sub.values, self.values)):
                for t, d in zip(src, dst, strict=True):
                    d[index.to(d.device), :, cols] = t[:, :, cols]

        def place(self, prefix, rows, start: int, take=None) -> None:
            """Copy batch-1 cache `prefix` (its n columns) into rows `rows` (int64 tensor), columns [start, start + n),
            or with `take` (int64 tensor) its row take[i] into rows[i]; allocates this cache's buffers like
            `prefix`'s on first use."""
            prefix.check_stored()
            self.allocate_like(prefix.keys, prefix.values)
            cols = slice(start, start + prefix.n)
            for src, buffers in ((prefix.keys, self.keys), (prefix.values, self.values)):
                for t, dst in zip(src, buffers, strict=True):
                    dst[rows.to(dst.device), :, cols] = t[:, :, :prefix.n] if take is None else t[take, :, :prefix.n]

    return SlotCache


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
