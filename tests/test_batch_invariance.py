"""Batch invariance of the hf engine: every row of a batch of distinct prompts gets, token for token, the
log-probs of its own full forward, whatever composes the batch's cache.

Log-probs, not argmax: a random-init model's argmax rarely flips when a row attends to the wrong keys, its
log-probs move at once (a row that lost its own docs' K/V moved by ~0.1 nat). The prompts are the real chat
template over the real tokenizer: a system prompt several rows share, tool docs and questions of very
different lengths (spans only some rows use run well past `HFSession.RAGGED_MIN`), and rows that share a head
up to their reward token. Each path is checked at the first token, through 16+ decode steps, for rows that end
early (CPU: the narrowed batch), and for later calls on the same session (new tokens of very different
lengths, rows reordered and dropped, holes compacted). On CUDA the same tests run the CUDA path (batched
prefill, CUDA graphs).
"""

from __future__ import annotations

import random

import pytest
from helpers import HIGH, LOW, config_from_params, device_under_test

from rcgrpo_tasks.engine.backend import SamplingParams
from rcgrpo_tasks.engine.hf import HFBackend
from rcgrpo_tasks.engine.kvcache import slot_cache_class
from rcgrpo_tasks.engine.sampling import guided_logits

TOL = 1e-4
"""Largest |log-prob| difference from a row's own forward (float32)."""
WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega vector matrix tensor string integer "
         "float boolean list dict returns the of a an to for with from city temperature unit account").split()
CAPS = [20, 3, 17, 24, 6, 18, 20, 9]
"""Per-row decode budgets: rows end early (and, on the CPU, the batch narrows to the live ones)."""


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _prompts(tok) -> list[list[int]]:
    """Eight chat prompts: two tool sets (system prompts of ~130 and ~330 tokens) shared by several rows, a
    question a pair shares up to its reward goal, one row with no system prompt, one ~430-token question."""
    rng = random.Random(7)
    docs = {"short": "You call functions. Docs: " + _text(rng, 120), "long": "You call functions. Docs: " + _text(rng, 320)}
    asked = _text(rng, 12)
    rows = [("short", _text(rng, 8)), ("short", _text(rng, 90)), ("long", _text(rng, 15)),
            ("short", f"{asked}\n\n[Reward Goal: {HIGH}]"), ("short", f"{asked}\n\n[Reward Goal: {LOW}]"),
            (None, _text(rng, 4)), ("long", _text(rng, 200)), (None, _text(rng, 430))]
    out = []
    for system, user in rows:
        messages = ([{"role": "system", "content": docs[system]}] if system else []) + \
                   [{"role": "user", "content": user}]
        out.append(list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)))
    return out


def _own_logprobs(model, ids: list[int], start: int, temperature: float = 0.0, twin: list[int] | None = None,
                  guidance: float = 0.0) -> list[float]:
    """The log-probs that a row's own forward (no cache, batch 1) gives tokens ids[start:] (guided by its twin's
    forward where `twin` is given, as `sample_tokens` scores them)."""
    import torch

    def logits(seq):
        with torch.no_grad():
            return model(torch.tensor([seq], device=model.device)).logits[0].float().cpu()

    out = logits(ids)
    if twin is not None:
        out = guided_logits(out, logits(twin), guidance)
    logp = torch.log_softmax(out / (temperature or 1.0), -1)
    return [logp[j - 1, ids[j]].item() for j in range(start, len(ids))]


def _gap(own: list[float], got: list[float]) -> float:
    """The largest |own - got| over a row's decoded tokens. The row must have decoded tokens and carry one
    log-prob for each: an empty or short output would otherwise compare as equal."""
    assert own and len(own) == len(got), f"{len(got)} log-probs for {len(own)} decoded tokens"
    return max(abs(a - b) for a, b in zip(own, got))


def _worst(model, prompts: list[list[int]], outs, temperature: float = 0.0) -> float:
    """The largest gap between a row's log-probs in the batch and in its own forward, over every row and token
    (every prompt must have its output)."""
    assert prompts and len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} prompts"
    return max(_gap(_own_logprobs(model, p + o.token_ids, len(p), temperature), o.logprobs)
               for p, o in zip(prompts, outs))


