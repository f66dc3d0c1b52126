"""The prompt layout a session's cache is filled in: which prefixes are prefilled once (`prefix_tree`), which
are stored once (`SharedPrefixes`), and which new column spans run on some rows only (`ragged_segments`).

Shared prefixes (`SlotCache.shared`, CPU attention only): a prompt prefix that several rows share (a GRPO
group's prompt up to its reward token, a system prompt) is stored ONCE, as a "block" beside the rows' own
columns, and decode and prefill attention read it once per block instead of once per row
(`engine.cpu_attention`). The rows' own columns then hold only what follows their block. On a CPU a decode
step over many rows is bound by reading K/V: 40 rows x ~770 prompt columns read 40 copies of 8 prompts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


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
        prefix.check_stored()
        for src, dst in ((prefix.keys, self.keys), (prefix.values, self.values)):
            for t, d in zip(src, dst, strict=True):
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
