"""Reward-token guidance: guided logits, the twin rows, the hf decoder's guided tokens
against full forwards of both contexts on a tiny model, and the refusals."""

from __future__ import annotations

import pytest

from rcgrpo_tasks.engine.backend import SamplingParams, reward_pair_ids
from rcgrpo_tasks.engine.sampling import TWIN, guided_logits, row_seed, with_twins
from rcgrpo_tasks.engine.vllm import refuse_guidance

HIGH, LOW = 60, 61
PROMPTS = [[1, 2, 3, HIGH, 7, 8, 9], [1, 2, 3, LOW, 50, 51], [4, HIGH, 5, 5, 6, 7, 8, 9, 10]]


def test_guided_logits_is_goal_plus_w_times_the_difference():
    import torch

    goal, other = torch.tensor([[1.0, 2.0, 0.5]]), torch.tensor([[1.5, 0.0, 0.5]])
    assert torch.equal(guided_logits(goal, other, 0.0), goal)
    assert torch.allclose(guided_logits(goal, other, 2.0), torch.tensor([[0.0, 6.0, 0.5]]))
    # log-probs instead of logits: the same distribution (per-row constants cancel in softmax)
    a = torch.softmax(guided_logits(goal, other, 1.5), -1)
    b = torch.softmax(guided_logits(goal.log_softmax(-1), other.log_softmax(-1), 1.5), -1)
    assert torch.allclose(a, b, atol=1e-6)


def test_twins_swap_the_reward_tokens_and_keep_length():
    keys, prompts, caps = with_twins(["a", "b"], [[1, HIGH, 2], [LOW, 3, LOW]], [4, 5], (HIGH, LOW))
    assert keys == ["a", "b", (TWIN, "a"), (TWIN, "b")]
    assert prompts == [[1, HIGH, 2], [LOW, 3, LOW], [1, LOW, 2], [HIGH, 3, HIGH]]
    assert caps == [4, 5, 4, 5]
    with pytest.raises(ValueError, match="row 'c' has no reward goal"):
        with_twins(["c"], [[1, 2, 3]], [4], (HIGH, LOW))


def _guided_reference(model, prompt, n, w):
    """Greedy guided decode by full forwards of both contexts: (tokens, log-probs)."""
    import torch

    swap = {HIGH: LOW, LOW: HIGH}
    goal, other, toks, lps = list(prompt), [swap.get(t, t) for t in prompt], [], []
    for _ in range(n):
        with torch.no_grad():
            lg = guided_logits(model(torch.tensor([goal])).logits[:, -1], model(torch.tensor([other])).logits[:, -1], w)
        lp = torch.log_softmax(lg, -1)[0]
        toks.append(int(lp.argmax()))
        lps.append(float(lp.max()))
        goal.append(toks[-1])
        other.append(toks[-1])
    return toks, lps


@pytest.mark.parametrize("w", [0.0, 1.0, 4.0])
def test_guided_greedy_equals_full_forwards_of_both_contexts_across_calls(backend, w):
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, guidance=w, guidance_pair=(HIGH, LOW) if w else None)
    sess = backend.session()
    seqs = [list(p) for p in PROMPTS]
    for rnd in range(2):  # the second call extends the cached rows and their twins (KV reuse)
        outs = sess.generate(list(range(len(seqs))), seqs, sp)
        assert len(outs) == len(seqs)
        for i, o in enumerate(outs):
            ref_toks, ref_lps = _guided_reference(backend.model, seqs[i], len(o.token_ids), w)
            assert o.token_ids == ref_toks, (rnd, i)
            assert o.logprobs == pytest.approx(ref_lps, abs=1e-4)
            seqs[i] = seqs[i] + o.token_ids + [30 + rnd]


def test_guidance_changes_tokens_and_a_row_samples_the_same_in_any_batch(backend):
    plain = SamplingParams(temperature=1.0, max_new_tokens=8, seed=4)
    guided = SamplingParams(temperature=1.0, max_new_tokens=8, seed=4, guidance=8.0, guidance_pair=(HIGH, LOW))
    seeds = {k: row_seed(9, k) for k in range(len(PROMPTS))}

    def run(sampling, keys):
        sess = backend.session()
        sess.seed_rows({k: seeds[k] for k in keys})
        return [o.token_ids for o in sess.generate(keys, [PROMPTS[k] for k in keys], sampling)]

    together = run(guided, [0, 1, 2])
    assert run(guided, [2]) == [together[2]]
    assert run(plain, [0, 1, 2]) != together  # a large w moves the samples (same seeds)


def test_guidance_refusals(backend):
    with pytest.raises(ValueError, match="guidance"):
        SamplingParams(guidance=1.0)  # no pair
    with pytest.raises(ValueError, match="guidance"):
        SamplingParams(guidance=-1.0)
    with pytest.raises(ValueError, match="needs the hf backend"):
        refuse_guidance(SamplingParams(guidance=1.0, guidance_pair=(HIGH, LOW)))
    refuse_guidance(SamplingParams())
    with pytest.raises(ValueError, match="no token '<\\|high_reward\\|>'"):
        reward_pair_ids(backend.tokenizer, ("<|high_reward|>", "<|low_reward|>"))
    sess = backend.session()
    with pytest.raises(ValueError, match="no reward goal"):
        sess.generate([0], [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=2, guidance=1.0,
                                                       guidance_pair=(HIGH, LOW)))


def test_reward_pair_ids_on_a_tokenizer_with_reward_tokens(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|high_reward|>", "<|low_reward|>"]})
    high, low = reward_pair_ids(tok, ("<|high_reward|>", "<|low_reward|>"))
    assert tok.convert_ids_to_tokens([high, low]) == ["<|high_reward|>", "<|low_reward|>"]