def _backend(tiny_model_dir, path: str) -> HFBackend:
    """The hf backend on the device under test, its cache composed the way `path` names."""
    b = HFBackend(tiny_model_dir, device=str(device_under_test()))
    on_cpu = b.model.device.type == "cpu"
    if path == "blocks" and not b.shared_prefixes:
        pytest.skip("shared-prefix blocks are the CPU attention's")
    if path in ("copied", "copied-wide") and not on_cpu:
        pytest.skip("the prefix tree copied into rows is the CPU's path")
    b.shared_prefixes = path == "blocks"
    b.batched_prefill = path == "bucketed" or not on_cpu
    b.narrow_rows = path != "copied-wide"
    return b


PATHS = ["blocks", "copied", "copied-wide", "bucketed"]
"""blocks: the CPU default (prefix tree, shared prefixes stored once); copied: the prefix tree copied into each
row; copied-wide: the same, ended rows never leave the batch; bucketed: the CUDA path (prefill by length
bucket), on the CPU too."""


@pytest.mark.parametrize("path", PATHS)
def test_every_row_decodes_as_its_own_forward_across_calls(tiny_model_dir, tok, path):
    b = _backend(tiny_model_dir, path)
    prompts = _prompts(tok)
    assert max(map(len, prompts)) - min(map(len, prompts)) > 400
    sess = b.session()
    sess.COMPACT_AT, sess.COMPACT_MIN = 0.3, 64  # compaction on the later calls' holes
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max(CAPS))
    keys = list(range(len(prompts)))
    outs = sess.generate(keys, prompts, greedy, CAPS)
    assert [len(o.token_ids) for o in outs] == CAPS  # a random model never stops: each row ran its budget
    assert _worst(b.model, prompts, outs) < TOL
    rng = random.Random(3)
    seqs = dict(zip(keys, prompts))
    for call, order in enumerate(([0, 1, 2, 3, 4, 5, 6, 7], [6, 3, 0, 7, 1])):  # then reordered, rows dropped
        for k, o in zip(keys, outs):  # a tool reply per row: 2 to ~170 tokens (ragged spans)
            seqs[k] = seqs[k] + o.token_ids + tok.encode(_text(rng, rng.choice([1, 3, 120, 60, 2])))
        keys = order
        outs = sess.generate(keys, [seqs[k] for k in keys], greedy, [16 + k for k in keys])
        assert _worst(b.model, [seqs[k] for k in keys], outs) < TOL, call


def test_sampled_rows_decode_as_their_own_forward(tiny_model_dir, tok):
    b = _backend(tiny_model_dir, "blocks" if device_under_test().type == "cpu" else "bucketed")
    prompts = _prompts(tok)
    sampling = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=16, seed=5)
    outs = b.session().generate(list(range(len(prompts))), prompts, sampling)
    assert _worst(b.model, prompts, outs, temperature=0.7) < TOL


def test_guided_rows_and_their_twins_decode_as_their_own_forwards(rl_env, tok):
    """Reward-token guidance: each row and its twin (the other token) share the batch and its cache; a row's
    log-probs are those of the guided logits of its own two forwards."""
    from transformers import AutoTokenizer

    _, model_dir = rl_env
    b = HFBackend(model_dir, device=str(device_under_test()))
    rtok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [p for p in _prompts(rtok) if rtok.convert_tokens_to_ids(HIGH) in p or rtok.convert_tokens_to_ids(LOW) in p]
    prompts += [p[:-5] + rtok.encode(f" pad{HIGH}") + p[-5:] for p in _prompts(rtok)[5:]]  # longer, distinct
    pair = tuple(rtok.convert_tokens_to_ids(t) for t in (HIGH, LOW))
    w = 1.5
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=2, guidance=w, guidance_pair=pair)
    outs = b.session().generate(list(range(len(prompts))), prompts, sampling)
    swap = {pair[0]: pair[1], pair[1]: pair[0]}
    assert prompts and len(outs) == len(prompts)
    for p, o in zip(prompts, outs):
        ids = p + o.token_ids
        own = _own_logprobs(b.model, ids, len(p), 1.0, twin=[swap.get(t, t) for t in ids], guidance=w)
        assert _gap(own, o.logprobs) < TOL


