"""Flow-GRPO group advantages (ALGORITHMS.md §3.2): hand-derived numbers, loop reference, edge cases."""

import pytest
import torch

from flowcredit.credit import CreditCfg, CreditInput, assign_credit
from flowcredit.credit.group import FlowGRPOOptions, flow_grpo_advantages, group_relative_rewards, reward_stats

EPS = 1e-4


def loop_reference(rewards, group_ids, std_scope, eps=EPS):
    """Plain per-group Python loop (the obvious implementation), float64."""
    r = rewards.double()
    out = torch.zeros_like(r)
    global_std = r.std(correction=0)
    for gid in group_ids.unique().tolist():
        sel = group_ids == gid
        group = r[sel]
        if bool((group == group[0]).all()):
            continue  # zero-variance group -> exactly 0
        std = global_std if std_scope == "global" else group.std(correction=0)
        out[sel] = (group - group.mean()) / (std + eps)
    return out


def test_hand_built_two_groups():
    # group 0: r = [4, 6]   -> mean 5, deviations [-1, +1], group std 1
    # group 1: r = [-2, 12] -> mean 5, deviations [-7, +7], group std 7
    # batch: mean 5, squared deviations [1, 1, 49, 49] -> variance 100/4 = 25 -> global std 5
    rewards = torch.tensor([4.0, 6.0, -2.0, 12.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    global_adv = group_relative_rewards(rewards, group_ids, std_scope="global", eps=EPS)
    expected_global = torch.tensor([-1.0, 1.0, -7.0, 7.0]) / (5.0 + EPS)  # ≈ [-0.2, 0.2, -1.4, 1.4]
    torch.testing.assert_close(global_adv, expected_global)
    group_adv = group_relative_rewards(rewards, group_ids, std_scope="group", eps=EPS)
    expected_group = torch.tensor([-1 / (1 + EPS), 1 / (1 + EPS), -7 / (7 + EPS), 7 / (7 + EPS)])  # ≈ ±1
    torch.testing.assert_close(group_adv, expected_group)


@pytest.mark.parametrize("std_scope", ["global", "group"])
def test_vectorized_matches_loop(std_scope):
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        group_ids = torch.randint(0, 5, (23,), generator=gen) * 7 + 3  # non-contiguous, unsorted ids
        rewards = torch.randn(23, generator=gen)
        rewards[group_ids == 10] = 0.3  # one constant group (id 1*7+3), if present
        got = group_relative_rewards(rewards, group_ids, std_scope=std_scope, eps=EPS)
        torch.testing.assert_close(got.double(), loop_reference(rewards, group_ids, std_scope), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("std_scope", ["global", "group"])
def test_zero_variance_group_is_exactly_zero(std_scope):
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004 in floats: mean != 0.1 bitwise, yet the advantage must be exactly 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.5])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_relative_rewards(rewards, group_ids, std_scope=std_scope, eps=EPS)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.isfinite(adv).all() and (adv[3:] != 0).any()
    all_equal = group_relative_rewards(torch.full((4,), 2.0), torch.tensor([0, 0, 1, 1]), std_scope=std_scope)
    assert torch.equal(all_equal, torch.zeros(4))  # batch std 0 too: zeros, not NaN
    assert reward_stats(rewards, group_ids)["zero_std_group_ratio"] == 0.5


def test_broadcast_identical_across_steps():
    rewards = torch.tensor([1.0, 2.0, 4.0, 0.0, 3.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1])
    inp = CreditInput(rewards=rewards, group_ids=group_ids, step_mask=torch.ones(4, dtype=torch.bool))
    adv = flow_grpo_advantages(inp, FlowGRPOOptions(), CreditCfg()).advantages
    assert adv.shape == (5, 4)
    assert torch.equal(adv, adv[:, :1].expand(-1, 4))


def test_clip_applied():
    # one group of 30 zeros and a single 1: mean 1/31, the '1' deviates 30/31;
    # variance = (30·(1/31)² + (30/31)²)/31 = 30/961 -> std = sqrt(30)/31 ≈ 0.17668
    # -> A = (30/31) / (0.17668 + 1e-4) ≈ 5.474 > 5, so the clip at ±5 bites on that sample only
    rewards = torch.zeros(31)
    rewards[-1] = 1.0
    group_ids = torch.zeros(31, dtype=torch.long)
    inp = CreditInput(rewards=rewards, group_ids=group_ids, step_mask=torch.ones(2, dtype=torch.bool))
    raw = flow_grpo_advantages(inp, FlowGRPOOptions(std_scope="group"), CreditCfg()).advantages
    assert raw.max() > 5.4
    out = assign_credit(CreditCfg(options={"std_scope": "group"}), inp)
    assert out.advantages.max() == 5.0 and out.advantages.min() >= -5.0
    assert out.stats["adv_clip_frac"] == pytest.approx(1 / 31)
    unclipped = assign_credit(CreditCfg(options={"std_scope": "group"}, adv_clip=None), inp)
    torch.testing.assert_close(unclipped.advantages, raw)
