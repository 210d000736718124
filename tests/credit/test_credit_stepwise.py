"""Stepwise-Flow-GRPO gains and normalizations (ALGORITHMS.md §4.2–4.6), hand-derived numbers in comments."""

import math

import pytest
import torch

from flowcredit.credit import CreditCfg, CreditInput, assign_credit
from flowcredit.credit.stepwise import (
    EMA_STATE_KEY,
    StepwiseOptions,
    ema_baseline_update,
    gae_over_gains,
    normalize_gains,
    stepwise_advantages,
    stepwise_gains,
)

EPS = 1e-4

# One group, N = 2 trajectories, T = 3 steps, shared ρ_0 = 0:
#   traj 0: ρ = [0, 1, 1, 4] -> gains g = [1,  0, 3]
#   traj 1: ρ = [0, 2, 0, 2] -> gains g = [2, -2, 2]
RHO = torch.tensor([[0.0, 1.0, 1.0, 4.0], [0.0, 2.0, 0.0, 2.0]])
GAINS = torch.tensor([[1.0, 0.0, 3.0], [2.0, -2.0, 2.0]])


def make_input(rho, group_ids, step_mask=None):
    t = rho.shape[1] - 1
    mask = torch.ones(t, dtype=torch.bool) if step_mask is None else step_mask
    return CreditInput(rewards=rho[:, -1].clone(), group_ids=group_ids, step_mask=mask, step_rewards=rho)


def test_gains_hand_example():
    torch.testing.assert_close(stepwise_gains(RHO), GAINS)


def test_gains_telescope_float64():
    gen = torch.Generator().manual_seed(1)
    rho = torch.randn(16, 11, generator=gen, dtype=torch.float64)
    gains = stepwise_gains(rho)
    torch.testing.assert_close(gains.sum(1), rho[:, -1] - rho[:, 0], rtol=0, atol=1e-12)


def test_shared_rho0_group_relative_sum_equals_group_relative_final_reward():
    gen = torch.Generator().manual_seed(2)
    group_ids = torch.arange(3).repeat_interleave(4)  # 3 groups × 4
    rho = torch.rand(12, 6, generator=gen, dtype=torch.float64)
    rho[:, 0] = rho[group_ids * 4, 0]  # ρ_0 shared within each group (shared initial noise, §4.1)
    gain_sum = stepwise_gains(rho).sum(1)
    final = rho[:, -1]
    for gid in range(3):
        sel = group_ids == gid
        relative_gain_sum = gain_sum[sel] - gain_sum[sel].mean()
        torch.testing.assert_close(relative_gain_sum, final[sel] - final[sel].mean(), rtol=0, atol=1e-12)


def test_joint_normalization_hand_example():
    # joint: the 6 gains [1, 0, 3, 2, -2, 2] have mean 6/6 = 1;
    # deviations [[0, -1, 2], [1, -3, 1]], squares sum 0+1+4+1+9+1 = 16 -> variance 16/6 = 8/3, std ≈ 1.63299
    expected = torch.tensor([[0.0, -1.0, 2.0], [1.0, -3.0, 1.0]]) / (math.sqrt(8 / 3) + EPS)
    got = normalize_gains(GAINS, torch.tensor([0, 0]), scope="joint", eps=EPS)
    torch.testing.assert_close(got, expected)
    # the estimator (default cfg: joint) gives the same numbers
    out = stepwise_advantages(make_input(RHO, torch.tensor([0, 0])), StepwiseOptions(), CreditCfg(name="stepwise"))
    torch.testing.assert_close(out.advantages, expected)