def test_the_check_sees_a_batch_that_drops_a_rows_own_keys(tiny_model_dir, tok, monkeypatch):
    """The invariance check has the power to fail: with a row's own K/V dropped from the batch's cache (a
    write that lands nowhere, as `put_columns` did into a cache without buffers), the gap is far past TOL."""
    if device_under_test().type != "cpu":
        pytest.skip("the CPU's shared-prefix path is the one whose first span is ragged")
    b = _backend(tiny_model_dir, "blocks")
    prompts = _prompts(tok)
    cls = slot_cache_class()
    real = cls.put_columns

    def dropping(self, sub, index, start, width):
        if not self.keys:
            return None  # the write lands nowhere
        return real(self, sub, index, start, width)

    monkeypatch.setattr(cls, "put_columns", dropping)
    monkeypatch.setattr(cls, "check_stored", lambda self, before=None: None)
    outs = b.session().generate(list(range(len(prompts))), prompts, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert _worst(b.model, prompts, outs) > 100 * TOL


def test_the_check_fails_on_empty_or_missing_outputs():
    """No comparison passes for want of something to compare: no output, no token, a log-prob short."""
    for own, got in (([], []), ([-1.0, -2.0], [-1.0])):
        with pytest.raises(AssertionError):
            _gap(own, got)
    with pytest.raises(AssertionError):
        _worst(None, [[1, 2, 3]], [])


def test_a_cache_never_counts_columns_it_did_not_store():
    """A cache with no buffers refuses to count, copy out or compact columns; a write into it allocates them."""
    import torch

    cls = slot_cache_class()
    empty = cls(2, 64)
    with pytest.raises(RuntimeError, match="never stored"):
        empty.advance(3)
    empty = cls(2, 64)
    empty.n = 5  # as a session that set its width without placing anything would
    with pytest.raises(RuntimeError, match="never stored"):
        empty.take_rows(torch.tensor([0]), 64)
    with pytest.raises(RuntimeError, match="never stored"):
        empty.gather_columns(torch.zeros((2, 4), dtype=torch.int64), 4)
    src = cls(1, 64)
    k = torch.randn(1, 2, 7, 16)
    src.update(k, k + 1, 0)
    src.advance(7)
    dst = cls(2, 64)
    dst.put_columns(src, torch.tensor([1]), 0, 7)  # a first span only row 1 uses
    assert len(dst.keys) == 1 and torch.equal(dst.keys[0][1, :, :7], k[0]) and not dst.keys[0][0].any()
    assert torch.equal(dst.values[0][1, :, :7], k[0] + 1)


def test_evaluate_rollouts_are_each_rows_own_on_real_entries(tiny_model_dir):
    """`evaluate`'s path: real single-turn entries (simple_python and the longer `multiple` prompts) in
    sessions of 16 rows (evaluate's default), each trajectory's log-probs those of its own forward, and the same tokens as one
    entry at a time."""
    import torch

    from rcgrpo_tasks.engine.rollout import run_rollouts
    from rcgrpo_tasks.env.prompt import PromptConfig
    from rcgrpo_tasks.env.single_turn import entries as single_turn

    by_cat = single_turn.load_entries(("simple_python", "multiple"))
    entries = [e for c in ("simple_python", "multiple") for e in [x for x in by_cat if x.category == c][:8]]
    b = HFBackend(tiny_model_dir, device=str(device_under_test()))
    proto = config_from_params(PromptConfig, "prompt").protocol_config(1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    batched = run_rollouts(b, entries, 1, proto, greedy, batch_rows=16)
    assert len(entries) == 16 and len(batched) == len(entries)
    lengths = [t.prompt_len for t in batched]
    assert max(lengths) - min(lengths) > 64
    for t in batched:
        assert len(t.completion_mask) == len(t.logprobs) == len(t.token_ids) and any(t.completion_mask), t.entry_id
        with torch.no_grad():
            logits = b.model(torch.tensor([t.token_ids], device=b.model.device)).logits[0].float().cpu()
        logp = torch.log_softmax(logits, -1)
        for j, (m, lp) in enumerate(zip(t.completion_mask, t.logprobs)):
            if m:
                assert abs(logp[j - 1, t.token_ids[j]].item() - lp) < TOL, (t.entry_id, j)
    alone = run_rollouts(b, entries, 1, proto, greedy, batch_rows=1)
    assert len(alone) == len(batched) and [t.token_ids for t in alone] == [t.token_ids for t in batched]
