"""RCTP's objective beyond the token-mean NLL (`SftConfig.first_token_weight`, `SftConfig.unlikelihood`): what
makes a small model route its first answer token through the reward token.

Where the token can change RL's groups is the first answer token: a low side that parts from the success there
(the base model's prose, no call) turns a success under `<|high_reward|>` into a failure under `<|low_reward|>`
(controllability's q). Both terms act on the pairs of a micro-batch (rows 2k and 2k+1 under different reward
tokens, as `rows.pair_order` lays them out) whose two answers part at their first token (a divergent
opening), on the compact head's labelled positions (`adapters.compact_head_loss`, whose `objective` hook
calls `rctp_objective`'s result):
- `first_token_weight` w: both rows' first answer token counts w times in the NLL sum. Pairs that share their
  opening (the SFT model's own failures: a call with a wrong value) keep weight 1 there: weighting a shared
  `[` would teach the low token to open a call as strongly as the high one;
- `unlikelihood` u: u x -log(1 - p) per row, p the probability the row gives the other row's opening (under
  the high token, the prose the low side opens with; under the low token, the call the high side opens with):
  each token pushed off the other's opening.
Pairs split across micro-batches add nothing. Both are added before the division by the token count, so u and
w are in units of one answer token. Departure from the paper, whose RCTP-FT is plain SFT on the labelled rows.
"""

from __future__ import annotations


def first_indices(mask) -> list[int | None]:
    """Per row of `mask` (B, T) bool, the index of its first True position in `mask`'s row-major list of True
    positions (where the compact head's log-probs sit), or None for a row without one."""
    counts = mask.sum(dim=1).tolist()
    out, seen = [], 0
    for n in counts:
        out.append(seen if n else None)
        seen += int(n)
    return out


def divergent_pairs(ids, firsts: list[int | None], targets, high_id: int, low_id: int) -> list[tuple[int, int]]:
    """(high row's first index, low row's first index) of each pair (rows 2k, 2k+1: one under each token) whose
    answers part at their first token."""
    goal = [("high" if (row == high_id).any() else "") + ("low" if (row == low_id).any() else "") for row in ids]
    out = []
    for a in range(0, ids.size(0) - 1, 2):
        b = a + 1
        if firsts[a] is None or firsts[b] is None or {goal[a], goal[b]} != {"high", "low"}:
            continue
        hi, lo = (firsts[a], firsts[b]) if goal[a] == "high" else (firsts[b], firsts[a])
        if targets[hi] != targets[lo]:
            out.append((hi, lo))
    return out


def rctp_objective(high_id: int, low_id: int, first_token_weight: float, unlikelihood: float, metrics=None):
    """The `objective` hook of `compact_head_loss`: (weights, extra) from (logp, targets, mask, inputs); None
    when both terms are off (the plain NLL). `metrics` (TRL's per-split metric lists) gets
    `high_p_low_opening` and `low_p_high_opening`: the mean probability each token gives the other's opening,
    over the divergent pairs."""
    if first_token_weight == 1.0 and unlikelihood == 0.0:
        return None

    def objective(logp, targets, mask, inputs):
        import torch

        pairs = divergent_pairs(inputs["input_ids"], first_indices(mask), targets, high_id, low_id)
        weights = None
        if first_token_weight != 1.0:
            weights = torch.ones_like(targets, dtype=logp.dtype)
            weights[[i for pair in pairs for i in pair]] = first_token_weight
        extra, seen = logp.new_zeros(()), {"high_p_low_opening": [], "low_p_high_opening": []}
        for hi, lo in pairs:
            for at, other, key in ((hi, lo, "high_p_low_opening"), (lo, hi, "low_p_high_opening")):
                p = logp[at, targets[other]].exp().clamp(max=1 - 1e-6)
                seen[key].append(float(p.detach()))
                if unlikelihood:
                    extra = extra - unlikelihood * torch.log1p(-p)
        if metrics is not None and pairs:
            for key, values in seen.items():
                metrics[key].append(sum(values) / len(values))
        return weights, extra

    return objective
