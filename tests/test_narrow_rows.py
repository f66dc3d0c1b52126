"""Ended rows leave the CPU decode batch (`HFSession._narrow`): the same tokens and log-probs as decoding every
row to the end, a cache later calls continue from as if nothing had moved, and fewer rows per step."""

from __future__ import annotations

import pytest

from rcgrpo_tasks.engine.backend import SamplingParams
from rcgrpo_tasks.engine.sampling import row_seed

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 50, 51, 52], [1, 2, 3, 4, 5, 6, 7, 8, 10], [1, 2, 3, 50, 51, 53, 54],
           [99], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 50, 51, 52]]
CAPS = [11, 1, 2, 7, 1, 3, 12, 2]  # rows end at steps 1..12: the batch narrows 8 -> 4 -> 2 -> 1


def _calls(backend, narrow: bool, sampling: SamplingParams) -> list[list]:
    """Three calls on one session (the second and third continue each row's cache, one row dropped and the
    rest reordered), every row seeded: per call, the completions."""
    backend.narrow_rows = narrow
    try:
        sess = backend.session()
        sess.seed_rows({k: row_seed(9, k) for k in range(len(PROMPTS))})
        seqs = {k: list(p) for k, p in enumerate(PROMPTS)}
        keys, out = list(seqs), []
        for rnd in range(3):
            caps = [CAPS[(k + rnd) % len(CAPS)] for k in keys]
            got = sess.generate(keys, [seqs[k] for k in keys], sampling, caps)
            out.append([(k, o.token_ids, o.logprobs, o.finish_reason) for k, o in zip(keys, got)])
            for k, o in zip(keys, got):
                seqs[k] += o.token_ids + [40 + rnd, 41]
            keys = keys[::-1][1:]
        return out
    finally:
        backend.narrow_rows = True


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_narrowed_decode_gives_the_full_batchs_tokens_across_calls(backend, temperature):
    sampling = SamplingParams(temperature=temperature, max_new_tokens=12, seed=4)
    full, narrow = _calls(backend, False, sampling), _calls(backend, True, sampling)
    for a_call, b_call in zip(full, narrow):
        assert [(k, t, f) for k, t, _, f in a_call] == [(k, t, f) for k, t, _, f in b_call]
        for (_, _, la, _), (_, _, lb, _) in zip(a_call, b_call):
            assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-5
    assert sorted(len(t) for _, t, _, _ in narrow[0]) == sorted(CAPS)  # random model: every row runs to its cap


def _rows_per_step(backend, monkeypatch, narrow: bool, sampling: SamplingParams, prompts=PROMPTS,
                   caps=CAPS) -> list[int]:
    """Rows of every one-token decode forward of one call."""
    model, seen = backend.model, []
    forward = model.forward

    def counting(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            seen.append(int(ids.shape[0]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    backend.narrow_rows = narrow
    try:
        backend.session().generate(list(range(len(prompts))), prompts, sampling, caps)
    finally:
        backend.narrow_rows = True
        monkeypatch.undo()
    return seen


def test_a_step_carries_only_about_its_live_rows(backend, monkeypatch):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4)
    full = _rows_per_step(backend, monkeypatch, False, sampling)
    narrow = _rows_per_step(backend, monkeypatch, True, sampling)
    assert full == [8] * 11  # 12 steps, the first sampled from the prefill
    live = [sum(c > t for c in CAPS) for t in range(1, 12)]  # rows live at each decode step
    assert narrow == [8, 4, 4, 4, 4, 4, 2, 2, 2, 2, 1] and all(lv <= n < 2 * lv for lv, n in zip(live, narrow))
    assert sum(narrow) < sum(full) / 2


def test_guided_rows_keep_their_twins(backend, monkeypatch):
    """Guidance decodes each row beside its twin (the other goal token, here 5 <-> 6): never narrowed."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=4, guidance=1.5, guidance_pair=(5, 6))
    prompts, caps = [[1, 2, 5, 8, 9], [1, 2, 5, 3], [4, 6]], [1, 1, 12]
    seen = _rows_per_step(backend, monkeypatch, True, sampling, prompts, caps)
    assert seen == [6] * 11
