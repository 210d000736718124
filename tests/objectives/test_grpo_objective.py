"""grpo objective: PPO clipped surrogate and the Gaussian KL penalty, with hand-derived numbers."""

import math

import torch

from flowcredit.objectives.grpo import clipped_surrogate
from flowcredit.samplers.sde import gaussian_kl_same_std as kl_penalty

E = math.e


def test_clipped_surrogate_hand_computed():
    # ε = 0.2; log_prob − old = +1 -> ratio e ≈ 2.718, −1 -> ratio 1/e ≈ 0.368; clip(e) = 1.2, clip(1/e) = 0.8.
    #   A=+1, r=e  : max(−e,   −1.2) = −1.2   (clipped: no incentive to push the ratio further up)
    #   A=−1, r=e  : max(+e,   +1.2) = +e     (pessimistic bound keeps the unclipped, larger loss)
    #   A=+1, r=1/e: max(−1/e, −0.8) = −1/e
    #   A=−1, r=1/e: max(+1/e, +0.8) = +0.8
    old = torch.zeros(4)
    log_prob = torch.tensor([1.0, 1.0, -1.0, -1.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, stats = clipped_surrogate(log_prob, old, adv, clip_range=0.2)
    assert torch.allclose(loss, torch.tensor([-1.2, E, -1 / E, 0.8]), atol=1e-6)
    # ratio mean = (2e + 2/e)/4; all four |r − 1| > 0.2 -> clipfrac 1;
    # approx_kl = mean((r − 1) − log r) = (2·(e − 1 − 1) + 2·(1/e − 1 + 1))/4 = (2(e − 2) + 2/e)/4.
    assert math.isclose(stats["ratio_mean"].item(), (2 * E + 2 / E) / 4, rel_tol=1e-6)
    assert stats["clipfrac"].item() == 1.0
    assert math.isclose(stats["approx_kl"].item(), (2 * (E - 2) + 2 / E) / 4, rel_tol=1e-6)
    # Gradients: clipped entries (0 and 3) get none; unclipped get d(−A·r)/dlogp = −A·r: +e and −1/e.
    loss.sum().backward()
    assert torch.allclose(log_prob.grad, torch.tensor([0.0, E, -1 / E, 0.0]), atol=1e-6)


def test_ratio_one_gives_minus_advantage():
    adv = torch.tensor([0.5, -2.0])
    loss, stats = clipped_surrogate(torch.zeros(2), torch.zeros(2), adv, clip_range=1e-4)
    assert torch.equal(loss, -adv)
    assert stats["ratio_mean"].item() == 1.0 and stats["clipfrac"].item() == 0 and stats["approx_kl"].item() == 0


def test_kl_penalty_zero_and_formula():
    mean = torch.randn(2, 3, 4, 4)
    kl_std = torch.tensor([0.5, 0.0])
    assert not kl_penalty(mean, mean.clone(), kl_std).any()
    # mean − mean_ref = 0.2 in every dim: 0.04 / (2·0.25) = 0.08 (mean reduction), ×48 dims for "sum"; std 0 -> 0.
    kl = kl_penalty(mean, mean - 0.2, kl_std, "mean")
    assert torch.allclose(kl, torch.tensor([0.08, 0.0]), atol=1e-6)
    assert torch.allclose(kl_penalty(mean, mean - 0.2, kl_std, "sum"), torch.tensor([0.08 * 48, 0.0]), atol=1e-5)
