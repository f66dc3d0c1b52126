"""The hf decoder: greedy = step-by-step argmax of full forwards, batch-invariant seeded sampling, the
graph-shaped step equals the eager one, cache sizing, and split-and-retry under memory errors."""

from __future__ import annotations

import warnings

import pytest
from helpers import get_entry

from rcgrpo_tasks.engine.backend import Backend, Completion, SamplingParams, Session, decode_text
from rcgrpo_tasks.engine.device import MemorySplitWarning
from rcgrpo_tasks.engine.hf import HFBackend, HFSession
from rcgrpo_tasks.engine.kvcache import ALIGN, GROWTH, plan_capacity
from rcgrpo_tasks.engine.prefix_layout import ragged_segments
from rcgrpo_tasks.engine.rollout import run_group, run_groups
from rcgrpo_tasks.engine.sampling import mix32, mix64, mix64_tensor, row_seed, uniform_noise
from rcgrpo_tasks.env.prompt import PromptConfig

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 50, 51, 52], [1, 2, 3, 4, 5, 6, 7, 8, 10], [1, 2, 3, 50, 51, 53, 54],
           [99], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
OFFICIAL = PromptConfig("official", "compact", "bfcl").protocol_config(20)


def _argmax_decode(model, prompt, n):
    import torch

    seq, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            out.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        seq.append(out[-1])
    return out


def test_greedy_is_argmax_of_full_forwards_across_calls(backend):
    sess = backend.session()
    sp = SamplingParams(temperature=0.0, max_new_tokens=9)
    seqs = {k: list(p) for k, p in enumerate(PROMPTS)}
    keys = list(seqs)
    for rnd in range(3):  # first call, then continuations (KV reuse), a dropped and reordered row
        outs = sess.generate(keys, [seqs[k] for k in keys], sp, [9 - (k % 3) for k in keys])
        for k, o in zip(keys, outs):
            assert o.token_ids == _argmax_decode(backend.model, seqs[k], len(o.token_ids)), (rnd, k)
            assert len(o.token_ids) == 9 - (k % 3) or o.finish_reason == "stop"
            seqs[k] += o.token_ids + [30 + rnd, 31]
        keys = [5, 0, 3, 1] if rnd == 0 else [3, 5]


def test_seeded_rows_sample_the_same_tokens_in_any_batch(backend):
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=11)
    seeds = {k: row_seed(5, k) for k in range(len(PROMPTS))}
    together = backend.session()
    together.seed_rows(seeds)
    batch = together.generate(list(range(len(PROMPTS))), PROMPTS, sp)
    for k in (0, 4, 5):
        alone = backend.session()
        alone.seed_rows({k: seeds[k]})
        assert alone.generate([k], [PROMPTS[k]], sp)[0].token_ids == batch[k].token_ids
    assert len({tuple(o.token_ids) for o in batch}) > 1


def test_all_groups_at_once_equal_one_group_at_a_time(backend):
    entries = [get_entry(i) for i in ("multi_turn_base_0", "multi_turn_miss_func_2")]
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    tokens = [["<|high_reward|>", None], [None, "<|low_reward|>", None]]
    apart = [run_group(backend, e, len(t), OFFICIAL, sp, t) for e, t in zip(entries, tokens)]
    together = run_groups(backend, list(zip(entries, tokens)), OFFICIAL, sp)
    assert [[t.token_ids for t in g] for g in together] == [[t.token_ids for t in g] for g in apart]
    assert [[t.provenance["sampling"] for t in g] for g in together] == \
        [[t.provenance["sampling"] for t in g] for g in apart]


