"""`rcgrpo_cpu`: the attention of CPU models the `hf` backend decodes with (and of RL rollout snapshots).

- Prefill: torch's sdpa with `enable_gqa`. transformers' sdpa copies K/V once per query head whenever there
  is a mask, as a padded batch has: 8 new tokens on 40 rows x 777 cached columns (SmolLM2, bf16, 2 cores)
  took 1.03 s of attention per forward, 0.27 s with GQA.
- One-token decode: a GQA-packed matmul + softmax (CPU sdpa with a padding mask is ~3x slower in bf16).
- Training: transformers' sdpa.
Tried and dropped: reading a prefix the rows of a GRPO group share once per group in decode attention.
bf16 CPU matmuls copy any non-contiguous operand, so the group's prefix view and each row's remaining columns
were copied at every step; at 40 rows x 740 shared columns it saved ~3 % of a decode step.
"""

from __future__ import annotations

CPU_ATTENTION = "rcgrpo_cpu"


def cpu_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """See the module docstring. Shapes: query (b, h, q, d), key/value (b, hkv, L, d), mask (b, 1, q, L) bool
    (True = attend) or additive float, or None."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
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
