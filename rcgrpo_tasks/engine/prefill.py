"""How the `hf` session prefills a new set of rows on CUDA: by length bucket, not by prefix-tree node.

On the CPU the session prefills each prompt prefix several rows share once, at batch 1, on top of the one it
extends (`prefix_layout.prefix_tree`): it computes the fewest tokens, which is what a CPU pays for. On a GPU a
forward costs its launch and its weights' read whatever its batch, so what costs is the NUMBER of forwards:
a session's hundreds of distinct prompts would be hundreds of batch-1 forwards. There the session instead
prefills each prompt several rows share (a GRPO group's) once, in left-padded batches by length bucket
(`plan_prefill`), and copies its K/V into the rows that have it (memory is cheap next to a forward); the
rows' last tokens, and the whole prompt of a row that shares it with no other, are then appended for every
row in one batched pass (`hf_cache.CacheLayout._prefill`: one forward per column span,
`prefix_layout.ragged_segments`), which gives every row its last-column logits. Forwards per wave: at most
`SLICES` batches per length bucket (a batch's K/V is a copy beside the rows' own, so it holds at most
1/`SLICES` of the rows' prompts),
buckets at most log2(longest prompt) + 1, each batch chunked only where its attention would outgrow its
memory budget; whatever the number of prompts.
"""

from __future__ import annotations

from dataclasses import dataclass


def batched_prefill_wanted(device_type: str) -> bool:
    """True where a session prefills by length bucket (CUDA); the CPU keeps the prefix tree."""
    return device_type == "cuda"


SLICES = 8
"""A length bucket is prefilled in at most this many batches: each holds at most 1/SLICES of the rows."""


@dataclass(frozen=True)
class PrefillPlan:
    """`heads`: per row, what the plan prefills for it (its prompt less the last token where another row has
    the same, else nothing); `distinct`: the distinct non-empty heads; `rows_of`: the rows of each;
    `batches`: the distinct heads of each batched prefill (indices into `distinct`, longest first)."""

    heads: list[list[int]]
    distinct: list[list[int]]
    rows_of: list[list[int]]
    batches: list[list[int]]


def plan_prefill(prompts: list[list[int]], slices: int = SLICES) -> PrefillPlan:
    """The plan for `prompts` (each at least one token): rows grouped by identical head, the heads of two or
    more rows in batches of at most ceil(rows / `slices`) heads within a length bucket."""
    index: dict[tuple[int, ...], list[int]] = {}
    for row, p in enumerate(prompts):
        if len(p) > 1:  # a one-token prompt: its token is the last one, appended with every row's
            index.setdefault(tuple(p[:-1]), []).append(row)
    shared = [(list(head), rows) for head, rows in index.items() if len(rows) > 1]
    heads: list[list[int]] = [[] for _ in prompts]
    for head, rows in shared:
        for row in rows:
            heads[row] = head
    per_batch = max(1, -(-len(prompts) // slices))
    batches = [bucket[at:at + per_batch] for bucket in length_buckets([len(h) for h, _ in shared])
               for at in range(0, len(bucket), per_batch)]
    return PrefillPlan(heads, [h for h, _ in shared], [rows for _, rows in shared], batches)


def length_buckets(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` (each >= 1) grouped by the power of two just at or above their length, longest
    bucket first: in a left-padded bucket no sequence is padded to more than twice its length."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault((n - 1).bit_length(), []).append(i)
    return [groups[k] for k in sorted(groups, reverse=True)]


def left_padded(seqs: list[list[int]], pad_id: int):
    """(ids, mask) CPU tensors (len(seqs), longest): each sequence right-aligned, pads masked out."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = True
    return ids, mask