def test_per_step_normalization_hand_example():
    # step 0: [1, 2]  mean 1.5, std 0.5 -> [-0.5, +0.5] / 0.5001 ≈ [-1, 1]
    # step 1: [0, -2] mean -1,  std 1   -> [+1, -1]     / 1.0001 ≈ [1, -1]
    # step 2: [3, 2]  mean 2.5, std 0.5 -> [+0.5, -0.5] / 0.5001 ≈ [1, -1]
    # (joint gave step 2 of traj 0 2/1.633 ≈ 1.22: per-step erases the larger magnitude of big-gain steps, §4.3)
    s0, s1 = 0.5 / (0.5 + EPS), 1.0 / (1.0 + EPS)
    expected = torch.tensor([[-s0, s1, s0], [s0, -s1, -s0]])
    got = normalize_gains(GAINS, torch.tensor([0, 0]), scope="per_step", eps=EPS)
    torch.testing.assert_close(got, expected)


def test_per_step_mean_normalization_hand_example():
    # centre per step with the per-step means [1.5, -1, 2.5]: c = [[-0.5, 1, 0.5], [0.5, -1, -0.5]];
    # one std per group over the 6 centred values (mean 0): variance (0.25 + 1 + 0.25)·2 / 6 = 0.5
    c = torch.tensor([[-0.5, 1.0, 0.5], [0.5, -1.0, -0.5]])
    expected = c / (math.sqrt(0.5) + EPS)
    got = normalize_gains(GAINS, torch.tensor([0, 0]), scope="per_step_mean", eps=EPS)
    torch.testing.assert_close(got, expected)
    # per_step would give step 1 and step 0 the same size (±1); here step 1 (spread 2) is twice step 0 (spread 1)
    torch.testing.assert_close(got[:, 1].abs(), 2 * got[:, 0].abs())


def test_per_step_mean_reward_to_go_sums_to_zero_per_step_and_starts_at_the_group_relative_reward():
    # reward-to-go ρ_T − ρ_j (GAE with γ = λ = 1) centred per group and step: no (group, step) pulls or pushes on
    # net, and with ρ_0 shared in a group step 0 carries the group-relative final reward r − mean_g r
    gen = torch.Generator().manual_seed(4)
    group_ids = torch.arange(3).repeat_interleave(4)
    rho = torch.rand(12, 6, generator=gen, dtype=torch.float64)
    rho[:, 0] = rho[group_ids * 4, 0]
    opts = StepwiseOptions(norm="per_step_mean", use_gae=True, gae_gamma=1.0, gae_lambda=1.0)
    adv = stepwise_advantages(make_input(rho, group_ids), opts, CreditCfg(name="stepwise")).advantages
    for gid in range(3):
        sel = group_ids == gid
        torch.testing.assert_close(adv[sel].sum(0), torch.zeros(5, dtype=torch.float64), rtol=0, atol=1e-12)
        r = rho[sel, -1]
        rel = (r - r.mean()) / (r - r.mean()).norm()
        torch.testing.assert_close(adv[sel, 0] / adv[sel, 0].norm(), rel, rtol=0, atol=1e-9)


def test_groups_are_independent_and_global_std():
    # group 1 has doubled gains: [[2, 0, 6], [4, -4, 4]]; joint per group gives (up to ε) the same advantages.
    # global: per-group joint means 1 and 2; the std is over all 12 gains of the batch:
    #   gains [1,0,3,2,-2,2, 2,0,6,4,-4,4], mean 18/12 = 1.5, squared deviations sum to 83 -> std = sqrt(83/12)
    gains = torch.cat([GAINS, 2 * GAINS])
    group_ids = torch.tensor([5, 5, 9, 9])
    joint = normalize_gains(gains, group_ids, scope="joint", eps=1e-12)
    torch.testing.assert_close(joint[:2], joint[2:])
    dev = torch.tensor([[0.0, -1.0, 2.0], [1.0, -3.0, 1.0]])
    expected_global = torch.cat([dev, 2 * dev]) / (math.sqrt(83 / 12) + EPS)
    torch.testing.assert_close(normalize_gains(gains, group_ids, scope="global", eps=EPS), expected_global)


