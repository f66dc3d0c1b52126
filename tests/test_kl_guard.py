"""The KL bound and the divergence check (`train.rl.kl_guard`): pure functions here; through TRL's loss and a
real diverging run in tests/test_rl.py."""

from __future__ import annotations

import math

import pytest

from rcgrpo_tasks.train.rl.config import GuardConfig
from rcgrpo_tasks.train.rl.kl import bounded_reference, kl_bounds
from rcgrpo_tasks.train.rl.kl_guard import divergence, restore_step


def k3(d: float) -> float:
    return math.exp(d) - d - 1


@pytest.mark.parametrize("m", [0.5, 10.0, 100.0])
def test_bounds_are_the_two_roots_of_k3(m):
    lo, hi = kl_bounds(m)
    assert lo < 0 < hi
    assert k3(lo) == pytest.approx(m, rel=1e-9) and k3(hi) == pytest.approx(m, rel=1e-9)


def test_bounded_reference_keeps_tokens_inside_and_bounds_value_and_gradient_outside():
    torch = pytest.importorskip("torch")
    lo, hi = kl_bounds(10.0)
    ref = torch.tensor([-1.0, -2.0, -1.0, -30.0])
    pol = torch.tensor([-1.2, -1.5, -25.0, -1.0], requires_grad=True)  # d: +0.2, -0.5, +24 (far off), -29
    bounded = bounded_reference(ref, pol, lo, hi)
    kl = torch.exp(bounded - pol) - (bounded - pol) - 1  # TRL's k3 against the reference it is handed
    raw = torch.exp(ref - pol) - (ref - pol) - 1
    assert torch.allclose(kl[:2], raw[:2])  # inside the bounds: TRL's term exactly
    assert kl[2].item() == pytest.approx(10.0, rel=1e-5) and raw[2].item() > 1e9
    assert kl[3].item() == pytest.approx(10.0, rel=1e-5)
    kl.sum().backward()
    g = pol.grad
    assert torch.isfinite(g).all() and g.abs().max() <= math.exp(hi)  # bounded by exp(hi) - 1
    assert g[2] < 0 or g[2] > 0  # the far-off token still feels the pull back to the reference


def row(step, reward=0.5, kl=0.01, loss=0.1, skipped=0.0):
    return {"step": step, "reward": reward, "kl": kl, "loss": loss, "step_skipped": skipped}


def test_divergence_names_the_step_and_the_cause():
    cfg = GuardConfig(max_kl=1.0, window=3, min_reward=0.25)
    healthy = [row(i) for i in range(1, 7)]
    assert divergence(healthy, cfg) is None
    assert "step 7: mean KL" in divergence(healthy + [row(7, kl=3.0)], cfg)
    assert "step 7: loss nan" in divergence(healthy + [row(7, loss=float("nan"))], cfg)
    assert "step 7: kl inf" in divergence(healthy + [row(7, kl=float("inf"))], cfg)
    collapsed = healthy[:3] + [row(i, reward=0.0) for i in range(4, 7)]
    assert "step 6: reward 0 for 3 steps" in divergence(collapsed, cfg)
    # never good enough to collapse from; a skipped step has no loss to judge; a KL check can be off
    assert divergence([row(i, reward=0.1 if i < 4 else 0.0) for i in range(1, 7)], cfg) is None
    assert divergence(healthy + [row(7, loss=float("nan"), kl=float("nan"), skipped=1.0)], cfg) is None
    assert divergence(healthy + [row(7, kl=3.0)], GuardConfig(max_kl=None, window=3, min_reward=0.25)) is None


def test_rollback_goes_to_the_newest_checkpoint_before_the_condemned_policy():
    assert restore_step([4, 5], 6) == 4  # step 6's row judges the weights after 5 updates
    assert restore_step([5, 6], 6) == 0  # nothing older kept: the init
    assert restore_step([], 2) == 0

