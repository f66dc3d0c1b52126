"""Shared-prefix forwards (`engine.shared_prefix`) against the plain padded forward, in float32 on CPU: the
per-token log-probs of every target and the gradient of every trainable parameter (LoRA A/B, the
reward-token rows) agree within 1e-5, for GRPO groups, RC-GRPO groups (rows that differ in their reward
token), unequal suffixes with padding, rows that share nothing, and an RCTP pair; the trunk sees prefix +
suffixes once."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rcgrpo_tasks.engine.shared_prefix import (  # noqa: E402
    pack,
    packed_tensors,
    prefix_tree,
    target_hidden,
    trunk_tokens,
)

VOCAB, PAD, HIGH, LOW = 96, 0, 94, 95


def tiny_lora_model(seed: int = 0):
    """A 2-layer random Llama (untied head) with LoRA on every projection and the reward tokens' rows trainable."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                      pad_token_id=PAD, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).float()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], init_lora_weights=False,
                      trainable_token_indices=[HIGH, LOW])
    model = get_peft_model(model, lora)
    model.train()
    return model


def batch(rows: list[list[int]], left: list[int] | None = None):
    """Padded batch: row i gets left[i] pads before it and pads after it up to the common width."""
    left = left or [0] * len(rows)
    width = max(lf + len(r) for lf, r in zip(left, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (lf, r) in enumerate(zip(left, rows)):
        ids[i, lf : lf + len(r)] = torch.tensor(r)
        mask[i, lf : lf + len(r)] = 1
    return ids, mask


def logps_and_grads(model, ids, mask, targets, min_prefix):
    model.zero_grad()
    peft_base = model.get_base_model()
    hidden = target_hidden(peft_base.model, ids, mask, targets, min_prefix)
    logits = peft_base.get_output_embeddings()(hidden)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[targets][:, None]).squeeze(-1)
    (-(logp * torch.linspace(0.5, 1.5, logp.numel()))).sum().backward()  # a weighted loss: every row counts
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp.detach(), grads


def assert_same(model, ids, mask, targets, min_prefix=4):
    plain, g_plain = logps_and_grads(model, ids, mask, targets, None)
    shared, g_shared = logps_and_grads(model, ids, mask, targets, min_prefix)
    assert torch.allclose(plain, shared, atol=1e-5, rtol=0), (plain - shared).abs().max()
    assert g_plain.keys() == g_shared.keys() and any("lora_A" in n for n in g_plain)
    assert any("trainable_tokens" in n for n in g_plain)
    for name in g_plain:
        a, b = g_plain[name], g_shared[name]
        scale = a.abs().max().clamp(min=1e-12)
        assert (a - b).abs().max() / scale < 1e-5, (name, float((a - b).abs().max() / scale))
        # The gradient really reaches every trainable parameter (input token rows: where the tokens occur).
        if "lora_" in name or "lm_head" in name or ((ids == HIGH) | (ids == LOW)).any():
            assert a.abs().sum() > 0, name
    return plain


def completion_targets(mask, completion_width: int):
    """RL: the last `completion_width` columns, where attended."""
    t = torch.zeros_like(mask, dtype=torch.bool)
    t[:, -completion_width:] = mask[:, -completion_width:].bool()
    return t


def rl_rows(prompt, completions, width):
    """TRL's layout: prompts left-padded to the batch's widest, completions right-padded to `width`."""
    return [prompt + c + [PAD] * (width - len(c)) for c in completions]


def test_grpo_groups_with_unequal_suffixes_and_left_padding_match_the_plain_path():
    g = torch.Generator().manual_seed(1)
    p1 = torch.randint(3, 90, (30,), generator=g).tolist()
    p2 = torch.randint(3, 90, (22,), generator=g).tolist()
    comps = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (7, 3, 9, 5, 9, 1, 4, 6)]
    comps[2] = comps[0][:3]  # a completion inside another of its group: the shared part grows into it
    width = 9
    rows, left = [], []
    for i, c in enumerate(comps):
        prompt = p1 if i % 2 == 0 else p2  # groups interleaved, as TRL's shuffled buffer hands them over
        rows.append(prompt + c), left.append(30 - len(prompt))
    ids, mask = batch(rows, left)
    ids = torch.cat([ids, torch.full((len(rows), width + 30 - ids.size(1)), PAD)], dim=1)[:, : 30 + width]
    mask = torch.cat([mask, torch.zeros((len(rows), width + 30 - mask.size(1)), dtype=torch.long)], 1)[:, : 30 + width]
    assert_same(tiny_lora_model(), ids, mask, completion_targets(mask, width))
    assert trunk_tokens(rows) == 30 + 22 + sum(len(c) for c in comps) - 3  # comps[2] lies inside comps[0]


