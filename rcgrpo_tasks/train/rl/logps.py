"""Per-token log-probs of completions on a CPU, the LM head on the attended completion positions only.

The pipeline trainer's log-probs on a CPU (`pipeline_trainer`). Why: without Triton, TRL 1.16's fused LM head
scores EVERY position (static tile shapes), i.e. about a thousand prompt positions per ~50 completion tokens
through a ~49k vocabulary, which dominates a CPU step. Here only the positions TRL's loss reads are projected,
with the same temperature scaling; optionally a micro-batch's shared tokens go through the trunk once
(`engine.shared_prefix`). The same log-probs as TRL's path up to float rounding (tests compare them).
"""

from __future__ import annotations

from rcgrpo_tasks.engine.shared_prefix import last_positions, target_hidden, trunk_and_head


def completion_logps(model, input_ids, attention_mask, logits_to_keep: int, temperature: float, batch_size: int,
                     compute_entropy: bool, min_prefix: int | None = None, pad_id: int = 0):
    """input_ids (B, P+C) -> (log-probs (B, C), entropies (B, C) or None, None) of the last C tokens: the
    attended ones (TRL's completion mask); 0 at the others, which every TRL loss masks out. `min_prefix`:
    `shared_prefix.target_hidden`'s, through the model's trunk and head; None: the model's own forward on the
    padded batch (a DDP / DeepSpeed wrapper's forward is what syncs the gradients across processes)."""
    import torch

    trunk, head = trunk_and_head(model) if min_prefix is not None else (None, None)
    logps, ents = [], []
    for s in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[s : s + batch_size], attention_mask[s : s + batch_size]
        keep = torch.zeros_like(mask, dtype=torch.bool)
        keep[:, -logits_to_keep:] = mask[:, -logits_to_keep:].bool()
        if trunk is not None:
            logits = head(target_hidden(trunk, ids, mask, keep, min_prefix, pad_id))
        else:
            out = model(input_ids=ids, attention_mask=mask, use_cache=False,
                        logits_to_keep=last_positions(logits_to_keep + 1, ids.size(1), ids.device))
            logits = out.logits[:, :-1][keep[:, -logits_to_keep:]]  # position t predicts token t + 1
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
        lp = logp_all.gather(-1, ids[keep].unsqueeze(-1)).squeeze(-1)
        where = keep[:, -logits_to_keep:]
        logps.append(torch.zeros(where.shape, dtype=lp.dtype, device=lp.device).masked_scatter(where, lp))
        if compute_entropy:
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
                ents.append(torch.zeros(where.shape, dtype=ent.dtype, device=ent.device).masked_scatter(where, ent))
    return torch.cat(logps), (torch.cat(ents) if compute_entropy else None), None