def test_step_mask_excludes_columns_from_statistics():
    mask = torch.tensor([True, True, False])
    got = normalize_gains(GAINS, torch.tensor([0, 0]), scope="joint", eps=EPS, step_mask=mask)
    # statistics from steps 0 and 1 only: [1, 0, 2, -2] -> mean 0.25, variance 8.75/4 = 2.1875
    expected = (GAINS - 0.25) / (math.sqrt(2.1875) + EPS)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("scope", ["joint", "per_step", "global", "per_step_mean"])
def test_zero_variance_groups_give_zeros(scope):
    # group 0: every trajectory has gains [0.25, 0.25, 0.25] (constant group, and constant per step; values exact in
    # binary — with ρ = [0, .1, .2, .3] the float gains differ in the last bit and the group is not constant)
    # group 1: diverse
    constant = [[0.0, 0.25, 0.5, 0.75]] * 3
    diverse = [[0.0, 0.5, 0.2, 0.9], [0.0, -0.3, 0.4, 0.1], [0.0, 0.2, 0.2, 0.7]]
    rho = torch.tensor(constant + diverse)
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = normalize_gains(stepwise_gains(rho), group_ids, scope=scope, eps=EPS)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:3], torch.zeros(3, 3))
    assert (adv[3:] != 0).any()
    # with an EMA baseline a constant group still gets 0 (no scale to normalize by), not (g - b)/ε
    with_b = normalize_gains(stepwise_gains(rho), group_ids, scope=scope, eps=EPS, baseline=torch.full((3,), -1.0))
    assert torch.equal(with_b[:3], torch.zeros(3, 3))


def test_per_step_zero_variance_step():
    # step 1 has gain -1 for both trajectories -> that column is exactly 0 under per_step
    rho = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, 3.0, 2.0, 2.5]])
    adv = normalize_gains(stepwise_gains(rho), torch.tensor([0, 0]), scope="per_step", eps=EPS)
    assert torch.equal(adv[:, 1], torch.zeros(2))


def test_gae_gamma_lambda_one_is_reward_to_go():
    gen = torch.Generator().manual_seed(3)
    rho = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    gae = gae_over_gains(stepwise_gains(rho), 1.0, 1.0)
    torch.testing.assert_close(gae, rho[:, -1:] - rho[:, :-1], rtol=0, atol=1e-12)  # ρ_T − ρ_j
    torch.testing.assert_close(gae_over_gains(stepwise_gains(rho), 0.5, 0.0), stepwise_gains(rho))  # γλ = 0 -> g
    # γλ = 0.5 on g = [1, 2, 4]: A_2 = 4, A_1 = 2 + 0.5·4 = 4, A_0 = 1 + 0.5·4 = 3
    got = gae_over_gains(torch.tensor([[1.0, 2.0, 4.0]]), 0.5, 1.0)
    torch.testing.assert_close(got, torch.tensor([[3.0, 4.0, 4.0]]))


def test_ema_baseline_update():
    m = torch.tensor([3.0, 0.0])
    torch.testing.assert_close(ema_baseline_update(None, m, 0.9), m)  # first call: the batch means
    # 0.9·[1, 2] + 0.1·[3, 0] = [1.2, 1.8]
    torch.testing.assert_close(ema_baseline_update(torch.tensor([1.0, 2.0]), m, 0.9), torch.tensor([1.2, 1.8]))


def test_stepwise_ema_variant_and_state_roundtrip():
    cfg = CreditCfg(name="stepwise", options={"baseline": "ema", "ema_decay": 0.9}, adv_clip=None)
    inp = make_input(RHO, torch.tensor([0, 0]))
    std = math.sqrt(8 / 3) + EPS  # the joint std of the hand example (unchanged by the baseline)
    # iteration 1: no baseline yet -> b = batch mean of the gains per step = [1.5, -1, 2.5]
    inp.state = {}
    out = assign_credit(cfg, inp)
    torch.testing.assert_close(out.state[EMA_STATE_KEY], torch.tensor([1.5, -1.0, 2.5]))
    torch.testing.assert_close(out.advantages, (GAINS - torch.tensor([1.5, -1.0, 2.5])) / std)
    # iteration 2 from a restored checkpoint holding b = 0: b ← 0.9·0 + 0.1·[1.5, -1, 2.5] = [0.15, -0.1, 0.25]
    inp.state = {EMA_STATE_KEY: torch.zeros(3)}
    out = assign_credit(cfg, inp)
    b = torch.tensor([0.15, -0.1, 0.25])
    torch.testing.assert_close(out.state[EMA_STATE_KEY], b)
    torch.testing.assert_close(out.advantages, (GAINS - b) / std)