def test_rc_grpo_group_shares_up_to_the_reward_token_and_the_token_trains():
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 90, (25,), generator=g).tolist()
    tokens = [HIGH, LOW, LOW, HIGH]
    comps = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (6, 6, 2, 5)]
    rows = [prompt + [t] + c for t, c in zip(tokens, comps)]
    ids, mask = batch(rows)
    targets = mask.bool() & (torch.arange(ids.size(1)) > len(prompt))[None]  # completions: the token is out
    assert_same(tiny_lora_model(), ids, mask, targets)
    tree = prefix_tree(rows)
    assert tree.depth.count(len(prompt)) == 2  # the prompt once, then one branch per reward token
    assert trunk_tokens(rows) == len(prompt) + 2 + sum(len(c) for c in comps)


def test_rows_that_share_nothing_take_the_plain_layout():
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (12, 8, 15)]
    rows[1][0] = rows[0][0] + 1  # differ at the first token
    ids, mask = batch(rows)
    targets = mask.bool().clone()
    targets[:, 0] = False
    assert_same(tiny_lora_model(), ids, mask, targets)
    assert trunk_tokens(rows) > sum(len(r) for r in rows) - 3  # next to nothing shared: the plain layout


def test_rctp_pair_right_padded_with_labels_matches_the_plain_path():
    g = torch.Generator().manual_seed(4)
    chat = torch.randint(3, 90, (40,), generator=g).tolist()
    good, bad = torch.randint(3, 90, (8,), generator=g).tolist(), torch.randint(3, 90, (5,), generator=g).tolist()
    rows = [chat + [HIGH] + good + [2], chat + [LOW] + bad + [2]]
    ids, mask = batch(rows)  # SFT collator: right padding
    targets = mask.bool() & (torch.arange(ids.size(1)) > len(chat))[None]
    assert_same(tiny_lora_model(), ids, mask, targets)


def test_identical_rows_collapse_and_loss_positions_inside_the_prefix_work():
    g = torch.Generator().manual_seed(5)
    row = torch.randint(3, 90, (20,), generator=g).tolist()
    rows = [row, list(row), row[:15]]
    ids, mask = batch(rows)
    targets = mask.bool() & (torch.arange(ids.size(1)) >= 10)[None]
    assert_same(tiny_lora_model(), ids, mask, targets)
    assert trunk_tokens(rows) == 20


def test_the_trunk_sees_prefix_plus_suffixes_once():
    prompt, comps = list(range(3, 43)), [[50 + i] * (i + 2) for i in range(4)]
    rows = [prompt + c for c in comps]
    n = trunk_tokens(rows)
    assert n == 40 + sum(len(c) for c in comps) and n < sum(len(r) for r in rows) / 2
    model = tiny_lora_model()
    seen = []
    model.get_base_model().model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    ids, mask = batch(rows)
    targets = completion_targets(mask, 5)
    logps_and_grads(model, ids, mask, targets, 8)
    assert seen == [n]  # one forward of prefix + suffixes, not G x (prefix + suffix)
    seen.clear()
    logps_and_grads(model, ids, mask, targets, None)
    assert seen == [ids.numel()]
    seen.clear()
    logps_and_grads(model, ids, mask, targets, 100)  # saves under 100 tokens a row: the plain forward
    assert seen == [ids.numel()]


def test_mask_keeps_branches_apart_and_splits_large_trees():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]
    tree = prefix_tree(rows)
    assert tree.tokens == [1, 2, 3, 4, 5, 6, 7] and tree.depth == [0, 1, 2, 3, 3, 4, 2]
    assert tree.where == [[0, 1, 2, 3], [0, 1, 2, 4, 5], [0, 1, 6]]
    ids, pos, mask = packed_tensors([tree, prefix_tree([[9, 9]])], PAD)
    m = mask[0, 0]
    assert m[4].tolist() == [True, True, True, False, True, False, False]  # 5 sees 1 2 3 and itself, not 4
    assert m[6].tolist() == [True, True, False, False, False, False, True]
    assert mask[1, 0, :2, :2].tolist() == [[True, False], [True, True]]
    assert mask[1, 0, 5].tolist() == [False] * 5 + [True, False]  # padding sees only itself
    parts = pack([[1] * 5 + [i] for i in range(4)], max_tokens=7)
    assert [idx for idx, _ in parts] == [[0, 1], [2, 3]]


def test_a_target_without_a_predictor_is_refused():
    model = tiny_lora_model()
    ids, mask = batch([[5, 6, 7], [5, 6, 8]])
    with pytest.raises(ValueError, match="first attended token"):
        target_hidden(model.get_base_model().model, ids, mask, mask.bool(), 2)
