"""Shared-prefix training forwards: a group's common tokens through the trunk once, the LM head on the
positions that enter the loss only. RC-GRPO's policy, reference and trainer log-probs on a CPU
(`train.rl.logps`, the rl stage's `shared_prefix_min_tokens`), the SFT / RCTP loss and the margin go through
`target_hidden`.

Why by hand: Prefix Grouper (arXiv 2506.05433) and its ports (verl's `use_prefix_grouper`, unsloth's
FlexAttention path, TRL's prefix-tree packing) run on GPU only, and verl takes one row's prompt for the whole
group without checking the others, which would give RC-GRPO wrong log-probs (its rows differ in their reward
token). Here what is shared is MEASURED on the rows' unpadded tokens: their prefix tree (`prefix_tree`), so
an RC-GRPO group shares everything before its reward token, a pair of RCTP rows everything before the goal's
token, two entries of one micro-batch their system prompt, and rollouts that start alike their first tokens.

The layout: the tree's tokens in depth-first order are ONE sequence; a 4-D boolean mask lets each token
attend to itself and its ancestors only (a row's own earlier tokens, shared or not), never to another
branch; its position id is its depth (the plain path's positions up to a uniform shift per row, which RoPE
does not see: attention depends on relative positions only). Shared tokens are part of the one forward, so
they stay in the autograd graph: every row's loss reaches the LoRA weights and the reward-token rows
through them. A token of row r at real position t is predicted by the hidden state of t - 1, gathered from
wherever t - 1 was packed (for a branch's first token, the last shared one). SDPA with a dense boolean
mask (FlexAttention's backward does not run on CPU): (L x L) with L = the tree's tokens, small beside the
trunk's work at these lengths; trees over `MAX_PACKED` tokens are split. A batch whose tree saves fewer
than `min_prefix` tokens per row takes the plain padded forward.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PACKED = 8192
"""Tokens of one packed sequence at most (its mask is that squared); a larger batch is split in halves."""


@dataclass(frozen=True)
class Packed:
    """Rows as one prefix tree in depth-first order: `tokens[i]` at depth `depth[i]` (its position id), its
    subtree the packed indices [i, end[i]); `where[r]` = the packed index of each token of row r."""

    tokens: list[int]
    depth: list[int]
    end: list[int]
    where: list[list[int]]


def prefix_tree(rows: list[list[int]]) -> Packed:
    """The token prefix tree of `rows`, packed depth first (children in the order rows first reach them): every
    distinct prefix appears once, so an RC-GRPO group shares its prompt up to the reward token, two entries
    their common system prompt, rows with equal first completion tokens those too."""
    tokens, depth, kids = [], [], [{}]  # kids[0]: the root's children; node i's children: kids[i + 1]
    node_of = []
    for row in rows:
        at, path = 0, []
        for t in row:
            nxt = kids[at].get(t)
            if nxt is None:
                nxt = len(tokens)
                tokens.append(t), depth.append(len(path)), kids.append({})
                kids[at][t] = nxt
            path.append(nxt)
            at = nxt + 1
        node_of.append(path)
    order, end, stack = [], [0] * len(tokens), [(n, False) for n in reversed(list(kids[0].values()))]
    index = [0] * len(tokens)
    while stack:  # iterative depth-first walk: a node's index on entry, its subtree's end on exit
        n, done = stack.pop()
        if done:
            end[n] = len(order)
            continue
        index[n] = len(order)
        order.append(n)
        stack.append((n, True))
        stack.extend((c, False) for c in reversed(list(kids[n + 1].values())))
    return Packed([tokens[n] for n in order], [depth[n] for n in order], [end[n] for n in order],
                  [[index[n] for n in path] for path in node_of])


def pack(rows: list[list[int]], max_tokens: int = MAX_PACKED) -> list[tuple[list[int], Packed]]:
    """[(row indices, their prefix tree)]: one tree for all rows, split in halves while a tree exceeds
    `max_tokens`."""
    parts, out = [list(range(len(rows)))], []
    while parts:
        idx = parts.pop(0)
        tree = prefix_tree([rows[r] for r in idx])
        if len(tree.tokens) > max_tokens and len(idx) > 1:
            parts[:0] = [idx[: len(idx) // 2], idx[len(idx) // 2 :]]
        else:
            out.append((idx, tree))
    return out


def packed_tensors(trees: list[Packed], pad_id: int):
    """(input_ids (P, L), position_ids (P, L), mask (P, 1, L, L) bool) of packed trees. Query q sees key k
    iff k is q or one of its ancestors: k <= q < end[k] in depth-first order. Padding sees only itself (no
    all-masked query row, which would give NaN in SDPA's softmax)."""
    import torch

    width = max(len(t.tokens) for t in trees)
    ids = torch.full((len(trees), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(trees), width), dtype=torch.long)
    end = torch.arange(1, width + 1).repeat(len(trees), 1)
    for i, t in enumerate(trees):
        n = len(t.tokens)
        ids[i, :n], pos[i, :n], end[i, :n] = torch.tensor(t.tokens), torch.tensor(t.depth), torch.tensor(t.end)
    col = torch.arange(width)
    mask = (col[None, None, :] <= col[None, :, None]) & (col[None, :, None] < end[:, None, :])
    return ids, pos, mask[:, None]


def trunk_tokens(rows: list[list[int]]) -> int:
    """Tokens the trunk processes for `rows` in the shared layout (the prefix tree's nodes, padding excluded)."""
    return sum(len(tree.tokens) for _, tree in pack(rows))


def trunk_and_head(model):
    """(trunk, LM head) of a causal LM, through a PEFT wrapper (its LoRA and trainable-token layers act
    inside both; `disable_adapter()` too)."""
    from peft import PeftModel

    hf = model.get_base_model() if isinstance(model, PeftModel) else model
    return getattr(hf, hf.base_model_prefix), hf.get_output_embeddings()


def real_rows(input_ids, attention_mask) -> list[list[int]] | None:
    """Each row's attended tokens in order, or None when a row's attended tokens are not one contiguous run
    (the plain path then keeps the batch's own positions)."""
    rows = []
    for ids, m in zip(input_ids.tolist(), attention_mask.tolist()):
        on = [i for i, v in enumerate(m) if v]
        if on and on[-1] - on[0] + 1 != len(on):
            return None
        rows.append(ids[on[0] : on[-1] + 1] if on else [])
    return rows


def target_hidden(backbone, input_ids, attention_mask, targets, min_prefix: int | None, pad_id: int = 0):
    """Hidden states (n, d) predicting each target token, in `targets.nonzero()` order (row-major).

    `input_ids`, `attention_mask`, `targets` (B, W): a padded batch (left, right or both: attended tokens one
    contiguous run per row); `targets` marks the attended positions whose token is predicted (never a row's
    first attended token). `backbone`: the trunk (a transformers `*Model`, hidden states out; LoRA and
    trainable-token wrappers act inside it). `min_prefix`: the shared layout where it saves at least this many
    trunk tokens per row; None, a smaller saving, or a batch whose attended tokens have holes: the plain
    forward of the padded batch. Both return the same states up to float rounding (tests/test_shared_prefix.py)."""
    import torch

    rows = real_rows(input_ids, attention_mask) if min_prefix is not None else None
    b_idx, t_idx = targets.nonzero(as_tuple=True)
    if rows is None:
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return hidden[b_idx, t_idx - 1]
    parts = pack(rows)
    saved = sum(len(r) for r in rows) - sum(len(t.tokens) for _, t in parts)
    if saved < min_prefix * max(len(rows) - 1, 1):
        return target_hidden(backbone, input_ids, attention_mask, targets, None, pad_id)
    ids, pos, mask = packed_tensors([t for _, t in parts], pad_id)
    dev = input_ids.device
    hidden = backbone(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask.to(dev),
                      use_cache=False).last_hidden_state
    # Column t of the padded batch is real token t - first(b) of row b; its predictor is the one before it.
    first = attention_mask.long().argmax(dim=1)
    real_t = t_idx - first[b_idx] - 1
    if real_t.numel() and int(real_t.min()) < 0:
        raise ValueError("target_hidden: a target is a row's first attended token (nothing predicts it)")
    table = torch.zeros((len(rows), max(1, max(len(r) for r in rows))), dtype=torch.long)
    part_of = torch.zeros(len(rows), dtype=torch.long)
    for p, (idx, tree) in enumerate(parts):
        for r, cols in zip(idx, tree.where):
            table[r, : len(cols)] = torch.tensor(cols, dtype=torch.long)
            part_of[r] = p
    return hidden[part_of.to(dev)[b_idx], table.to(dev)[b_idx, real_t]]


def last_positions(n: int, width: int, device):
    """`logits_to_keep` for the last `n` of `width` positions as an index tensor: transformers slices the
    hidden states for an int, a non-contiguous view that torch's CPU `linear` copies the LM head for; an index
    tensor gathers a contiguous copy of the positions instead."""
    import torch

    return torch.arange(width - n, width, device=device)
