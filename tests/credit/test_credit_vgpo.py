"""VGPO TCRM + ADAE (ALGORITHMS.md §5.2–5.5): hand-derived values, limits, non-positive rewards."""

import pytest
import torch

from flowcredit.credit import CreditCfg, CreditInput, assign_credit
from flowcredit.credit.vgpo import (
    VGPOOptions,
    adae_anchor,
    discounted_value,
    group_step_zscore,
    shift_nonnegative,
    tcrm,
    timestep_weights,
    vgpo_advantages,
)

EPS = 1e-4


def make_input(instant, group_ids, rewards=None):
    t = instant.shape[1]
    r = instant[:, -1].clone() if rewards is None else rewards
    mask = torch.ones(t, dtype=torch.bool)
    return CreditInput(rewards=r, group_ids=group_ids, step_mask=mask, instant_rewards=instant)


def test_value_hand_computed():
    # I = [1, 2, 3], γ = 0.5:  Q_2 = 3;  Q_1 = 2 + 0.5·3 = 3.5;  Q_0 = 1 + 0.5·3.5 = 2.75
    inst = torch.tensor([[1.0, 2.0, 3.0]])
    q = discounted_value(inst, 0.5)
    torch.testing.assert_close(q, torch.tensor([[2.75, 3.5, 3.0]]))
    # ω = Q / mean(Q) = Q / (9.25 / 3) ≈ [0.8919, 1.1351, 0.9730]
    torch.testing.assert_close(timestep_weights(q, EPS), q / (9.25 / 3))
    # γ = 1: plain reward-to-go [6, 5, 3]
    torch.testing.assert_close(discounted_value(inst, 1.0), torch.tensor([[6.0, 5.0, 3.0]]))


def test_gamma_zero_gives_instant_rewards():
    inst = torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(discounted_value(inst, 0.0), inst)


def test_omega_mean_one_over_steps():
    inst = torch.rand(6, 7, generator=torch.Generator().manual_seed(1))
    omega = timestep_weights(discounted_value(inst, 0.9), EPS)
    torch.testing.assert_close(omega.mean(1), torch.ones(6))
    assert (omega >= 0).all()


def test_omega_of_an_all_zero_trajectory_zero_or_uniform():
    q = torch.tensor([[0.0, 0.0, 0.0], [3.0, 2.0, 1.0]])
    zero = timestep_weights(q, EPS)
    uniform = timestep_weights(q, EPS, "uniform")
    torch.testing.assert_close(zero[0], torch.zeros(3))
    torch.testing.assert_close(uniform[0], torch.ones(3))
    torch.testing.assert_close(zero[1], uniform[1])  # other trajectories: Q / mean Q = [1.5, 1, 0.5] either way
    torch.testing.assert_close(zero[1], torch.tensor([1.5, 1.0, 0.5]))
    with pytest.raises(ValueError, match="weights_degenerate: unknown value 'x'"):
        timestep_weights(q, EPS, "x")


def test_uniform_omega_keeps_the_negative_advantage_of_a_failing_sample():
    # binary rewards, one group of two: the first sample's estimates never score, the second's always do
    inst = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    inp = make_input(inst, torch.tensor([0, 0]))
    zero = assign_credit(CreditCfg(name="vgpo"), inp).advantages
    uniform = assign_credit(CreditCfg(name="vgpo", options={"weights_degenerate": "uniform"}), inp).advantages
    assert (zero[0] == 0).all()  # the A14 guard: no signal from the failure
    assert (uniform[0] < 0).all()  # uniform ω: the failing sample is pushed away from
    torch.testing.assert_close(zero[1], uniform[1])


def constant_and_diverse_batch():
    # group 0: three identical trajectories (all rewards equal), group 1: three different ones; T = 4
    same = torch.tensor([[0.2, 0.4, 0.6, 0.8]] * 3)
    diverse = torch.tensor([[0.1, 0.5, 0.3, 0.9], [0.6, 0.2, 0.4, 0.1], [0.3, 0.3, 0.8, 0.5]])
    return torch.cat([same, diverse]), torch.tensor([0, 0, 0, 1, 1, 1])


def test_all_equal_group_flow_grpo_zero_adae_absolute():
    inst, group_ids = constant_and_diverse_batch()
    inp = make_input(inst, group_ids)
    flow = assign_credit(CreditCfg(name="flow_grpo"), inp).advantages
    assert torch.equal(flow[:3], torch.zeros(3, 4))  # Flow-GRPO: no spread, no signal

    opts, cfg = VGPOOptions(adae_k=0.1, adae_steps=2, gamma=0.9), CreditCfg(name="vgpo")
    adv = vgpo_advantages(inp, opts, cfg).advantages
    # by hand, I = (0.2, 0.4, 0.6, 0.8), γ = 0.9: Q = (1.6292, 1.588, 1.32, 0.8), mean Q = 1.3343; z = 0 in a constant
    # group, so Â = ω·k·Q = Q²·0.1/1.3343 on the first K = 2 steps and 0 after
    expected = torch.tensor([[0.198928, 0.188994, 0.0, 0.0]] * 3)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv[:3], expected, atol=2e-6, rtol=0)
    assert torch.equal(adv[:3, 2:], torch.zeros(3, 2))
    assert vgpo_advantages(make_input(inst[:3], group_ids[:3]), opts, cfg).stats["abs_share"] == 1.0


