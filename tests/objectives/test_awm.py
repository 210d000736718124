"""awm: the matching log-likelihood, its PPO surrogate and the zero-advantage limit."""

import torch

from flowcredit.objectives.awm import matching_log_prob
from flowcredit.objectives.grpo import clipped_surrogate


def _data():
    g = torch.Generator().manual_seed(1)
    v = torch.randn(4, 3, 4, 4, generator=g)
    target = torch.randn(4, 3, 4, 4, generator=g)
    t = torch.tensor([0.9, 0.6, 0.3, 0.1])
    return v, target, t


def test_matching_log_prob_weightings():
    v, target, t = _data()
    mse = (v - target).pow(2).mean(dim=(1, 2, 3))
    assert torch.allclose(matching_log_prob(v, target, t, "uniform"), -mse)
    assert torch.allclose(matching_log_prob(v, target, t, "t"), -mse * t)
    assert torch.allclose(matching_log_prob(v, target, t, "t2"), -mse * t**2)


def test_zero_advantage_gives_zero_loss_and_gradient():
    v, target, t = _data()
    v.requires_grad_(True)
    lp = matching_log_prob(v, target, t, "uniform")
    loss, _ = clipped_surrogate(lp, lp.detach() + 0.01, torch.zeros(4), 1e-4)  # off-policy ratio ≠ 1 too
    assert torch.equal(loss, torch.zeros(4))
    loss.sum().backward()
    assert torch.equal(v.grad, torch.zeros_like(v))


def test_on_policy_gradient_is_advantage_weighted_matching_gradient():
    # ratio ≡ 1: ∇L = A·∇ mean_d (v − u)²  (positive A pulls v toward the target u = ε − x0)
    v, target, t = _data()
    v.requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    lp = matching_log_prob(v, target, t, "uniform")
    loss, st = clipped_surrogate(lp, lp.detach(), adv, 1e-4)
    loss.sum().backward()
    d = v[0].numel()
    expect = adv.view(-1, 1, 1, 1) * 2 * (v.detach() - target) / d
    assert torch.allclose(v.grad, expect, atol=1e-6)
    assert st["ratio_mean"].item() == 1.0
