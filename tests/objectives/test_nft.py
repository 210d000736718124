"""nft: DiffusionNFT's loss against its limits (r = 1/2, β → 0, hand-written reference)."""

import pytest
import torch

from flowcredit.objectives.nft import NFTOptions, nft_pair_loss


def _pair(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, 4, 4, 4, generator=g)
    eps = torch.randn(n, 4, 4, 4, generator=g)
    t = torch.tensor([0.9, 0.5, 0.2])[:n]
    tb = t.view(-1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * eps
    v_old = (eps - x0) + 0.3 * torch.randn(n, 4, 4, 4, generator=g)
    return x0, x_t, t, v_old


def _grad(adv, beta=1.0, adaptive=True, seed=0):
    """Gradient of Σ L wrt v_θ at v_θ = v_old (on-policy)."""
    x0, x_t, t, v_old = _pair(seed=seed)
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_pair_loss(v, v_old, x_t, t, x0, adv, NFTOptions(beta=beta, adaptive_weight=adaptive))
    loss.sum().backward()
    return v.grad, (x0, x_t, t, v_old)


def test_half_optimality_gives_zero_gradient_on_policy():
    # r = 1/2 (A = 0): the positive and negative terms cancel at v_θ = v_old, for every β
    for beta in (1.0, 0.1, 1e-3):
        g, _ = _grad(torch.zeros(3), beta=beta)
        assert g.abs().max() < 1e-5


def test_on_policy_gradient_is_advantage_weighted_flow_matching():
    # ∇_v L = m·(2r − 1)·∇_v mean_d (x_t − t·v − x0)² / w with w = sg(mean_d |x̂0 − x0|), at any β
    adv = torch.tensor([2.5, -1.0, 0.0])
    m = 5.0
    r = adv.clamp(-m, m) / m / 2 + 0.5
    for beta in (1.0, 0.3):
        g, (x0, x_t, t, v_old) = _grad(adv, beta=beta)
        tb = t.view(-1, 1, 1, 1)
        err = x_t - tb * v_old - x0
        w = err.abs().mean(dim=(1, 2, 3), keepdim=True)
        d = err[0].numel()
        expect = m * (2 * r - 1).view(-1, 1, 1, 1) * (-2 * tb * err / w) / d
        assert torch.allclose(g, expect, atol=1e-6, rtol=1e-4)


def test_small_beta_limit_gradient_is_the_on_policy_one_at_v_old():
    # ∇_v L = m·[r·∇ℓ(v⁺) − (1 − r)·∇ℓ(v⁻)] and v± → v_old as β → 0: off-policy (v_θ ≠ v_old) the gradient tends to
    # m·(2r − 1)·∇ℓ(v_old), ℓ(v) = mean_d (x_t − t·v − x0)² (fixed weights); at β = 1 it does not
    x0, x_t, t, v_old = _pair()
    adv = torch.tensor([1.0, -3.0, 4.0])
    m = 5.0
    r = adv / m / 2 + 0.5
    v = v_old + 0.5 * torch.randn(v_old.shape, generator=torch.Generator().manual_seed(3))
    tb = t.view(-1, 1, 1, 1)
    expect = m * (2 * r - 1).view(-1, 1, 1, 1) * (-2 * tb * (x_t - tb * v_old - x0)) / v_old[0].numel()

    def grad(beta):
        vv = v.clone().requires_grad_(True)
        loss, _ = nft_pair_loss(vv, v_old, x_t, t, x0, adv, NFTOptions(beta=beta, adaptive_weight=False))
        loss.sum().backward()
        return vv.grad

    err = [float((grad(b) - expect).abs().max() / expect.abs().max()) for b in (1.0, 1e-1, 1e-2, 1e-3)]
    assert err[0] > 0.1 and err[-1] < 1e-2
    assert err == sorted(err, reverse=True)  # converges monotonically


def test_full_optimality_is_weighted_flow_matching_of_the_positive_policy():
    # r = 1 (A ≥ m), β = 1: L = m·mean_d (x̂0(v_θ) − x0)² / w⁺ exactly
    x0, x_t, t, v_old = _pair()
    v = v_old + 0.1
    loss, st = nft_pair_loss(v, v_old, x_t, t, x0, torch.full((3,), 7.0), NFTOptions(beta=1.0))
    err = x_t - t.view(-1, 1, 1, 1) * v - x0
    w = err.abs().mean(dim=(1, 2, 3)).clamp(min=1e-5)
    assert torch.allclose(loss, 5.0 * err.pow(2).mean(dim=(1, 2, 3)) / w, rtol=1e-5)
    assert torch.equal(st["r"], torch.ones(3))


@pytest.mark.parametrize("adv", [-10.0, -5.0, 0.0, 5.0, 10.0])
def test_optimality_probability_range(adv):
    x0, x_t, t, v_old = _pair()
    _, st = nft_pair_loss(v_old, v_old, x_t, t, x0, torch.full((3,), adv), NFTOptions())
    assert torch.allclose(st["r"], torch.full((3,), min(1.0, max(0.0, adv / 10 + 0.5))))


def test_adv_mode_maps_advantages_as_diffusionnft():
    from flowcredit.objectives.nft import nft_optimality

    adv = torch.tensor([-7.0, -2.5, 0.0, 2.5, 7.0])
    m = 5.0
    assert torch.allclose(nft_optimality(adv, m, "all"), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    assert torch.allclose(nft_optimality(adv, m, "positive_only"), torch.tensor([0.5, 0.5, 0.5, 0.75, 1.0]))
    assert torch.allclose(nft_optimality(adv, m, "negative_only"), torch.tensor([0.0, 0.25, 0.5, 0.5, 0.5]))
    assert torch.allclose(nft_optimality(adv, m, "binary"), torch.tensor([0.4, 0.4, 0.5, 0.6, 0.6]))
    with pytest.raises(ValueError, match="adv_mode"):
        nft_optimality(adv, m, "bogus")


def test_crn_shares_noise_and_steps_within_a_group():
    # common random numbers: members of a prompt group get the same ε at the same trained steps; groups differ
    from types import SimpleNamespace

    from flowcredit.objectives.forward import ForwardProcess
    from flowcredit.trainer.distributed import Shard, plan_update

    B, T, G = 6, 5, 3
    gids = torch.arange(B) // G
    traj = SimpleNamespace(latents=torch.zeros(B, T + 1, 1, 2, 2), num_steps=T, group_ids=gids)
    ctx = SimpleNamespace(traj=traj, seed=0, iteration=1, on_policy=True, row_start=0, batch_global=0)
    fp = ForwardProcess("fresh", crn=True)
    fp.prepare(ctx, [])
    assert torch.equal(fp.eps[0], fp.eps[2]) and torch.equal(fp.eps[3], fp.eps[5])
    assert not torch.equal(fp.eps[0], fp.eps[3])
    plain = ForwardProcess("fresh")
    plain.prepare(ctx, [])
    assert not torch.equal(plain.eps[0], plain.eps[1])

    kw = dict(seed=0, iteration=1, inner_epochs=1, updates_per_epoch=1, steps_per_sample=2, skip_zero_adv=False)
    adv, mask = torch.ones(B, T), torch.ones(T, dtype=torch.bool)
    _, _, plan = plan_update(adv, mask, Shard(B // G, G, 0, 1), step_groups=gids.tolist(), **kw)
    steps = {b: sorted(j for bb, j in plan[0][0][0] if bb == b) for b in range(B)}
    assert steps[0] == steps[1] == steps[2] and steps[3] == steps[4] == steps[5]
    assert all(len(s) == 2 for s in steps.values())
