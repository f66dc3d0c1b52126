"""`rcgrpo_cpu`: the attention of CPU models the `hf` backend decodes with (and of RL rollout snapshots).

- Prefill: torch's sdpa with `enable_gqa`. transformers' sdpa copies K/V once per query head whenever there
  is a mask, as a padded batch has (measured: docs/log.md, "Engine").
- One-token decode: a GQA-packed matmul + softmax (CPU sdpa with a padding mask is slower in bf16).
- A cache with shared prefixes (`prefix_layout.SharedPrefixes`, passed as the `rcgrpo_shared` keyword), prefill and
  decode: each block's prefix is read once for all the rows that share it (their queries stacked into one
  matmul per block and head), the rows' own columns as above, and the two softmaxes merged through their
  log-sum-exps (exact: the same attention as over the concatenated columns, up to float rounding).
  A view of a per-row cache would not do: bf16 CPU matmuls copy any non-contiguous operand (tried: a group's
  prefix read as a view saved ~3 % of a decode step), hence blocks stored apart.
- Training: transformers' sdpa.
"""

from __future__ import annotations

from rcgrpo_tasks.engine.kvcache import SHARED_KWARG

CPU_ATTENTION = "rcgrpo_cpu"


def cpu_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """See the module docstring. Shapes: query (b, h, q, d), key/value (b, hkv, L, d), mask (b, 1, q, L) bool
    (True = attend) or additive float, or None."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    shared = kwargs.get(SHARED_KWARG)
    if shared is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return shared_prefix_attention(query, key, value, attention_mask, shared, module.layer_idx, scale), None
    if query.shape[2] != 1:
        causal = attention_mask is None and getattr(module, "is_causal", True)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               is_causal=causal, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    b, h, _, d = query.shape
    hkv = key.shape[1]
    scores = torch.matmul(query.reshape(b, hkv, h // hkv, d), key.transpose(2, 3))
    scores = scores * (scaling if scaling is not None else d**-0.5)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
            else scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def shared_prefix_attention(query, key, value, mask, shared, layer: int, scale: float):
    """Attention over a layer's shared prefixes, then each row's own columns; returns (rows, q, h, d).

    query (n, h, q, d); key/value: the rows' own columns (n, hkv, L, d); mask (n, 1, q, L) bool (True = attend;
    every query sees at least itself). A row attends all of its block's columns (they precede its own)."""
    import torch

    n, h, q, d = query.shape
    hkv = key.shape[1]
    gq = h // hkv * q  # the queries of one KV head in one row
    qs = (query * scale).reshape(n, hkv, gq, d)
    own = torch.matmul(qs, key.transpose(2, 3)).float().view(n, hkv, h // hkv, q, -1)
    own = own.masked_fill_(~mask[:, :, None], float("-inf")).view(n, hkv, gq, -1)
    out, top, total = _attend(own, value)
    kb, vb = shared.keys[layer], shared.values[layer]
    blocks, per = kb.shape[0], shared.per_block
    qb = torch.cat([qs, qs.new_zeros((1,) + qs.shape[1:])]).index_select(0, shared.slots)
    qb = qb.view(blocks, per, hkv, gq, d).transpose(1, 2).reshape(blocks, hkv, per * gq, d)
    out_b, top_b, total_b = _attend(torch.matmul(qb, kb.transpose(2, 3)).float().add_(shared.bias), vb)
    out_b, total_b = _to_rows(out_b, shared, per), _to_rows(total_b, shared, per)
    top_b = _to_rows(top_b, shared, per, fill=float("-inf"))
    # softmax over both parts: each part's exp-sums rescaled to the larger of the two maxima
    top_all = torch.maximum(top, top_b)
    w, w_b = torch.exp(top - top_all), torch.exp(top_b - top_all)
    merged = (out.float() * w + out_b.float() * w_b) / (total * w + total_b * w_b)
    return merged.to(value.dtype).view(n, h, q, d).transpose(1, 2).contiguous()


def _attend(scores, value):
    """(exp(scores - max) @ value, max, sum of exp(scores - max)) per score row: an unnormalised softmax
    attention; scores float32 with -inf where masked, at least one finite per row."""
    import torch

    top = scores.amax(dim=-1, keepdim=True)
    e = scores.sub_(top).exp_()
    return torch.matmul(e.to(value.dtype), value), top, e.sum(dim=-1, keepdim=True)


def _to_rows(x, shared, per: int, fill: float = 0.0):
    """Per-slot results (blocks, hkv, per * gq, k) as per-row ones (rows, hkv, gq, k); `fill` for rows with no block."""
    import torch

    blocks, hkv, _, k = x.shape
    x = x.view(blocks, hkv, per, -1, k).transpose(1, 2).reshape(blocks * per, hkv, -1, k)
    return torch.cat([x, x.new_full((1,) + x.shape[1:], fill)]).index_select(0, shared.of_row)


def use_cpu_attention(model) -> bool:
    """Switch a CPU sdpa model to `cpu_attention` (registered once with transformers' attention interfaces)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(CPU_ATTENTION, cpu_attention)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    model.set_attn_implementation(CPU_ATTENTION)
    return True