def test_diverse_group_tends_to_omega_z_as_k_to_zero():
    inst, group_ids = constant_and_diverse_batch()
    inp = make_input(inst, group_ids)
    q = discounted_value(inst, 0.9)
    omega_z = timestep_weights(q, EPS) * group_step_zscore(q, group_ids, EPS)
    assert (omega_z[3:] != 0).any()
    errors = []
    for k in (1e-1, 1e-2, 1e-3, 1e-5):
        adv = vgpo_advantages(inp, VGPOOptions(adae_k=k, adae_steps=-1), CreditCfg(name="vgpo")).advantages
        errors.append(float((adv[3:] - omega_z[3:]).abs().max()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 1e-4
    exact = vgpo_advantages(inp, VGPOOptions(adae_k=0.0), CreditCfg(name="vgpo")).advantages
    torch.testing.assert_close(exact, omega_z)


def test_zscore_is_per_step_population():
    # one group, step 0 values [1, 3] (mean 2, std 1) and step 1 values [5, 5] (constant -> exactly 0)
    q = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    z = group_step_zscore(q, torch.tensor([0, 0]), EPS)
    torch.testing.assert_close(z[:, 0], torch.tensor([-1.0, 1.0]) / (1.0 + EPS))
    assert torch.equal(z[:, 1], torch.zeros(2))


def test_non_positive_rewards_give_finite_non_negative_omega():
    gen = torch.Generator().manual_seed(4)
    inst = -2.0 * torch.rand(6, 5, generator=gen)  # all in [-2, 0]
    inst[0] = -2.0  # a trajectory sitting at the minimum: Q = 0 after the shift, ω must be 0, not 0/0
    inp = make_input(inst, torch.tensor([0, 0, 0, 1, 1, 1]))
    opts, cfg = VGPOOptions(), CreditCfg(name="vgpo")
    q, omega, stats = tcrm(inp, opts, cfg.eps)
    assert torch.isfinite(omega).all() and (omega >= 0).all() and (q >= 0).all()
    assert torch.equal(omega[0], torch.zeros(5))
    assert stats["reward_shift"] == pytest.approx(-2.0)
    assert torch.isfinite(vgpo_advantages(inp, opts, cfg).advantages).all()
    shifted, shift = shift_nonnegative(inst, "min")
    assert shift == pytest.approx(-2.0) and float(shifted.min()) == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        vgpo_advantages(inp, VGPOOptions(reward_shift="none"), CreditCfg(name="vgpo"))


def test_one_plus_k_variant():
    inst, group_ids = constant_and_diverse_batch()
    inp = make_input(inst, group_ids)
    k, steps = 0.5, 2
    opts = VGPOOptions(adae_k=k, adae_steps=steps, adae_norm="one_plus_k")
    adv = vgpo_advantages(inp, opts, CreditCfg(name="vgpo")).advantages
    # computed by hand (plain floats, ε = 1e-4): ω·(z + k·Q)/(1 + k) on the first K = 2 steps, plain ω·z after;
    # the constant group (z = 0) gets ω·k·Q/(1 + k) = Q²·0.5/(1.5·1.3343) there and 0 after
    expected = torch.tensor([
        [0.663092, 0.629979, 0.0, 0.0],
        [0.663092, 0.629979, 0.0, 0.0],
        [0.663092, 0.629979, 0.0, 0.0],
        [0.778217, 1.249297, 0.433721, 0.888996],
        [-0.976662, -0.773109, -1.133438, -0.203392],
        [1.645495, 1.055928, 0.954410, 0.0],
    ])
    torch.testing.assert_close(adv, expected, atol=2e-6, rtol=0)


def test_adae_anchor_is_a_pure_composition():
    relative = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    q = torch.rand(3, 4, generator=torch.Generator().manual_seed(6))
    ones = torch.ones(3, 4)
    opts = VGPOOptions(adae_k=0.2, adae_steps=-1)
    torch.testing.assert_close(adae_anchor(relative, q, ones, opts), relative + 0.2 * q)
    torch.testing.assert_close(adae_anchor(relative, q, 2 * ones, VGPOOptions(adae_k=0.0)), 2 * relative)


def test_falls_back_to_step_rewards():
    inst, group_ids = constant_and_diverse_batch()
    rho = torch.cat([torch.zeros(6, 1), inst], dim=1)  # ρ_{j+1} = I_j
    with_inst = vgpo_advantages(make_input(inst, group_ids), VGPOOptions(), CreditCfg(name="vgpo")).advantages
    from_rho = CreditInput(rewards=inst[:, -1].clone(), group_ids=group_ids, step_mask=torch.ones(4, dtype=torch.bool),
                           step_rewards=rho)
    torch.testing.assert_close(vgpo_advantages(from_rho, VGPOOptions(), CreditCfg(name="vgpo")).advantages, with_inst)
