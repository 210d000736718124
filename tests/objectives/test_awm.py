"""awm: the matching log-likelihood, its PPO surrogate and the zero-advantage limit."""

import pytest
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


# ---------------------------------------------------------------------------------------------------------------
# Hold-out checks against the AWM authors' code: scxue/advantage_weighted_matching
# advantage_weighted_matching/scripts/train_sd3_awm.py @ be51372, transcribed here from that file (not from
# flowcredit): `compute_log_prob_awm`'s weightings and the advantage clip / rescale of its loss
# ---------------------------------------------------------------------------------------------------------------


def _official_log_prob(model_output, random_noise, clean_latents, timestep, weighting, ghuber_power=0.25):
    model_output = model_output.double()
    log_prob = -(model_output - (random_noise.double() - clean_latents.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if weighting == "t":
        log_prob = log_prob * timestep.view(-1)
    elif weighting == "t**2":
        log_prob = log_prob * timestep.view(-1) ** 2
    elif weighting == "Uniform":
        log_prob = log_prob
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * timestep.view(-1)
    elif weighting == "ghuber":
        log_prob = -(
            torch.pow(-log_prob + 1e-10, ghuber_power)
            - torch.pow(torch.tensor(1e-10, device=log_prob.device, dtype=log_prob.dtype), ghuber_power)
        ) * timestep.view(-1) / ghuber_power
    return log_prob


def _official_advantages(adv, adv_clip_max, advantage_max):
    advantages = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    if advantage_max is not None:
        advantages = advantages / adv_clip_max * advantage_max
    return advantages


def test_huber_and_ghuber_by_hand():
    # v − u = ±0.25 everywhere: ℓ = 0.0625 exactly; t = 0.5
    v = torch.full((1, 2, 2, 2), 0.25) * torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    target, t = torch.zeros_like(v), torch.tensor([0.5])
    # ghuber, p = 0.25: −t·((ℓ + 1e-10)^p − 1e-10^p)/p = −0.5·(0.5 − 10^-2.5)/0.25 = −(1 − 2·10^-2.5) = −0.993675
    assert matching_log_prob(v, target, t, "ghuber", 0.25).item() == pytest.approx(-(1 - 2 * 10**-2.5), rel=1e-6)
    # huber: −t·(√(ℓ + 1e-10) − 1e-5) = −0.5·(0.25 − 1e-5) = −0.124995
    assert matching_log_prob(v, target, t, "huber").item() == pytest.approx(-0.124995, rel=1e-6)


@pytest.mark.parametrize("ours,theirs", [("uniform", "Uniform"), ("t", "t"), ("t2", "t**2"), ("huber", "huber"),
                                         ("ghuber", "ghuber")])
def test_weightings_match_the_awm_code(ours, theirs):
    v, target, t = _data()
    x0 = torch.randn(target.shape, generator=torch.Generator().manual_seed(2))
    eps = target + x0  # u = ε − x0 = target
    for p in (0.25, 0.5):
        vo = v.clone().requires_grad_(True)
        vt = v.clone().requires_grad_(True)
        got = matching_log_prob(vo, eps - x0, t, ours, p)
        want = _official_log_prob(vt, eps, x0, t, theirs, p)
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-7)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(vo.grad, vt.grad.float(), rtol=1e-4, atol=1e-7)


def test_advantage_clip_and_rescale_match_the_awm_code():
    from flowcredit.objectives.awm import awm_advantages

    adv = torch.tensor([-7.0, -2.5, 0.0, 2.5, 7.0])
    # the released recipe: adv_clip_max 5, advantage_max 1 → A/5 on [−5, 5]
    assert awm_advantages(adv, 5.0, 1.0).tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert torch.equal(awm_advantages(adv, 5.0, 1.0), _official_advantages(adv, 5.0, 1.0))
    assert torch.equal(awm_advantages(adv, 5.0, 0.0), _official_advantages(adv, 5.0, None))  # clip only
    assert awm_advantages(adv) is adv  # default: untouched (credit.adv_clip clips)


def test_released_recipe_surrogate_matches_the_awm_code():
    # exp_first loss of train_sd3_awm.py with clip_range 1, ghuber p = 0.25 and A/5, against ours, off-policy
    v, target, t = _data()
    adv = torch.tensor([6.0, -2.0, 0.5, 0.0])
    old = _official_log_prob(v + 0.05, target, torch.zeros_like(target), t, "ghuber").float()
    vo = v.clone().requires_grad_(True)
    vt = v.clone().requires_grad_(True)
    from flowcredit.objectives.awm import awm_advantages

    ours, st = clipped_surrogate(matching_log_prob(vo, target, t, "ghuber", 0.25), old,
                                 awm_advantages(adv, 5.0, 1.0), 1.0)
    log_probs = _official_log_prob(vt, target, torch.zeros_like(target), t, "ghuber")
    ratio = torch.exp(log_probs - old.double().detach())
    advantages = _official_advantages(adv, 5.0, 1.0).double()
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - 1.0, 1.0 + 1.0)
    theirs = torch.maximum(unclipped_loss, clipped_loss)  # per pair; the code takes the mean
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-7)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(vo.grad, vt.grad.float(), rtol=1e-4, atol=1e-8)