def test_whole_capacity_step_equals_the_step_over_the_columns_in_use(backend, monkeypatch):
    """What CPU decoding and a CUDA graph run (attention over the whole capacity; a graph checks for stops
    every 8 steps) equals attention over the columns in use (eager CUDA)."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    with monkeypatch.context() as m:
        m.setattr(HFSession, "_runner", lambda self, d, sampling: lambda t: self._step(d, sampling, self.st.cache.n + t))
        eager = [backend.generate(PROMPTS, s) for s in (sp, greedy)]
    monkeypatch.setattr(backend, "stop_check_every", 8)
    shaped = [backend.generate(PROMPTS, s) for s in (sp, greedy)]
    for a, b in zip(eager, shaped):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert all(max(abs(x - y) for x, y in zip(o.logprobs, p.logprobs)) < 1e-5 for o, p in zip(a, b))


def test_cache_is_sized_to_the_rows_and_grows_only_when_needed(backend):
    assert plan_capacity(0, 1) == ALIGN and plan_capacity(0, 130) == 3 * ALIGN
    assert plan_capacity(256, 200) == 256  # fits: unchanged
    assert plan_capacity(256, 257) == ALIGN * -(-int(256 * GROWTH) // ALIGN)  # grows geometrically ...
    assert plan_capacity(256, 1000) == 1024  # ... or to what is needed
    sess = backend.session()
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = [list(range(10, 110)), list(range(10, 60))]
    outs = sess.generate([0, 1], prompts, sp)
    cache = sess.cache
    # The 49 tokens both prompts share are stored once (a block); each row holds what follows it: the longest
    # rest + this call's new tokens.
    assert cache.shared.width == 49 and cache.capacity == plan_capacity(0, 100 - 49 + 8)
    assert cache.keys[0].shape == (2, 2, cache.capacity, 16)
    assert cache.nbytes() == 2 * 2 * 2 * (2 * cache.capacity + 49) * 16 * 4  # layers x K/V x heads x columns
    buffers = cache.keys[0]
    small = [p + o.token_ids + [5] for p, o in zip(prompts, outs)]
    outs = sess.generate([0, 1], small, SamplingParams(temperature=0.0, max_new_tokens=2))
    assert cache.keys[0] is buffers  # fitted: written in place, nothing re-allocated
    big = [p + o.token_ids + [6] * 40 for p, o in zip(small, outs)]
    before = cache.capacity
    sess.generate([0, 1], big, sp)
    assert cache.capacity >= max(before * GROWTH, cache.n) and cache.keys[0] is not buffers


def test_ragged_segments_run_each_span_on_the_rows_that_use_it():
    assert ragged_segments([2, 40, 2, 3], 8) == [(0, 37, [1]), (37, 40, None)]  # the long row alone, then all
    assert ragged_segments([5, 2000, 1000, 3], 64) == [(0, 1000, [1]), (1000, 1995, [1, 2]), (1995, 2000, None)]
    assert ragged_segments([30, 40, 35, 3], 8) == [(0, 10, [1, 2]), (10, 37, [0, 1, 2]), (37, 40, None)]
    assert ragged_segments([30, 40, 35, 3], 16) == [(0, 37, [0, 1, 2]), (37, 40, None)]  # a short span joins the next
    assert ragged_segments([4, 4], 1) == [(0, 4, None)] and ragged_segments([0, 6], 1) == [(0, 6, None)]


def test_uneven_suffixes_run_on_their_rows_with_the_same_tokens(backend, monkeypatch):
    """One long tool reply among short ones: greedy still equals full forwards, ragged equals padded
    (tokens, log-probs), and the forwards see fewer query tokens than rows x the longest suffix."""
    import torch

    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    seen = []
    real_append = HFSession._append

    def counting_append(self, st, ids, new_mask):  # every prefill forward goes through _append
        seen.append(ids.numel())
        return real_append(self, st, ids, new_mask)

    def run(ragged_min):
        monkeypatch.setattr(HFSession, "RAGGED_MIN", ragged_min)
        sess, keys = backend.session(), [0, 1, 2, 3]
        seqs = {k: list(PROMPTS[k]) for k in keys}
        outs = sess.generate(keys, [seqs[k] for k in keys], sp)
        for k, o in zip(keys, outs):
            seqs[k] += o.token_ids + ([40 + i % 50 for i in range(90)] if k == 2 else [30, 31])
        seen.clear()
        with monkeypatch.context() as m:
            m.setattr(HFSession, "_append", counting_append)
            outs = sess.generate(keys, [seqs[k] for k in keys], sp)
        return seqs, outs, sum(seen), int(sess.st.mask.sum())

    seqs, ragged, ragged_queries, ragged_real = run(8)
    _, padded, padded_queries, padded_real = run(10**6)
    for k, o in enumerate(ragged):
        assert o.token_ids == _argmax_decode(backend.model, seqs[k], len(o.token_ids)), k
    assert [o.token_ids for o in ragged] == [o.token_ids for o in padded] and ragged_real == padded_real
    assert max(abs(x - y) for o, p in zip(ragged, padded) for x, y in zip(o.logprobs, p.logprobs)) < 1e-4
    assert padded_queries >= 4 * 90 and ragged_queries < padded_queries / 2, (ragged_queries, padded_queries)
    assert torch.isfinite(torch.tensor([x for o in ragged for x in o.logprobs])).all()


# ------------------------------------------------------------------------------------------ sampling
def test_noise_hash_matches_the_python_reference_and_is_uniform():
    import torch

    xs = [0, 1, 2**40 + 3, -5, 2**62 + 12345]
    got = mix64_tensor(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & (2**64 - 1) for g in got] == [mix64(x) for x in xs]  # wrapping int64 == 64-bit unsigned math
    seeds, pos = torch.tensor([1, 2, 2]), torch.tensor([0, 0, 1])
    u = uniform_noise(seeds, pos, 50_000)
    for r in range(3):  # the tensor hash is the Python reference, id by id
        key = mix64(int(seeds[r]) ^ (int(pos[r]) * 0x9E3779B97F4A7C15)) >> 32
        want = [((mix32(key + i * 0x9E3779B9) >> 8) + 0.5) / 2**24 for i in (0, 1, 777, 49_999)]
        assert u[r, [0, 1, 777, 49_999]].tolist() == pytest.approx(want, rel=1e-7)  # float32 of a 25-bit value
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert torch.histc(u[0], bins=10, min=0, max=1).sub(5000).abs().max() < 250  # ~3.5 sd of a bin
    assert max(abs(float(torch.corrcoef(u[[a, b]])[0, 1])) for a, b in ((0, 1), (1, 2))) < 0.02  # rows, positions
    assert abs(float(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1])) < 0.02  # neighbouring ids


def test_sampler_draws_from_softmax_over_temperature():
    import torch

    from rcgrpo_tasks.engine.sampling import sample_tokens

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).expand(8000, -1)
    sp = SamplingParams(temperature=0.7)
    tok, lp = sample_tokens(logits, sp, torch.full((8000,), 3), torch.arange(8000))
    want = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tok, minlength=5).float() / 8000
    assert torch.allclose(freq, want, atol=0.02) and tok.max() < 4  # p(-30) ~ 1e-19: never in 8000
    assert torch.allclose(lp, torch.log(want)[tok], atol=1e-6)
    nucleus = SamplingParams(temperature=0.7, top_p=0.8)  # the two best tokens hold 0.88 of the mass
    tok, _ = sample_tokens(logits, nucleus, torch.full((8000,), 3), torch.arange(8000))
    freq = torch.bincount(tok, minlength=5).float() / 8000
    assert torch.allclose(freq[:2], want[:2] / want[:2].sum(), atol=0.02) and tok.max() == 1


# ------------------------------------------------------------------------------- split and retry
class _OOMBackend(Backend):
    """Deterministic completions from (key, prompt length); after `free_calls` calls, a step over `limit`
    rows raises like CUDA OOM. Records the keys of each call (`calls`) and of each failed one (`failed`)."""

    name = "oom"

    def __init__(self, tokenizer, limit: int, free_calls: int = 0, error=None):
        self.tokenizer, self.limit, self.free_calls, self.error = tokenizer, limit, free_calls, error
        self.calls: list[list] = []
        self.failed: list[list] = []

    def session(self) -> Session:
        return _OOMSession(self)


class _OOMSession(Session):
    def __init__(self, backend):
        self.b = backend

    def generate(self, keys, prompts, sampling, max_new_tokens=None):
        import torch

        if len(self.b.calls) >= self.b.free_calls and len(prompts) > self.b.limit:
            self.b.failed.append(list(keys))
            raise self.b.error or torch.OutOfMemoryError(f"CUDA out of memory decoding {len(prompts)} rows")
        self.b.calls.append(list(keys))
        eos = self.b.tokenizer.eos_token_id
        out = []
        for key, prompt in zip(keys, prompts):
            text = "[ls(a=True)]" if (key * 7 + len(prompt)) % 3 else "Done."  # a call continues the turn
            ids = self.b.tokenizer.encode(text, add_special_tokens=False) + [eos]
            out.append(Completion(ids, [0.0] * len(ids), decode_text(self.b.tokenizer, ids, {eos}), "stop"))
        return out


def test_memory_error_splits_the_batch_and_keeps_every_rollout(tok):
    entries = [get_entry(i) for i in ("multi_turn_base_0", "multi_turn_miss_param_1", "multi_turn_base_3")]
    groups = [(e, [None] * 3) for e in entries]
    sp = SamplingParams(temperature=0.0, max_new_tokens=32)
    whole = run_groups(_OOMBackend(tok, limit=100), groups, OFFICIAL, sp)
    tight = _OOMBackend(tok, limit=2, free_calls=6)
    with pytest.warns(MemorySplitWarning, match=r"out of memory decoding \d rollouts together; retrying as"):
        split = run_groups(tight, groups, OFFICIAL, sp)
    assert [[t.token_ids for t in g] for g in split] == [[t.token_ids for t in g] for g in whole]
    assert [[t.termination for t in g] for g in split] == [[t.termination for t in g] for g in whole]
    assert [[t.result for t in g] for g in split] == [[t.result for t in g] for g in whole]
    finished_first = set(range(9)) - set(tight.failed[0])
    assert finished_first and len(tight.failed[0]) > 2  # some rollouts ended before the batch hit the error ...
    later = {k for keys in tight.calls[6:] for k in keys}
    assert not later & finished_first  # ... and were kept, not run again
    assert all(len(keys) <= 2 for keys in tight.calls[6:])


def test_a_row_that_never_fits_and_other_errors_surface(tok):
    import torch

    entry = get_entry("multi_turn_base_0")
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(torch.OutOfMemoryError) as info:
        warnings.simplefilter("always")
        run_group(_OOMBackend(tok, limit=0), entry, 4, OFFICIAL, sp)
    assert "does not fit in memory, even alone" in "".join(getattr(info.value, "__notes__", []))
    assert len([w for w in seen if issubclass(w.category, MemorySplitWarning)]) == 2  # 4 -> 2+2, 2 -> 1+1, 1 raises
    with pytest.raises(RuntimeError, match="shapes"):  # not a memory error: no retry
        run_group(_OOMBackend(tok, limit=0, error=RuntimeError("shapes cannot be multiplied")), entry, 4, OFFICIAL, sp)


def test_hf_split_run_equals_the_unsplit_run(backend, monkeypatch):
    """A real session that fails above 2 rows: the halves sample what the whole batch samples."""
    import torch

    entries = [get_entry(i) for i in ("multi_turn_base_1", "multi_turn_miss_func_2")]
    groups = [(e, [None, "<|high_reward|>", None]) for e in entries]
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=9)
    whole = run_groups(backend, groups, OFFICIAL, sp)
    real = HFSession.generate

    def tight(self, keys, prompts, sampling, max_new_tokens=None):
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(self, keys, prompts, sampling, max_new_tokens)

    monkeypatch.setattr(HFSession, "generate", tight)
    with pytest.warns(MemorySplitWarning):
        split = run_groups(backend, groups, OFFICIAL, sp)
    assert [[t.token_ids for t in g] for g in split] == [[t.token_ids for t in g] for g in whole]
    for a, b in zip([t for g in split for t in g], [t for g in whole for t in g]):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


# ---------------------------------------------------------------------------------------------- CUDA
def _cuda_or_skip():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
def test_cuda_greedy_matches_cpu(tiny_model_dir, backend):
    _cuda_or_skip()
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    cpu = backend.generate(PROMPTS, sp)
    for graphs in (True, False):
        cuda = HFBackend(tiny_model_dir, device="cuda", cuda_graphs=graphs)  # float32: same numbers up to rounding
        assert cuda.cuda_graphs == graphs
        out = cuda.generate(PROMPTS, sp)
        assert [o.token_ids for o in out] == [o.token_ids for o in cpu]
        assert all(max(abs(x - y) for x, y in zip(o.logprobs, c.logprobs)) < 1e-3 for o, c in zip(out, cpu))
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, seed=4)  # counter-based noise: CPU == CUDA
    cuda = HFBackend(tiny_model_dir, device="cuda")
    assert [o.token_ids for o in cuda.generate(PROMPTS, sampled)] == \
        [o.token_ids for o in backend.generate(PROMPTS, sampled)]


@pytest.mark.gpu
def test_cuda_bf16_decode_within_bf16_tolerance(tiny_model_dir, backend):
    _cuda_or_skip()
    import torch

    cuda = HFBackend(tiny_model_dir, device="cuda", dtype="bfloat16")
    outs = cuda.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16))
    for p, o in zip(PROMPTS, outs):  # its tokens' log-probs vs a float32 CPU forward of the same sequence
        with torch.no_grad():
            logp = torch.log_softmax(backend.model(torch.tensor([p + o.token_ids])).logits[0].float(), -1)
        fresh = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(o.token_ids)]
        assert max(abs(a - b) for a, b in zip(fresh, o.logprobs)) < 0.1


@pytest.mark.gpu
def test_cuda_memory_per_row_within_1_5x_of_kv_bytes():
    """SmolLM2-135M's shape (random weights, bf16), 32 rows x 2,000-token prompts + 128 new tokens."""
    _cuda_or_skip()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rcgrpo_tasks.engine.kvcache import kv_bytes_per_token

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    b = HFBackend.from_model(model, _FakeTokenizer())
    rows, prompt_len, new = 32, 2000, 128
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 49000, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    outs = b.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))
    peak = torch.cuda.max_memory_allocated()
    tokens = sum(prompt_len + len(o.token_ids) for o in outs)
    ratio = (peak - weights) / (tokens * kv_bytes_per_token(config, 2))
    assert ratio < 1.5, ratio


class _FakeTokenizer:
    """Enough of a tokenizer for the decoder (stop ids, padding, decoding ids to text)."""

    eos_token_id = pad_token_id = 2
    unk_token_id = 0

    def convert_tokens_to_ids(self, token):
        return self.unk_token_id

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))
