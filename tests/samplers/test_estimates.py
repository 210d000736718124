"""Intermediate x̂0 estimates (Stepwise §4.1, ALGORITHMS.md §1.3, A7)."""

import pytest
import torch

from flowcredit.samplers.estimates import denoise_estimate, trajectory_estimates
from flowcredit.samplers.policy import policy_velocity
from flowcredit.samplers.rollout import make_initial_noise, rollout
from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import SamplerParams

PROMPTS = ["a red cube", "a red cube", "two blue spheres", "two blue spheres"]
GROUPS = torch.tensor([0, 0, 1, 1])


def _conds(model, prompts):
    return model.encode_prompts(prompts), model.encode_prompts([""])


def _traj(model, guidance, shared=True, keep_velocities=True, steps=3):
    noise = make_initial_noise(4, model.latent_shape, GROUPS, shared, torch.Generator().manual_seed(1))
    return rollout(
        model,
        PROMPTS,
        [{}] * 4,
        GROUPS,
        timesteps=time_grid(steps, 3.0),
        sampler=SamplerParams("flow_sde"),
        guidance_scale=guidance,
        generator=torch.Generator().manual_seed(0),
        init_noise=noise,
        keep_velocities=keep_velocities,
    )


def test_one_substep_is_tweedie(toy_model):
    cond, uncond = _conds(toy_model, PROMPTS)
    x, t = torch.randn(4, 3, 4, 4), torch.tensor([1.0, 0.7, 0.4, 0.1])
    v = policy_velocity(toy_model, x, t, cond, uncond, 2.5)
    est = denoise_estimate(toy_model, x, t, cond, uncond, 2.5, substeps=1)
    assert torch.allclose(est, x - t[:, None, None, None] * v, atol=1e-6)


def test_three_substeps_equal_hand_written_euler(toy_model):
    cond, uncond = _conds(toy_model, PROMPTS)
    x, t = torch.randn(4, 3, 4, 4), torch.tensor([1.0, 0.7, 0.4, 0.1])
    y = x.clone()
    for k in range(3):  # τ_k = t·(1 − k/3)
        tau, tau_next = t * (1 - k / 3), t * (1 - (k + 1) / 3)
        y = y + (tau_next - tau)[:, None, None, None] * policy_velocity(toy_model, y, tau, cond, uncond, 2.5)
    assert torch.allclose(denoise_estimate(toy_model, x, t, cond, uncond, 2.5, substeps=3), y, atol=1e-6)
    # Reusing the true first velocity changes nothing; a different v_first changes only the first substep.
    v0 = policy_velocity(toy_model, x, t, cond, uncond, 2.5)
    assert torch.allclose(denoise_estimate(toy_model, x, t, cond, uncond, 2.5, 3, v_first=v0), y, atol=1e-6)
    fake = torch.zeros_like(x)
    y_fake = x.clone()
    for k in range(3):
        tau, tau_next = t * (1 - k / 3), t * (1 - (k + 1) / 3)
        v = fake if k == 0 else policy_velocity(toy_model, y_fake, tau, cond, uncond, 2.5)
        y_fake = y_fake + (tau_next - tau)[:, None, None, None] * v
    est_fake = denoise_estimate(toy_model, x, t, cond, uncond, 2.5, 3, v_first=fake)
    assert torch.allclose(est_fake, y_fake, atol=1e-6)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
@pytest.mark.parametrize("keep_velocities", [True, False])
def test_batched_equals_one_at_a_time(toy_model, guidance, keep_velocities):
    traj = _traj(toy_model, guidance, shared=False, keep_velocities=keep_velocities)
    cond, uncond = _conds(toy_model, PROMPTS)
    out = trajectory_estimates(toy_model, traj, cond, uncond, guidance, substeps=2, chunk_size=5, shared_initial=False)
    assert out.x0_hat.shape == traj.latents.shape
    for b in range(4):
        for j in range(traj.num_steps):
            v_first = traj.velocities[b : b + 1, j] if keep_velocities else None
            cond_b = {key: value[b : b + 1] for key, value in cond.items()}
            x_b, t_j = traj.latents[b : b + 1, j], traj.timesteps[j : j + 1]
            one = denoise_estimate(toy_model, x_b, t_j, cond_b, uncond, guidance, 2, v_first=v_first)
            assert torch.allclose(out.x0_hat[b, j], one[0], atol=1e-5)
    # the final state (t = 0) is its own estimate
    assert torch.equal(out.x0_hat[:, -1], traj.latents[:, -1])


def test_shared_initial_and_nfe_count(toy_model):
    traj = _traj(toy_model, 3.0, shared=True)
    cond, uncond = _conds(toy_model, PROMPTS)
    rows = []
    original = toy_model.velocity

    def counting(x_t, t, c):
        rows.append(x_t.shape[0])
        return original(x_t, t, c)

    toy_model.velocity = counting
    shared = trajectory_estimates(toy_model, traj, cond, uncond, 3.0, substeps=2, chunk_size=3, shared_initial=True)
    # States to estimate: j = 0 once per group (2) + j = 1, 2 for 4 samples (8) = 10. With velocities reused,
    # T′ = 2 costs 1 call per state, ×2 for CFG -> 20 NFEs, exactly the rows the model saw.
    assert shared.nfe == 20 == sum(rows)
    assert torch.equal(shared.x0_hat[0, 0], shared.x0_hat[1, 0])
    assert torch.equal(shared.x0_hat[2, 0], shared.x0_hat[3, 0])
    rows.clear()
    full = trajectory_estimates(toy_model, traj, cond, uncond, 3.0, substeps=2, chunk_size=3, shared_initial=False)
    assert full.nfe == 24 == sum(rows)  # 12 states × 1 call × 2
    assert torch.allclose(full.x0_hat, shared.x0_hat, atol=1e-5)
    # Without stored velocities every substep calls the model; without CFG each call counts once.
    traj.velocities = None
    rows.clear()
    assert trajectory_estimates(toy_model, traj, cond, None, 1.0, 2, 100, shared_initial=True).nfe == 20 == sum(rows)


def test_shared_initial_requires_shared_noise(toy_model):
    traj = _traj(toy_model, 1.0, shared=False)
    cond, uncond = _conds(toy_model, PROMPTS)
    with pytest.raises(ValueError, match="shared=True"):
        trajectory_estimates(toy_model, traj, cond, uncond, 1.0, 2, 4, shared_initial=True)


def test_only_the_requested_states_are_estimated(toy_model):
    """states (B, T) bool (stepwise states=drawn): the requested states equal the full estimate, the others cost
    nothing; with a shared x_T a group's state 0 is estimated once if any member asks for it."""
    traj = _traj(toy_model, 3.0, shared=True)
    cond, uncond = _conds(toy_model, PROMPTS)
    full = trajectory_estimates(toy_model, traj, cond, uncond, 3.0, substeps=2, chunk_size=3, shared_initial=True)
    states = torch.tensor([[False, True, False], [True, False, False], [False, False, True], [False, False, False]])
    part = trajectory_estimates(toy_model, traj, cond, uncond, 3.0, 2, 3, shared_initial=True, states=states)
    # by hand: group 0 needs state 0 (row 1) → 1 state-0 estimate; plus (0, 1) and (2, 2) → 3 states × 1 call × 2
    assert part.nfe == 6
    for b, j in [(0, 1), (1, 0), (2, 2)]:
        torch.testing.assert_close(part.x0_hat[b, j], full.x0_hat[b, j])
    torch.testing.assert_close(part.x0_hat[0, 0], full.x0_hat[0, 0])  # row 0 shares its group's state 0
