"""Token sampling for the `hf` session: counter-based randomness, so a row's samples do not depend on its batch.

Each row has a 63-bit seed; the noise for (row, token position, vocabulary id) is a hash of the three
(splitmix64's finaliser of seed and position, then a 32-bit integer hash of that key and the vocabulary id:
wrapping int64 / int32 arithmetic, identical on CPU and CUDA), turned into Gumbel noise, and the
sampled token is `argmax(logits / T + gumbel)` (with top-p: `argmax(log softmax(logits / T) + gumbel)` over the
nucleus): an exact draw from softmax(logits / T), or from the nucleus renormalised, as `torch.multinomial`
would make (Gumbel-max trick). What this buys:
- a rollout samples the same tokens whether it is decoded alone, with its group, with every group of a
  batch, or in one half of a batch split after an out-of-memory error (up to float rounding of the logits);
- no generator state: a CUDA graph can capture the whole decode step, and CPU and CUDA draw the same noise.
The per-vocabulary hash is 32-bit, in place, because it runs over rows x vocabulary at every step
(docs/log.md, "Engine", has its cost). Inverse-CDF sampling
(one uniform per row) would cost less still, but it makes the token depend on the rounding of every logit
before it in vocabulary order: on bf16 vs float32 logits of the same text it changed 31 % of the tokens,
Gumbel-max 2.4 % (and 0.6 % vs 0 % under a 1e-6 relative perturbation), so batch invariance would be lost.
Greedy (T = 0) is an argmax. The uniform draws have 24 bits: a token whose
log-probability is ~20 nats below the best one's can never be drawn (a probability below 1e-8 ignored).
Log-probs are those of `softmax(logits / T)`; top-p truncation is not folded in (what TRL recomputes).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Hashable

MASK63 = (1 << 63) - 1
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15 as int64: odd, spreads consecutive counters
_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9
_M2 = -7723592293110705685  # 0x94d049bb133111eb
_NOISE_BITS = 24


def mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (reference for `mix64_tensor`, and for seeds)."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def row_seed(seed: int, index: Hashable) -> int:
    """A row's 63-bit seed from a base seed and the row's identity (an int, or any value via crc32 of repr)."""
    salt = index if isinstance(index, int) else zlib.crc32(repr(index).encode())
    return mix64(mix64(seed & ((1 << 64) - 1)) ^ (salt & ((1 << 64) - 1))) & MASK63


def mix64_tensor(z):
    """`mix64` on an int64 tensor: wrapping multiplies, logical right shifts (arithmetic ones, masked)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _M1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def mix32(x: int) -> int:
    """A 32-bit integer hash (xorshift-multiply, the constants of Wellons' `lowbias32`) on a Python int:
    the reference for `uniform_noise`'s per-vocabulary hash."""
    x &= 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0xD35A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def _int32(x: int) -> int:
    """A 32-bit pattern as the signed value torch's int32 holds."""
    return x - (1 << 32) if x >= 1 << 31 else x


_M3, _M4, _GOLDEN32 = _int32(0x21F0AAAD), _int32(0xD35A2D97), _int32(0x9E3779B9)


def uniform_noise(seeds, positions, vocab: int):
    """(rows, vocab) float32 uniforms in (0, 1) from int64 `seeds` and `positions` (rows,): pure functions.
    Per row a 32-bit key (the high half of `mix64(seed ^ position * golden)`), per vocabulary id
    `mix32(key + id * golden32)` in wrapping int32 (arithmetic right shifts, masked). In place on two
    buffers: it runs over rows x vocabulary at every decode step, and a fresh multi-MB tensor per operation
    costs its page faults (on 40 rows x 49k, more than the arithmetic)."""
    import torch

    key = (mix64_tensor(seeds ^ (positions * _GOLDEN)) >> 32).to(torch.int32)  # (rows,)
    z = _vocab_counters(vocab, seeds.device) + key[:, None]
    t = torch.empty_like(z)
    for shift, mult in ((16, _M3), (15, _M4), (15, None)):
        torch.bitwise_right_shift(z, shift, out=t).bitwise_and_((1 << (32 - shift)) - 1)
        z.bitwise_xor_(t)
        if mult is not None:
            z.mul_(mult)
    torch.bitwise_right_shift(z, 32 - _NOISE_BITS, out=t).bitwise_and_((1 << _NOISE_BITS) - 1)
    return t.to(torch.float32).add_(0.5).mul_(1.0 / (1 << _NOISE_BITS))


@functools.cache
def _vocab_counters(vocab: int, device):
    """`id * golden32` (wrapping int32) for every vocabulary id: the per-id half of the hash's input."""
    import torch

    return torch.arange(vocab, device=device, dtype=torch.int32) * _GOLDEN32


def guided_logits(goal, other, scale: float):
    """Reward-token guidance: `goal + scale * (goal - other)` in float32 (rows, vocab). Logits and log-probs
    give the same distribution (each row's log-normaliser is a constant softmax drops)."""
    goal = goal.float()
    return goal + scale * (goal - other.float())


def sample_tokens(logits, sampling, seeds=None, positions=None):
    """(token, log-prob under softmax(logits / T)) per row; greedy (argmax) when T == 0.

    `seeds`, `positions`: int64 tensors (rows,) on the logits' device (the row's seed and the sampled
    token's index in its sequence); needed when T > 0. Pure tensor ops, no host sync. Without top-p the
    Gumbel-max draw is `argmax(logits / T + gumbel)` (the row's log-normaliser, a constant, left out) and
    only the drawn token's log-prob is normalised.
    """
    import torch

    logits = logits.float()
    if sampling.temperature == 0:
        tok = logits.argmax(dim=-1)
        return tok, _logprob(logits, tok)
    scaled = logits / sampling.temperature if sampling.temperature != 1 else logits
    scores = scaled
    if sampling.top_p < 1.0:
        logp = torch.log_softmax(scaled, dim=-1)
        sorted_p, order = logp.exp().sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sampling.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop).scatter(1, order, drop)
        scores = logp.masked_fill(drop, float("-inf"))
    gumbel = uniform_noise(seeds, positions, logits.shape[-1]).log_().neg_().log_().neg_()
    tok = gumbel.add_(scores).argmax(dim=-1)
    return tok, _logprob(scaled, tok)


def _logprob(scaled, tok):
    """log softmax(scaled)[tok] per row, without materialising the whole log-softmax."""
    import torch

    return scaled.gather(1, tok[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)


def with_twins(keys: list, prompts: list[list[int]], caps: list[int], pair: tuple[int, int]):
    """Reward-token guidance's rows: each row, then its twin (key `(TWIN, key)`) whose prompt has the other
    reward token in place of every high/low token (same length, so both stay aligned token for token).
    A prompt with neither token cannot be guided: ValueError naming its key."""
    high, low = pair
    swap = {high: low, low: high}
    twins = []
    for key, p in zip(keys, prompts):
        if high not in p and low not in p:
            raise ValueError(f"guidance: prompt of row {key!r} has no reward goal token; guide only "
                             f"reward-conditioned rollouts")
        twins.append([swap.get(t, t) for t in p])
    return keys + [(TWIN, k) for k in keys], prompts + twins, caps + caps


TWIN = "rcgrpo-guidance-twin"
