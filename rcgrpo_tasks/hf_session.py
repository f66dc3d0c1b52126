"""The `hf` backend's session: one batched KV cache per set of rollouts (see `rcgrpo_tasks.backends`).

- Prefix sharing: rows are grouped by shared prompt prefix (greedy over the sorted prompts); each group's
  prefix is prefilled once at batch 1 and row-copied, all rows laid out left-padded in one cache.
- KV reuse: a later call appends only each row's new tokens (observations, next user turn). Rows of
  different lengths share the cache through masked holes (position ids follow the mask), compacted
  once holes dominate; rows whose keys disappear are dropped.
- Sampling: a hand-written loop returning the log-prob of each sampled token under softmax(logits / T).
- `rcgrpo_cpu` attention (CPU models the backend loads itself): sdpa for prefill, a GQA-packed
  matmul-softmax for one-token decode (CPU sdpa with a padding mask is ~3x slower in bf16).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from rcgrpo_tasks.backends import Completion, SamplingParams, Session, _decode

if TYPE_CHECKING:
    from rcgrpo_tasks.backends import HFBackend


CPU_ATTENTION = "rcgrpo_cpu"


def _cpu_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """sdpa, except one-token decode: a GQA-packed matmul + softmax (CPU sdpa with a mask is slow in bf16)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, _, d = query.shape
    hkv = key.shape[1]
    scores = torch.matmul(query.reshape(b, hkv, h // hkv, d), key.transpose(2, 3))
    scores = scores * (scaling if scaling is not None else d**-0.5)
    if attention_mask is not None:  # (b, 1, 1, L): bool (True = attend) or additive float
        scores = scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
            else scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def use_cpu_attention(model) -> bool:
    """Switch a CPU model to `_cpu_attention` (registered once with transformers' attention interfaces)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(CPU_ATTENTION, _cpu_attention)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    model.set_attn_implementation(CPU_ATTENTION)
    return True


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix, leaving every row at least one token of its own."""
    limit = min(len(s) for s in seqs) - 1
    first = seqs[0]
    for i in range(max(limit, 0)):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return max(limit, 0)


def _prefix_groups(prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Rows grouped by shared prompt prefix: [(row indices, prefix length)].

    Greedy over the lexicographically sorted prompts: a row joins the current group when prefilling the
    group's (possibly shorter) common prefix once saves at least as many tokens as before. A GRPO group
    becomes one group; entries sharing a system prompt share it.
    """
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    groups: list[tuple[list[int], int]] = []
    cur, lcp = [order[0]], len(prompts[order[0]]) - 1
    for i in order[1:]:
        new = min(lcp, _common_prefix([prompts[cur[-1]], prompts[i]]))
        if new > 0 and len(cur) * new >= (len(cur) - 1) * lcp:
            cur.append(i)
            lcp = new
        else:
            groups.append((cur, lcp))
            cur, lcp = [i], len(prompts[i]) - 1
    groups.append((cur, lcp))
    return groups


class HFSession(Session):
    """One batched KV cache for a set of rows (rollouts); see the module docstring."""

    PREFILL_CHUNK = 2048  # max tokens per prefill forward (fewer forwards = faster prefill) ...
    ATTN_BUDGET = 2**24  # ... bounded so rows x chunk x cache length (x heads) stays ~1 GB
    COMPACT_AT = 0.5  # compact the cache when more than half of it is holes ...
    COMPACT_MIN = 512  # ... and it is at least this long

    def __init__(self, backend: HFBackend):
        self.b = backend
        self.cache = None
        self.mask = None  # (rows, cache_len) long: 1 = real token, 0 = hole
        self.keys: list[Hashable] = []
        self.covered: list[list[int]] = []  # per row: token ids whose K/V are in the cache
        self.gen = None

    def close(self) -> None:
        self.cache = self.mask = None

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import torch

        if not prompts:
            return []
        caps = list(max_new_tokens) if max_new_tokens is not None else [sampling.max_new_tokens] * len(prompts)
        if self.gen is None:
            self.gen = torch.Generator(device=self.b.model.device)
            self.gen.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        model = self.b.model
        was_training = model.training
        model.eval()  # no dropout while sampling, even for the model TRL is training
        try:
            with torch.inference_mode():
                self._align(list(keys), [list(p) for p in prompts])
                logits = self._prefill([p[len(c):] for p, c in zip(prompts, self.covered)])
                return self._decode(logits, sampling, caps)
        finally:
            model.train(was_training)

    # -- cache bookkeeping ---------------------------------------------------------------------------
    def _align(self, keys: list, prompts: list[list[int]]) -> None:
        """Keep/reorder cached rows that each prompt extends; otherwise start over from shared prefixes."""
        import torch

        if self.cache is not None and all(k in self.keys for k in keys):
            idx = [self.keys.index(k) for k in keys]
            if all(len(self.covered[i]) < len(p) and p[:len(self.covered[i])] == self.covered[i]
                   for i, p in zip(idx, prompts)):
                if idx != list(range(len(self.keys))):
                    self.cache.batch_select_indices(torch.tensor(idx))
                    self.mask = self.mask[idx]
                    self.covered = [self.covered[i] for i in idx]
                self.keys = keys
                return
        self.keys = keys
        self._prefill_prefixes(prompts, _prefix_groups(prompts))

    def _prefill_prefixes(self, prompts: list[list[int]], groups: list[tuple[list[int], int]]) -> None:
        """Prefill each group's shared prefix once (batch 1), then lay all rows out in one left-padded cache."""
        import torch
        from transformers import DynamicCache

        caches = []
        for rows, n in groups:
            self.cache, self.mask = DynamicCache(), torch.zeros((1, 0), dtype=torch.long)
            if n:
                self._forward_chunks(torch.tensor([prompts[rows[0]][:n]]), torch.ones((1, n), dtype=torch.long))
            caches.append(self.cache)
        width = max(n for _, n in groups)
        order = [i for rows, _ in groups for i in rows]
        perm = torch.tensor([order.index(i) for i in range(len(prompts))])
        prefix_len = {i: n for rows, n in groups for i in rows}
        self.covered = [list(p[:prefix_len[i]]) for i, p in enumerate(prompts)]
        self.mask = torch.tensor([[0] * (width - prefix_len[i]) + [1] * prefix_len[i] for i in order])[perm]
        holder = next((c for c, (_, n) in zip(caches, groups) if n), None)
        if holder is None:
            self.cache = DynamicCache()
            return
        for li, layer in enumerate(holder.layers):
            for attr in ("keys", "values"):
                parts = []
                for cache, (rows, n) in zip(caches, groups):
                    t = getattr(cache.layers[li], attr) if n else getattr(layer, attr)[:, :, :0]
                    t = torch.nn.functional.pad(t, (0, 0, width - n, 0))  # holes on the left, masked
                    parts.append(t.expand(len(rows), -1, -1, -1))
                setattr(layer, attr, torch.cat(parts)[perm.to(t.device)].contiguous())
        self.cache = holder

    def _forward_chunks(self, ids, new_mask):
        """Append `ids` (rows, S) with `new_mask` to the cache chunk by chunk; logits of the last column."""
        import torch

        base = self.mask.sum(1, keepdim=True)
        pos = base + new_mask.cumsum(1) - 1
        pos = torch.where(new_mask.bool(), pos, base.expand_as(pos))
        logits = None
        total = self.mask.shape[1] + ids.shape[1]
        chunk = max(1, min(self.PREFILL_CHUNK, self.ATTN_BUDGET // (ids.shape[0] * total)))
        for s in range(0, ids.shape[1], chunk):
            sl = slice(s, s + chunk)
            self.mask = torch.cat([self.mask, new_mask[:, sl]], dim=1)
            dev = self.b.model.device
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.b.autocast):
                out = self.b.model(input_ids=ids[:, sl].to(dev), attention_mask=self.mask.to(dev),
                                   position_ids=pos[:, sl].to(dev), past_key_values=self.cache,
                                   use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        return logits

    def _prefill(self, suffixes: list[list[int]]):
        """Append each row's new tokens (left-padded so every row ends at the last column)."""
        import torch

        width = max(len(s) for s in suffixes)
        ids = torch.full((len(suffixes), width), self.b.pad_id, dtype=torch.long)
        new_mask = torch.zeros((len(suffixes), width), dtype=torch.long)
        for i, s in enumerate(suffixes):
            ids[i, width - len(s):] = torch.tensor(s)
            new_mask[i, width - len(s):] = 1
            self.covered[i] = self.covered[i] + s
        logits = self._forward_chunks(ids, new_mask)
        self._maybe_compact()
        return logits

    def _maybe_compact(self) -> None:
        """Drop holes (rows re-left-aligned) once they dominate the cache; attention cost follows its length."""
        import torch

        rows, length = self.mask.shape
        valid = self.mask.sum(1)
        if length < self.COMPACT_MIN or valid.sum().item() > (1 - self.COMPACT_AT) * rows * length:
            return
        width = int(valid.max())
        index = torch.zeros((rows, width), dtype=torch.long)
        new_mask = torch.zeros((rows, width), dtype=torch.long)
        for i in range(rows):
            pos = self.mask[i].nonzero().squeeze(1)
            index[i, width - len(pos):] = pos
            new_mask[i, width - len(pos):] = 1
        for layer in self.cache.layers:
            gather = index.to(layer.keys.device)[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.mask = new_mask

    # -- sampling --------------------------------------------------------------------------------------
    def _decode(self, logits, sampling: SamplingParams, caps: list[int]) -> list[Completion]:
        import torch

        rows = logits.shape[0]
        stops = self.b.stop_ids
        out_ids: list[list[int]] = [[] for _ in range(rows)]
        out_lp: list[list[float]] = [[] for _ in range(rows)]
        finish = [None] * rows
        for _ in range(max(caps)):
            tok, lp = _sample(logits, sampling, self.gen)
            feed = torch.full((rows, 1), self.b.pad_id, dtype=torch.long)
            live = torch.zeros((rows, 1), dtype=torch.long)
            for i, (t, l) in enumerate(zip(tok.tolist(), lp.tolist())):
                if finish[i]:
                    continue
                out_ids[i].append(t)
                out_lp[i].append(l)
                if t in stops:
                    finish[i] = "stop"
                elif len(out_ids[i]) >= caps[i]:
                    finish[i] = "length"
                else:  # feed the token back; a row's last token is left for its next prompt to cover
                    feed[i, 0], live[i, 0] = t, 1
                    self.covered[i].append(t)
            if all(finish):
                break
            logits = self._forward_chunks(feed, live)
        tokz = self.b.tokenizer
        return [Completion(ids, lps, _decode(tokz, ids, stops), f or "length")
                for ids, lps, f in zip(out_ids, out_lp, finish)]


def _sample(logits, sampling: SamplingParams, gen):
    """(token, log-prob under softmax(logits / T)) per row; greedy when T == 0."""
    import torch

    logits = logits.float()
    if sampling.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(1, order, sorted_p)
    tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