def test_stats():
    out = stepwise_advantages(make_input(RHO, torch.tensor([0, 0])), StepwiseOptions(), CreditCfg(name="stepwise"))
    assert out.stats["gain_abs_mean_per_step"] == pytest.approx([1.5, 1.0, 2.5])  # mean |g| per step
    assert out.stats["rho_nonmonotone_frac"] == 0.5  # traj 0 only rises, traj 1 dips 2 → 0
    assert out.stats["gain_telescope_err"] < 1e-6
    assert out.stats["rho0_group_spread"] == 0.0


def test_a_dip_counts_only_beyond_the_threshold():
    rho = torch.tensor([[0.0, 0.5, 0.4, 0.6], [0.0, 0.5, 0.2, 0.6], [0.8, 0.6, 0.5, 0.4], [0.1, 0.2, 0.3, 0.4]])
    gids = torch.tensor([0, 0, 1, 1])
    # drops below the running max: 0.1 (traj 0), 0.3 (traj 1), 0.4 (traj 2, only falling), none (traj 3)
    for dip, frac in ((0.0, 0.75), (0.2, 0.5), (0.35, 0.25), (0.45, 0.0)):
        out = stepwise_advantages(make_input(rho, gids), StepwiseOptions(dip_threshold=dip), CreditCfg(name="stepwise"))
        assert out.stats["rho_nonmonotone_frac"] == frac, dip


def test_missing_step_rewards_error():
    mask = torch.ones(3, dtype=torch.bool)
    inp = CreditInput(rewards=torch.zeros(2), group_ids=torch.tensor([0, 0]), step_mask=mask)
    with pytest.raises(ValueError, match="step_rewards"):
        assign_credit(CreditCfg(name="stepwise"), inp)


def test_drawn_states_normalize_over_the_drawn_gains_only():
    # states=drawn: row 0 drew steps {0, 2}, row 1 drew {1, 2}; gains (ρ from RHO above) of the drawn pairs:
    # row 0: g0 = 1, g2 = 3; row 1: g1 = -2, g2 = 2. Joint normalization over these four: mean 1, deviations
    # [0, 2, -3, 1], squares 0 + 4 + 9 + 1 = 14, variance 3.5, std 1.870829; every other pair gets 0 (row 0's g1
    # has both states known through its neighbours, but was not drawn).
    gain_mask = torch.tensor([[True, False, True], [False, True, True]])
    rho = RHO.clone()
    rho[1, 0] = 0.0  # not estimated: its value is never read
    inp = CreditInput(rewards=rho[:, -1].clone(), group_ids=torch.tensor([0, 0]),
                      step_mask=torch.ones(3, dtype=torch.bool), step_rewards=rho, gain_mask=gain_mask)
    out = stepwise_advantages(inp, StepwiseOptions(states="drawn"), CreditCfg(name="stepwise"))
    s = 1.870829 + EPS
    expected = torch.tensor([[0.0, 0.0, 2 / s], [0.0, -3 / s, 1 / s]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=0)
    assert out.stats["drawn_gains"] == 4


def test_drawn_states_refuse_gae_and_the_ema_baseline():
    with pytest.raises(ValueError, match="states=drawn"):
        StepwiseOptions(states="drawn", use_gae=True)
    with pytest.raises(ValueError, match="states=drawn"):
        StepwiseOptions(states="drawn", baseline="ema")
