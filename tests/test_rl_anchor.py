"""Algo `rc_anchor` (`train.rl.anchor`): RC-GRPO whose low-token rollouts carry the KL coefficient beta_low.
On a fixed batch the anchored loss is TRL's own loss with a per-rollout beta (TRL's `_compute_loss` run row by
row at each rollout's beta), its gradient too, the advantages are RC-GRPO's (untouched), and beta_low = beta
is RC-GRPO exactly."""

from __future__ import annotations

import os

import pytest
from helpers import HIGH, LEVELS, LOW

torch = pytest.importorskip("torch")

from rcgrpo_tasks.train.rl import anchor  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
B, P, T = 6, 5, 7


def _trainer(model_dir, tmp_path, loss_type="grpo", kl_token_max=None):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rcgrpo import RCGRPOConfig
    from rcgrpo_tasks.train.rl.pipeline_trainer import Options, pipeline_trainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = RCGRPOConfig(str(tmp_path / "out"), num_generations=2, per_device_train_batch_size=B, max_steps=1,
                        max_completion_length=T, beta=0.1, loss_type=loss_type, report_to=[], use_cpu=True,
                        bf16=False, save_strategy="no", disable_tqdm=True, reward_tokens=list(LEVELS))
    trainer = pipeline_trainer()(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_list([{"prompt": "hi"}] * 4), processing_class=tok,
                              options=Options(kl_token_max=kl_token_max, beta_low=1.0))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # the training loop sets it
    return trainer


def _batch(trainer, coef, old=False):
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 4:] = 0  # rows of other lengths: the per-sequence token mean matters
    completion_mask[4, 2:] = 0
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[2, 1:3] = 0  # environment tokens carry no loss and no KL
    return {"prompt_ids": torch.randint(3, vocab, (B, P), generator=g), "prompt_mask": torch.ones(B, P, dtype=torch.long),
            "completion_ids": torch.randint(3, vocab, (B, T), generator=g), "completion_mask": completion_mask,
            "tool_mask": tool_mask, "advantages": torch.tensor([1.5, -0.5, -0.5, 0.5, -1.0, 1.0]),
            # a reference the policy is far from on some tokens (the bound acts there when set)
            "ref_per_token_logps": -torch.rand(B, T, generator=g) * 12.0, "num_items_in_batch": completion_mask.sum(),
            anchor.KL_COEF: torch.tensor(coef),
            # an update off its generation's policy (later minibatches): TRL's ratio, on the KL term too
            **({"old_per_token_logps": -9.0 - torch.rand(B, T, generator=g)} if old else {})}


def _rows(batch, i):
    return {k: (v[i:i + 1] if isinstance(v, torch.Tensor) and v.ndim else v) for k, v in batch.items()
            if k != anchor.KL_COEF}


@pytest.mark.parametrize("kl_token_max,old", [(None, False), (3.0, False), (None, True)])
def test_the_anchored_loss_is_trls_loss_at_each_rollouts_beta(rl_env, tmp_path, kl_token_max, old):
    _, model_dir = rl_env
    trainer = _trainer(model_dir, tmp_path, kl_token_max=kl_token_max)
    coef = [1.0, 0.1, 1.0, 0.1, 0.1, 1.0]
    batch = _batch(trainer, coef, old)
    loss = trainer._compute_loss(trainer.model, batch)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    # TRL's own `_compute_loss` on each row alone at that row's beta; `grpo` averages the rows' losses.
    want, want_grads = 0.0, [torch.zeros_like(p) for p in params]
    for i, b in enumerate(coef):
        trainer.beta = b
        row = trainer._compute_loss(trainer.model, _rows(batch, i)) / B
        want = want + row.detach()
        for acc, g in zip(want_grads, torch.autograd.grad(row, params), strict=True):
            acc += g
    trainer.beta = 0.1
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    worst = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(grads, want_grads, strict=True))
    assert worst < 1e-3  # float32 sums of k3 terms up to e^10 in another order
    assert any(g.abs().sum() > 0 for g in grads)
    # the anchor changes the loss (the comparison is not between equal terms) ...
    plain = trainer._compute_loss(trainer.model, {k: v for k, v in batch.items() if k != anchor.KL_COEF})
    assert loss.item() > plain.item() + 1e-4
    # ... and beta_low = beta is RC-GRPO's loss
    same = trainer._compute_loss(trainer.model, {**batch, anchor.KL_COEF: torch.full((B,), 0.1)})
    assert same.item() == pytest.approx(plain.item(), rel=1e-6)


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo"])
def test_the_extra_term_aggregates_as_trl_does(rl_env, tmp_path, loss_type):
    """For the token-mean losses the per-rollout beta is TRL's loss with the KL term weighted per row: compare
    with TRL's loss at beta_low minus the same at beta on the low rows' KL only (linear in beta)."""
    _, model_dir = rl_env
    trainer = _trainer(model_dir, tmp_path, loss_type=loss_type)
    coef = [1.0, 0.1, 1.0, 0.1, 0.1, 1.0]
    batch = _batch(trainer, coef)
    loss = trainer._compute_loss(trainer.model, batch).item()
    zero_adv = {**{k: v for k, v in batch.items() if k != anchor.KL_COEF}, "advantages": torch.zeros(B)}
    trainer.beta = 1.0
    kl_all = trainer._compute_loss(trainer.model, zero_adv).item()  # = sum of every row's KL term, aggregated
    low = torch.tensor([c == 1.0 for c in coef])
    only_low = {**zero_adv, "completion_mask": batch["completion_mask"] * low.unsqueeze(1)}
    kl_low = trainer._compute_loss(trainer.model, only_low).item()  # the low rows' share (the same denominators)
    trainer.beta = 0.1
    plain = trainer._compute_loss(trainer.model, {k: v for k, v in batch.items() if k != anchor.KL_COEF}).item()
    if loss_type == "bnpo":  # its denominator is the batch's loss tokens: masking rows changes it; rescale
        kl_low *= float(only_low["completion_mask"].mul(batch["tool_mask"]).sum()) / float(
            batch["completion_mask"].mul(batch["tool_mask"]).sum())
    assert kl_all > kl_low > 0
    assert loss == pytest.approx(plain + (1.0 - 0.1) * kl_low, rel=1e-5)


def test_rollout_betas_and_the_generation_batch_marks_the_low_rows():
    assert anchor.rollout_betas([HIGH, LOW, None, LOW], LOW, 0.1, 1.0) == [0.1, 1.0, 0.1, 1.0]


def test_what_rc_anchor_needs_is_checked_before_anything_loads():
    anchor.check_anchor(0.1, 1.0, "grpo")
    for args, msg in (((0.1, None, "grpo"), "beta_low"), ((0.0, 1.0, "grpo"), "beta > 0"),
                      ((0.1, 1.0, "dapo"), "loss_type")):
        with pytest.raises(ValueError, match=msg):
            anchor.check_anchor(*args)
