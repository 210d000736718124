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


# ---------------------------------------------------------------------------------------------------------------
# optim.kl_base_beta: AWM's two KL terms, transcribed from train_sd3_awm.py @ be51372 (the training loop):
#   kl_loss = ((model_output - model_output_ref) ** 2).mean(dim=(2,3,4), keepdim=True)   # ref: disable_adapter()
#   kl_loss = kl_loss.mean(dim=0).mean()
#   ema_kl_loss = ((model_output - model_output_ema) ** 2).mean(dim=(2,3,4), keepdim=True)  # set_adapter('ema')
#   ema_kl_loss = ema_kl_loss.mean(dim=0).mean()
#   loss = policy_loss + config.train.beta * kl_loss + config.train.ema_beta * ema_kl_loss
# ---------------------------------------------------------------------------------------------------------------


class _Linear:
    """A toy FlowModel: v = a·x_t + t (scalar weight a)."""

    def __init__(self, a: float, grad: bool = False):
        self.a = torch.tensor(a, requires_grad=grad)

    def velocity(self, x_t, t, cond):
        return self.a * x_t + t.view(-1, 1, 1, 1)


def test_two_kl_terms_match_the_awm_code():
    import contextlib

    from flowcredit.objectives.awm import AWMObjective, AWMOptions
    from flowcredit.objectives.base import LossContext
    from flowcredit.types import Trajectory

    nb, T, k = 3, 14, 6  # one AWM micro-batch: train.batch_size = 3 samples × train_timesteps = 6 times
    g = torch.Generator().manual_seed(4)
    traj = Trajectory(
        latents=torch.randn(nb, T + 1, 2, 3, 3, generator=g), log_probs=torch.zeros(nb, T),
        timesteps=torch.linspace(1, 0, T + 1), step_mask=torch.ones(T, dtype=torch.bool),
        group_ids=torch.arange(nb), prompts=[""] * nb, metadata=[{}] * nb,
    )
    policy, ema, base = _Linear(1.3, grad=True), _Linear(1.1), _Linear(0.8)
    ctx = LossContext(
        model=policy, traj=traj, cond={"ids": torch.zeros(nb, 1)}, uncond=None, guidance=1.0, params=None,
        reference=lambda: contextlib.nullcontext(ema), on_policy=True, seed=3, iteration=1, kl_beta=1.0,
        kl_base_beta=1e-3, base_reference=lambda: contextlib.nullcontext(base),
    )
    obj = AWMObjective(AWMOptions(weighting="ghuber", ghuber_power=0.25, adv_clip_max=5.0, advantage_max=1.0,
                                  clip_range=1.0), base_kl=True)
    assert "kl_base" in obj.sum_keys and "kl_base" not in AWMObjective(AWMOptions()).sum_keys
    t_idx = torch.tensor([1, 3, 4, 7, 9, 10])  # one draw of discrete_wo_init, shared by the micro-batch
    ji = t_idx.repeat_interleave(nb)  # the code's layout: (train_timesteps, batch_size) flattened
    bi = torch.arange(nb).repeat(k)
    adv_sample = torch.tensor([6.0, -2.0, 0.5])
    pairs = list(zip(bi.tolist(), ji.tolist()))
    obj.prepare(ctx, pairs)
    out = obj.loss(ctx, bi, ji, adv_sample[bi])
    ours = out.loss.sum() / len(pairs)  # the trainer: Σ pairs / the step's pair count
    ours.backward()
    g_ours = policy.a.grad.clone()
    policy.a.grad = None

    # the official loss on the same noised latents (x_t, t, x0, ε of the pairs)
    x_t, t, x0, eps = obj.fp.noised(ctx, bi, ji)
    model_output = policy.velocity(x_t, t, None).double()
    with torch.no_grad():
        model_output_ref = base.velocity(x_t, t, None).double()
        model_output_ema = ema.velocity(x_t, t, None).double()
    log_prob = _official_log_prob(model_output, eps, x0, t.double(), "ghuber")
    ratio = torch.exp(log_prob - log_prob.detach())
    advantages = _official_advantages(adv_sample, 5.0, 1.0).double().unsqueeze(0).repeat(k, 1).view(-1)
    policy_loss = torch.mean(torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 0.0, 2.0)))
    shape = (k, nb, *model_output.shape[1:])
    mo, mr, me = model_output.view(shape), model_output_ref.view(shape), model_output_ema.view(shape)
    kl_loss = ((mo - mr) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()
    ema_kl_loss = ((mo - me) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()
    theirs = policy_loss + 0.001 * kl_loss + 1.0 * ema_kl_loss
    theirs.backward()
    assert kl_loss > 0 and ema_kl_loss > 0
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(g_ours.double(), policy.a.grad.double(), rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(out.sums["kl_base"] / len(pairs), float(kl_loss.detach()), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(out.sums["kl"] / len(pairs), float(ema_kl_loss.detach()), rtol=1e-5, atol=1e-9)
    assert out.nfe == 2 * len(pairs)  # one EMA and one base forward per pair


def test_without_kl_base_beta_the_base_model_is_never_called():
    import contextlib

    from flowcredit.objectives.awm import AWMObjective, AWMOptions
    from flowcredit.objectives.base import LossContext
    from flowcredit.types import Trajectory

    traj = Trajectory(
        latents=torch.randn(2, 4, 2, 2, 2), log_probs=torch.zeros(2, 3), timesteps=torch.linspace(1, 0, 4),
        step_mask=torch.ones(3, dtype=torch.bool), group_ids=torch.arange(2), prompts=[""] * 2, metadata=[{}] * 2,
    )

    def boom():
        raise AssertionError("the base reference was used with kl_base_beta = 0")

    ctx = LossContext(model=_Linear(1.0, grad=True), traj=traj, cond={"ids": torch.zeros(2, 1)}, uncond=None,
                      guidance=1.0, params=None, reference=lambda: contextlib.nullcontext(_Linear(0.9)),
                      on_policy=True, seed=0, iteration=1, kl_beta=1.0, base_reference=boom)
    obj = AWMObjective(AWMOptions())
    bi, ji = torch.tensor([0, 1]), torch.tensor([1, 2])
    obj.prepare(ctx, [(0, 1), (1, 2)])
    out = obj.loss(ctx, bi, ji, torch.ones(2))
    assert "kl_base" not in out.sums and out.nfe == 2
