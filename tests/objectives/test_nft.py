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


# ---------------------------------------------------------------------------------------------------------------
# Hold-out checks against DiffusionNFT's own code: NVlabs/DiffusionNFT scripts/train_nft_sd3.py @ 24af555, its
# advantage modes and its policy loss transcribed here from that file (not from flowcredit), on fixed tensors
# ---------------------------------------------------------------------------------------------------------------


def _official_r(adv, adv_clip_max, adv_mode):
    """`advantages_clip` → `r` of train_nft_sd3.py (the `if hasattr(config.train, "adv_mode")` block)."""
    advantages_clip = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        advantages_clip = torch.clamp(advantages_clip, 0, adv_clip_max)
    elif adv_mode == "negative_only":
        advantages_clip = torch.clamp(advantages_clip, -adv_clip_max, 0)
    elif adv_mode == "one_only":
        advantages_clip = torch.where(
            advantages_clip > 0, torch.ones_like(advantages_clip), torch.zeros_like(advantages_clip)
        )
    elif adv_mode == "binary":
        advantages_clip = torch.sign(advantages_clip)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    return torch.clamp(normalized_advantages_clip, 0, 1)


def _official_policy_loss(forward_prediction, old_prediction, xt, t, x0, r, beta, adv_clip_max):
    """Per-pair `ori_policy_loss * adv_clip_max` of train_nft_sd3.py (before its batch mean), adaptive weights."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (
            torch.abs(x0_prediction.double() - x0.double()).mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (
            torch.abs(negative_x0_prediction.double() - x0.double()).mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    return ori_policy_loss * adv_clip_max


def test_adv_modes_match_diffusionnft_and_one_only_by_hand():
    from flowcredit.objectives.nft import nft_optimality

    adv = torch.tensor([-7.0, -2.5, -1e-3, 0.0, 1e-3, 2.5, 7.0])
    for mode in ("all", "positive_only", "negative_only", "one_only", "binary"):
        for m in (5.0, 2.0):
            assert torch.equal(nft_optimality(adv, m, mode), _official_r(adv, m, mode)), (mode, m)
    # one_only: A' = 1 where A > 0, else 0, so r = 1/2 + 1/(2m) = 0.6 (m = 5) or exactly 1/2 (A ≤ 0)
    assert nft_optimality(adv, 5.0, "one_only").tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6])
    assert nft_optimality(adv, 2.0, "one_only").tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.75, 0.75, 0.75])


@pytest.mark.parametrize("beta", [1.0, 0.1])
@pytest.mark.parametrize("mode", ["all", "one_only"])
def test_loss_and_gradient_match_diffusionnft_off_policy(beta, mode):
    # v_θ ≠ v_old (the soft-updated old adapter of old_policy=soft): loss and gradient equal the official code's
    x0, x_t, t, v_old = _pair()
    adv = torch.tensor([2.5, -1.0, 0.7])
    v = (v_old + 0.2 * torch.randn(v_old.shape, generator=torch.Generator().manual_seed(7))).requires_grad_(True)
    v_ref = v.detach().clone().requires_grad_(True)
    loss, st = nft_pair_loss(v, v_old, x_t, t, x0, adv, NFTOptions(beta=beta, adv_mode=mode))
    expect = _official_policy_loss(v_ref, v_old, x_t, t, x0, _official_r(adv, 5.0, mode), beta, 5.0)
    torch.testing.assert_close(loss, expect.float(), rtol=1e-5, atol=1e-6)
    loss.sum().backward()
    expect.sum().backward()
    torch.testing.assert_close(v.grad, v_ref.grad.float(), rtol=1e-4, atol=1e-7)
    assert torch.equal(st["r"], _official_r(adv, 5.0, mode))


def test_soft_old_policy_option_disables_the_zero_advantage_skip():
    # with π_old ≠ θ an A = 0 pair (r = 1/2) has a gradient m/2·[∇ℓ(v⁺) − ∇ℓ(v⁻)] ≠ 0, so nothing may be skipped
    from flowcredit.objectives import build_objective

    current = build_objective("nft", {})
    soft = build_objective("nft", {"old_policy": "soft", "old_decay_rate": 0.0075, "old_decay_max": 0.999,
                                   "old_decay_flat": 75})
    assert current.skip_zero_advantage(True, 0.0) and current.old_policy_decay is None
    assert not soft.skip_zero_advantage(True, 0.0)
    assert soft.old_policy_decay == (0.0075, 0.999, 75)  # DiffusionNFT's decay_type 2 (OCR)
    x0, x_t, t, v_old = _pair()
    v = (v_old + 0.1).requires_grad_(True)
    loss, _ = nft_pair_loss(v, v_old, x_t, t, x0, torch.zeros(3), NFTOptions())
    loss.sum().backward()
    assert v.grad.abs().max() > 1e-3
