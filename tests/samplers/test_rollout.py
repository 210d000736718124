"""Rollout recording, initial noise and the on-policy invariant (ratio = 1)."""

import pytest
import torch

from flowcredit.samplers.policy import policy_velocity
from flowcredit.samplers.rollout import make_initial_noise, rollout, sample_ode
from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import SAMPLERS, SamplerParams, sampler_step
from flowcredit.types import Trajectory

PROMPTS = ["a red cube", "two blue spheres", "a green cone", "a red cube", "three stars"]


def _rollout(model, batch, name, guidance, steps=4, **kw):
    prompts = PROMPTS[:batch]
    return rollout(
        model,
        prompts,
        [{} for _ in prompts],
        torch.arange(batch),
        timesteps=time_grid(steps, 3.0),
        sampler=SamplerParams(name),
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(0),
        **kw,
    )


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("guidance", [1.0, 3.0])
@pytest.mark.parametrize("batch", [1, 5])
def test_on_policy_ratio_is_one(toy_model, name, guidance, batch):
    traj = _rollout(toy_model, batch, name, guidance)
    cond = toy_model.encode_prompts(traj.prompts)
    uncond = toy_model.encode_prompts([""])
    params = SamplerParams(name)
    for step in range(traj.num_steps):
        x_t = traj.latents[:, step]
        t, t_next = traj.timesteps[step], traj.timesteps[step + 1]
        v = policy_velocity(toy_model, x_t, t, cond, uncond, guidance)
        out = sampler_step(params, x_t, v, t, t_next, x_next=traj.latents[:, step + 1])
        ratio = torch.exp(out.log_prob - traj.log_probs[:, step])
        assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-6, rtol=0)
        assert torch.allclose(v, traj.velocities[:, step], atol=1e-6)


def test_on_policy_check_has_teeth(toy_model):
    # Negative control: recomputing with the wrong guidance scale must NOT give ratio 1.
    traj = _rollout(toy_model, 2, "flow_sde", 3.0)
    cond = toy_model.encode_prompts(traj.prompts)
    x_t, t, t_next = traj.latents[:, 1], traj.timesteps[1], traj.timesteps[2]
    v_wrong = policy_velocity(toy_model, x_t, t, cond, None, 1.0)
    out = sampler_step(SamplerParams("flow_sde"), x_t, v_wrong, t, t_next, x_next=traj.latents[:, 2])
    assert (out.log_prob - traj.log_probs[:, 1]).abs().min() > 1e-4  # far above the 1e-6 parity tolerance


def test_trajectory_shapes_and_records(toy_model):
    traj = _rollout(toy_model, 5, "flow_sde", 3.0, steps=4)
    assert isinstance(traj, Trajectory)
    assert traj.latents.shape == (5, 5, 3, 4, 4) and traj.latents.dtype == torch.float32
    assert traj.log_probs.shape == (5, 4) and traj.step_mask.shape == (4,) and traj.step_mask.dtype == torch.bool
    assert traj.velocities.shape == (5, 4, 3, 4, 4)
    assert traj.timesteps.shape == (5,) and traj.group_ids.dtype == torch.int64
    assert torch.isfinite(traj.latents).all() and torch.isfinite(traj.log_probs).all()
    assert not traj.latents.requires_grad
    assert _rollout(toy_model, 2, "cps", 1.0, keep_velocities=False).velocities is None


def test_step_mask_excludes_deterministic_steps_and_respects_fraction(toy_model):
    # cps: std = t_next·sin(aπ/2) is 0 on the last step (t_next = 0) -> not trainable.
    assert _rollout(toy_model, 2, "cps", 1.0).step_mask.tolist() == [True, True, True, False]
    # ddim_sde: step 0 explores thanks to the t = 1 guard; last step σ = η·0 = 0.
    assert _rollout(toy_model, 2, "ddim_sde", 1.0).step_mask.tolist() == [True, True, True, False]
    # flow_sde explores on every step; timestep_fraction 0.99 keeps int(4·0.99) = 3 leading steps.
    assert _rollout(toy_model, 2, "flow_sde", 1.0).step_mask.all()
    assert _rollout(toy_model, 2, "flow_sde", 1.0, train_fraction=0.99).step_mask.tolist() == [True] * 3 + [False]
    assert not _rollout(toy_model, 2, "ode", 1.0).step_mask.any()
    # deterministic steps record log-prob 0
    traj = _rollout(toy_model, 2, "cps", 1.0)
    assert not traj.log_probs[:, -1].any()


def test_init_noise_is_used_and_rollout_is_reproducible(toy_model):
    noise = torch.randn(3, 3, 4, 4)
    traj = _rollout(toy_model, 3, "flow_sde", 2.0, init_noise=noise)
    assert torch.equal(traj.latents[:, 0], noise)
    again = _rollout(toy_model, 3, "flow_sde", 2.0, init_noise=noise)
    assert torch.equal(traj.latents, again.latents)


def test_shared_initial_noise_within_groups():
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    noise = make_initial_noise(8, (3, 4, 4), group_ids, shared=True, generator=torch.Generator().manual_seed(0))
    assert noise.shape == (8, 3, 4, 4)
    for group in range(3):
        members = noise[group_ids == group]
        assert all(torch.equal(members[0], member) for member in members)
    assert not torch.equal(noise[0], noise[3]) and not torch.equal(noise[3], noise[6])
    independent = make_initial_noise(8, (3, 4, 4), group_ids, shared=False, generator=torch.Generator())
    assert not torch.equal(independent[0], independent[1])


def test_sample_ode_matches_ode_rollout(toy_model):
    noise = torch.randn(2, 3, 4, 4)
    final = sample_ode(toy_model, PROMPTS[:2], 4, guidance_scale=3.0, init_noise=noise)
    traj = _rollout(toy_model, 2, "ode", 3.0, init_noise=noise)
    assert torch.allclose(final, traj.latents[:, -1], atol=1e-6)


def test_cfg_is_one_batched_call(toy_model):
    calls = []
    original = toy_model.velocity

    def counting(x_t, t, cond):
        calls.append(x_t.shape[0])
        return original(x_t, t, cond)

    toy_model.velocity = counting
    cond = toy_model.encode_prompts(PROMPTS[:3])
    uncond = toy_model.encode_prompts([""])
    x, t = torch.randn(3, 3, 4, 4), torch.full((3,), 0.5)
    v = policy_velocity(toy_model, x, t, cond, uncond, 4.0)
    assert calls == [6]
    v_u, v_c = original(x, t, {"emb": uncond["emb"].expand(3, -1)}), original(x, t, cond)
    assert torch.allclose(v, v_u + 4.0 * (v_c - v_u), atol=1e-5)
    calls.clear()
    policy_velocity(toy_model, x, t, cond, uncond, 1.0)
    policy_velocity(toy_model, x, t, cond, None, 4.0)
    assert calls == [3, 3]
