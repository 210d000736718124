"""Registry, assign_credit contract over every estimator, anchor composition, config validation."""

import dataclasses

import pytest
import torch

from flowcredit.credit import (
    CreditCfg,
    CreditInput,
    assign_credit,
    names,
    needs_instant_rewards,
    needs_step_rewards,
    resolve,
)
from flowcredit.credit.stepwise import StepwiseOptions
from flowcredit.credit.vgpo import VGPOOptions, adae_step_mask, discounted_value, timestep_weights

B, T = 8, 5  # 2 groups × 4, 5 steps


def random_input(seed=0):
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.tensor([3, 3, 3, 3, 7, 7, 7, 7])
    rho = torch.randn(B, T + 1, generator=gen)
    rho[:, 0] = rho[torch.tensor([0, 0, 0, 0, 4, 4, 4, 4]), 0]  # shared ρ_0 per group
    instant = torch.randn(B, T, generator=gen)  # may be negative: exercises the shift
    step_mask = torch.tensor([True, True, True, True, False])  # last step not trained (timestep_fraction)
    return CreditInput(rewards=rho[:, -1].clone(), group_ids=group_ids, step_mask=step_mask, step_rewards=rho,
                       instant_rewards=instant)


def check_contract(cfg):
    inp = random_input()
    out = assign_credit(cfg, inp)
    adv = out.advantages
    assert adv.shape == (B, T) and adv.dtype == torch.float32
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[:, ~inp.step_mask], torch.zeros(B, int((~inp.step_mask).sum())))
    assert adv.abs().max() <= cfg.adv_clip
    assert (adv != 0).any()
    assert torch.equal(assign_credit(cfg, random_input()).advantages, adv)  # deterministic
    for value in out.stats.values():
        assert isinstance(value, (float, list))


@pytest.mark.parametrize("name", names())
def test_contract_every_registered_name(name):
    check_contract(CreditCfg(name=name))


@pytest.mark.parametrize(
    "overrides",
    [
        {"name": "flow_grpo", "options": {"std_scope": "group"}},
        {"name": "flow_grpo", "anchor": "adae"},
        {"name": "stepwise", "options": {"norm": "per_step"}},
        {"name": "stepwise", "options": {"norm": "global"}},
        {"name": "stepwise", "options": {"baseline": "ema"}},
        {"name": "stepwise", "options": {"use_gae": True}},
        {"name": "stepwise", "anchor": "adae"},
        {"name": "stepwise", "mask_stats": False},
        {"name": "vgpo", "options": {"adae_norm": "one_plus_k", "adae_steps": -1}},
        {"name": "vgpo", "options": {"weights": False}},
        {"name": "flowcredit.credit.stepwise:stepwise_advantages"},
    ],
)
def test_contract_variants(overrides):
    check_contract(CreditCfg(**overrides))


def test_unknown_name_lists_valid_names_and_suggests():
    with pytest.raises(ValueError) as err:
        resolve("stepwize")
    message = str(err.value)
    assert all(name in message for name in names())
    assert "did you mean 'stepwise'?" in message
    with pytest.raises(ValueError, match="not a registered credit method; use one of flow_grpo"):
        assign_credit(CreditCfg(name="grpo_flow"), random_input())


def test_dotted_path():
    assert resolve("flowcredit.credit.group:flow_grpo_advantages") is resolve("flow_grpo")
    with pytest.raises(AttributeError, match="no credit estimator"):
        resolve("flowcredit.credit.group:nope")


def test_needs_intermediate_rewards():
    flow = CreditCfg(name="flow_grpo")
    assert not needs_step_rewards(flow) and not needs_instant_rewards(flow)
    assert needs_step_rewards(CreditCfg(name="stepwise")) and not needs_instant_rewards(CreditCfg(name="stepwise"))
    assert needs_instant_rewards(CreditCfg(name="vgpo")) and not needs_step_rewards(CreditCfg(name="vgpo"))
    assert needs_instant_rewards(CreditCfg(name="stepwise", anchor="adae"))
    assert needs_instant_rewards(CreditCfg(name="flow_grpo", anchor="adae"))


@pytest.mark.parametrize("weights", [False, True])
def test_stepwise_plus_adae_differs_only_by_anchor(weights):
    inp = random_input()
    common = {"name": "stepwise", "adv_clip": None}
    plain = assign_credit(CreditCfg(**common), inp).advantages
    anchor_options = {"adae_k": 0.1, "adae_steps": 2, "weights": weights}
    composed_out = assign_credit(CreditCfg(**common, anchor="adae", anchor_options=anchor_options), inp)
    composed = composed_out.advantages
    # Q and ω from the (shifted) instant rewards, anchor k·Q on steps 0, 1 only; masked step 4 stays 0
    inst = inp.instant_rewards - inp.instant_rewards.min()
    q = discounted_value(inst, 0.9)
    omega = timestep_weights(q, 1e-4) if weights else torch.ones_like(q)
    anchor = 0.1 * q * adae_step_mask(T, 2).float() * inp.step_mask.float()
    if not weights:
        torch.testing.assert_close(composed - plain, anchor)  # ω = 1: exactly the added absolute term
    else:
        torch.testing.assert_close(composed, omega * (plain + anchor) * inp.step_mask.float())
    assert 0.0 < composed_out.stats["abs_share"] < 1.0
    assert "gain_abs_mean_per_step" in composed_out.stats  # the relative estimator's stats are kept


def test_config_validation_and_help():
    for f in dataclasses.fields(CreditCfg):
        assert f.metadata.get("help"), f"CreditCfg.{f.name} has no help string"
    with pytest.raises(ValueError, match="credit.options.norm = 'joined' must be one of"):
        StepwiseOptions(norm="joined")
    with pytest.raises(ValueError, match="'credit.options.norm' must be one of"):  # checked when credit is assigned
        assign_credit(CreditCfg(name="stepwise", options={"norm": "joined"}), random_input())
    with pytest.raises(ValueError, match="unknown key 'credit.options.std_scope'.*credit method 'stepwise'"):
        assign_credit(CreditCfg(name="stepwise", options={"std_scope": "group"}), random_input())
    with pytest.raises(ValueError, match="already applies the ADAE anchor"):
        CreditCfg(name="vgpo", anchor="adae")
    with pytest.raises(ValueError, match=r"credit.options.gamma = 1.5 must be in \[0, 1\]"):
        VGPOOptions(gamma=1.5)
    with pytest.raises(ValueError, match="credit.adv_clip = 0"):
        CreditCfg(adv_clip=0.0)
    late = CreditCfg(anchor="adae")
    late.name = "vgpo"  # set after construction (as a method preset does): assign_credit re-validates
    with pytest.raises(ValueError, match="already applies the ADAE anchor"):
        assign_credit(late, random_input())


def test_input_checks():
    inp = random_input()
    bad_shape = dataclasses.replace(inp, step_rewards=inp.step_rewards[:, :-1])
    with pytest.raises(ValueError, match=r"step_rewards must have shape \(8, 6\)"):
        assign_credit(CreditCfg(name="stepwise"), bad_shape)
    nan_rewards = inp.rewards.clone()
    nan_rewards[0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        assign_credit(CreditCfg(), dataclasses.replace(inp, rewards=nan_rewards))
    no_intermediate = dataclasses.replace(inp, step_rewards=None, instant_rewards=None)
    with pytest.raises(ValueError, match="instant_rewards"):
        assign_credit(CreditCfg(name="vgpo"), no_intermediate)
