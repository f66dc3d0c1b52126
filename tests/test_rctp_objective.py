"""RCTP's design levers: the stratified pair order (every optimizer step holds a base-model-failure pair and
an own pair), the first answer token's weight and the unlikelihood of the low side's opening under the high
token (train.sft.objective), checked against the loss computed by hand from the same forward."""

from __future__ import annotations

import math

import pytest
from helpers import HIGH, LEVELS, LOW, resolved, tiny_sft_config

from rcgrpo.goal import format_goal
from rcgrpo_tasks.ops.inputs import InputError
from rcgrpo_tasks.train.sft.objective import first_indices, rctp_objective
from rcgrpo_tasks.train.sft.rows import ordered, pair_stratum


def _row(entry: str, token: str, answer: str, kind: str) -> dict:
    return {"entry_id": entry, "reward_token": token, "reward": 1.0 if token == HIGH else 0.0, "kind": kind,
            "trajectory_id": f"{entry}.{kind}", "messages": [
                {"role": "user", "content": f"Add 2 and {entry[1:]}." + format_goal(token)},
                {"role": "assistant", "content": answer}]}


def _pairs(n_base: int, n_own: int) -> list[dict]:
    rows = []
    for i in range(n_base):
        rows += [_row(f"b{i}", HIGH, f"[add(a=2, b={i})]", "expert"), _row(f"b{i}", LOW, "I cannot add.", "policy")]
    for i in range(n_own):
        rows += [_row(f"o{i}", HIGH, f"[add(a=2, b={i})]", "on_policy"),
                 _row(f"o{i}", LOW, f"[add(a=3, b={i})]", "on_policy")]
    return rows


@pytest.mark.parametrize("n_base,n_own", [(3, 7), (7, 3), (5, 5)])
def test_stratified_order_puts_one_base_and_one_own_pair_in_every_step(n_base, n_own):
    rows = _pairs(n_base, n_own)
    out = ordered(rows, "stratified", seed=1)
    pairs = [out[i:i + 2] for i in range(0, len(out), 2)]
    assert all(a["entry_id"] == b["entry_id"] and {a["reward_token"], b["reward_token"]} == {HIGH, LOW} for a, b in pairs)
    steps = [pairs[i:i + 2] for i in range(0, len(pairs), 2)]
    assert all(sorted(pair_stratum(p) for p in step) == ["base", "own"] for step in steps)
    big = max(n_base, n_own)
    assert len(pairs) == 2 * big  # the larger stratum once through, the smaller cycled beside it
    for stratum, n in (("base", n_base), ("own", n_own)):
        seen = [p[0]["entry_id"] for p in pairs if pair_stratum(p) == stratum]
        assert set(seen) == {f"{stratum[0]}{i}" for i in range(n)}
        if n == big:
            assert len(seen) == n
    assert ordered(rows, "stratified", seed=1) == out and ordered(rows, "stratified", seed=2) != out


def test_stratified_order_needs_the_rows_kind_and_falls_back_to_pairs_with_one_stratum():
    rows = _pairs(0, 4)
    assert ordered(rows, "stratified", 0) == ordered(rows, "pairs", 0)
    with pytest.raises(InputError, match="kind"):
        ordered([{k: v for k, v in r.items() if k != "kind"} for r in rows], "stratified", 0)


def test_first_indices_point_at_each_row_s_first_labelled_position():
    import torch

    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert first_indices(mask) == [0, None, 2]


def test_objective_acts_on_pairs_that_part_at_their_first_token_only():
    """Two pairs in one micro-batch: the first parts at its first answer token (weights w on both rows' first
    token, the unlikelihood of each row giving the other's opening), the second shares it (weight 1, no term)."""
    import torch

    high_id, low_id, vocab = 7, 8, 10
    ids = torch.tensor([[1, high_id, 2, 3, 0], [1, low_id, 4, 5, 0], [1, high_id, 2, 3, 6], [1, low_id, 2, 9, 6]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)  # target t+1
    targets = torch.tensor([2, 3, 4, 5, 2, 3, 6, 2, 9, 6])
    logp = torch.log_softmax(torch.randn(len(targets), vocab, generator=torch.Generator().manual_seed(0)), -1)
    metrics = {"high_p_low_opening": [], "low_p_high_opening": []}
    weights, extra = rctp_objective(high_id, low_id, 3.0, 0.5, metrics)(logp, targets, mask, {"input_ids": ids})
    assert weights.tolist() == [3, 1, 3, 1, 1, 1, 1, 1, 1, 1]
    p_high, p_low = logp[0, 4].exp(), logp[2, 2].exp()  # high row gives the low opening (4), and vice versa (2)
    assert math.isclose(float(extra), float(-0.5 * (torch.log1p(-p_high) + torch.log1p(-p_low))), rel_tol=1e-6)
    assert metrics["high_p_low_opening"] == [pytest.approx(float(p_high))]
    assert metrics["low_p_high_opening"] == [pytest.approx(float(p_low))]
    assert rctp_objective(high_id, low_id, 1.0, 0.0) is None


def test_trainer_loss_is_the_weighted_nll_plus_the_unlikelihood(tiny_model_dir, tmp_path):
    """The compact head's loss with the objective equals the hand-computed weighted NLL + UL of the same forward."""
    import torch

    from rcgrpo_tasks.train.sft import trainer as sft_trainer

    rows = ordered(_pairs(2, 2), "stratified", 0)
    cfg = tiny_sft_config(max_steps=1, batch_size=2, row_order="stratified", first_token_weight=4.0, unlikelihood=1.0)
    trainer = sft_trainer.build_trainer(resolved(cfg), tiny_model_dir, rows, LEVELS, tmp_path / "ck")
    ids = [trainer.processing_class.convert_tokens_to_ids(t) for t in LEVELS]
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        logits = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    labels = batch["labels"]
    mask = labels[:, 1:] != -100
    logp = torch.log_softmax(logits[:, :-1][mask], -1)
    tgt = labels[:, 1:][mask]
    nll = -logp.gather(-1, tgt[:, None]).squeeze(-1)
    firsts = first_indices(mask)
    hi, lo = (firsts[0], firsts[1]) if (batch["input_ids"][0] == ids[1]).any() else (firsts[1], firsts[0])
    assert tgt[hi] != tgt[lo]  # the first micro-batch is the base pair: it parts at its first token
    w = torch.ones_like(nll)
    w[[hi, lo]] = 4.0
    ul = -torch.log1p(-logp[hi, tgt[lo]].exp()) - torch.log1p(-logp[lo, tgt[hi]].exp())
    expected = ((nll * w).sum() + ul) / mask.sum()
    assert math.isclose(float(loss), float(expected), rel_tol=1e-4)


def test_config_checks_the_levers():
    with pytest.raises(ValueError, match="first_token_weight"):
        tiny_sft_config(first_token_weight=0.0)
    with pytest.raises(ValueError, match="unlikelihood"):
        tiny_sft_config(unlikelihood=-1.0)
    assert tiny_sft_config(row_order="stratified").row_order == "stratified"
