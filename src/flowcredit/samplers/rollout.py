"""Rollouts: sample trajectories with a sampler step and record what training needs.

Notation: see ``flowcredit.types`` (B batch, G group size, T steps, *latent the latent shape without batch).

A rollout walks the grid t_0 = 1 > … > t_T = 0: state x^(j) at t_j, step j maps x^(j) to x^(j+1) with the
Gaussian policy of ``samplers.sde`` (ALGORITHMS.md §1.5). Everything runs under ``torch.no_grad()`` in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from flowcredit.samplers.policy import cfg_active, policy_velocity
from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import SamplerParams, sampler_step
from flowcredit.types import Cond, FlowModel, Trajectory, cond_repeat


def make_initial_noise(
    batch_size: int,
    latent_shape: Sequence[int],
    group_ids: Tensor,
    shared: bool,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Initial states x^(0) ~ N(0, I), optionally shared within each prompt group (A17, §4.1).

    ``shared=True`` (Stepwise/VGPO): every member of a group starts from the same x_T, so the group's j=0
    estimate and reward are identical. ``shared=False`` (Flow-GRPO code default): independent noise per sample.
    Noise is drawn on the generator's device (CPU generator -> reproducible across devices), then moved.

    Args:
        batch_size: B.
        latent_shape: *latent.
        group_ids: (B,) int64 group index per sample.
        shared: share x_T within a group.
        generator: optional torch.Generator.
        device: where to put the result (default: the generator's device, or CPU).

    Returns:
        (B, *latent) fp32 noise.
    """
    group_ids = torch.as_tensor(group_ids)
    if group_ids.shape != (batch_size,):
        raise ValueError(f"group_ids must have shape (B,)=({batch_size},), got {tuple(group_ids.shape)}.")
    draw_device = generator.device if generator is not None else torch.device("cpu")
    device = draw_device if device is None else device
    if not shared:
        noise = torch.randn((batch_size, *latent_shape), generator=generator, device=draw_device)
        return noise.to(device)
    unique_ids, inverse = torch.unique(group_ids.cpu(), return_inverse=True)  # sorted ids; inverse: (B,)
    per_group = torch.randn((len(unique_ids), *latent_shape), generator=generator, device=draw_device)
    return per_group[inverse.to(draw_device)].to(device)


def _cond_device(cond: Cond) -> torch.device:
    return next(iter(cond.values())).device


@torch.no_grad()
def rollout(
    model: FlowModel,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    group_ids: Tensor,
    *,
    timesteps: Tensor,
    sampler: SamplerParams,
    guidance_scale: float,
    generator: torch.Generator | None,
    init_noise: Tensor | None = None,
    keep_velocities: bool = True,
    train_fraction: float = 1.0,
    ode_untrained: bool = False,
    cond: Cond | None = None,
    uncond: Cond | None = None,
    step_noise: Tensor | None = None,
) -> Trajectory:
    """Sample B trajectories and record states, log-probs, velocities and the trainable-step mask.

    (Over 80 lines only for its argument list: the body is one loop over the steps.)

    Step j is trainable (``step_mask[j]``) iff j < int(T·train_fraction) (Flow-GRPO ``timestep_fraction``, §3.2;
    int() truncation as their code) AND its std is > 0 for every sample (a deterministic step has no log-prob, A3).

    Args:
        model: a FlowModel.
        prompts: B prompt strings.
        metadata: B metadata dicts (copied into the Trajectory).
        group_ids: (B,) int64 prompt-group index.
        timesteps: (T+1,) grid from 1 to 0 (see ``schedules.time_grid``).
        sampler: SamplerParams of the rollout policy.
        guidance_scale: CFG scale w (1 disables CFG).
        generator: torch.Generator for the initial noise (when ``init_noise`` is None) and the step noise.
        init_noise: (B, *latent) optional x^(0) (e.g. from :func:`make_initial_noise` with shared=True).
        keep_velocities: store the (B, T, *latent) CFG velocities (reused by ``estimates``).
        train_fraction: fraction of the leading steps that may be trained, in [0, 1].
        ode_untrained: sample the steps j ≥ int(T·train_fraction) with the ODE (no exploration noise where nothing
            is trained).
        cond: optional precomputed Cond with batch B (else ``model.encode_prompts(prompts)``).
        uncond: optional precomputed unconditional Cond with batch B or 1 (else ``encode_prompts([""])`` when CFG).
        step_noise: (B, T, *latent) optional standard-normal noise of every step (then ``generator`` draws none);
            the trainer passes per-group noise so a sample's path does not depend on the process layout.

    Returns:
        Trajectory with latents (B, T+1, *latent), log_probs (B, T), step_mask (T,), velocities (B, T, *latent) or
        None.
    """
    batch = len(prompts)
    if len(metadata) != batch:
        raise ValueError(f"metadata has {len(metadata)} entries for {batch} prompts.")
    if not 0.0 <= train_fraction <= 1.0:
        raise ValueError(f"train_fraction must be in [0, 1], got {train_fraction!r}.")
    timesteps = torch.as_tensor(timesteps, dtype=torch.float32)
    if timesteps.ndim != 1 or timesteps.shape[0] < 2:
        raise ValueError(f"timesteps must be a (T+1,) grid with T >= 1, got shape {tuple(timesteps.shape)}.")
    num_steps = timesteps.shape[0] - 1

    cond = model.encode_prompts(list(prompts)) if cond is None else cond
    if uncond is None and float(guidance_scale) != 1.0:
        uncond = model.encode_prompts([""])
    if uncond is not None and cfg_active(uncond, guidance_scale) and next(iter(uncond.values())).shape[0] == 1:
        uncond = cond_repeat(uncond, batch)
    device = _cond_device(cond)
    timesteps = timesteps.to(device)
    group_ids = torch.as_tensor(group_ids, dtype=torch.int64)

    if init_noise is None:
        init_noise = make_initial_noise(batch, model.latent_shape, group_ids, False, generator, device)
    x = init_noise.to(device=device, dtype=torch.float32)
    if x.shape != (batch, *model.latent_shape):
        raise ValueError(f"init_noise must have shape {(batch, *model.latent_shape)}, got {tuple(x.shape)}.")

    latents, log_probs, stds, kl_stds, velocities = [x], [], [], [], []
    n_train = int(num_steps * train_fraction)
    ode = SamplerParams(name="ode")
    for step in range(num_steps):
        t, t_next = timesteps[step].expand(batch), timesteps[step + 1].expand(batch)
        v = policy_velocity(model, x, t, cond, uncond, guidance_scale)
        noise = None if step_noise is None else step_noise[:, step].to(device)
        # Steps that are never trained explore nothing: with `ode_untrained` they take the ODE step, so no
        # exploration noise is left in the final image (on a uniform grid the last step is large, e.g. t 0.25 → 0,
        # and Flow-GRPO's SDE would add std ≈ 0.2 there; on diffusers' grid that step is tiny, t 0.009 → 0).
        params = ode if (ode_untrained and step >= n_train) else sampler
        out = sampler_step(params, x, v, t, t_next, generator=None if noise is not None else generator, noise=noise)
        x = out.x_next
        latents.append(x)
        log_probs.append(out.log_prob)
        stds.append(out.std)
        kl_stds.append(out.kl_std)
        if keep_velocities:
            velocities.append(v)

    step_std = torch.stack(stds, dim=1)  # (B, T)
    trainable = torch.arange(num_steps, device=device) < int(num_steps * train_fraction)
    step_mask = trainable & (step_std > 0).all(dim=0)  # (T,)
    return Trajectory(
        latents=torch.stack(latents, dim=1),  # (B, T+1, *latent)
        log_probs=torch.stack(log_probs, dim=1),  # (B, T)
        timesteps=timesteps,
        step_mask=step_mask,
        group_ids=group_ids.to(device),
        prompts=list(prompts),
        metadata=list(metadata),
        velocities=torch.stack(velocities, dim=1) if keep_velocities else None,
    )


@torch.no_grad()
def sample_ode(
    model: FlowModel,
    prompts: Sequence[str],
    steps: int | Tensor,
    guidance_scale: float,
    generator: torch.Generator | None = None,
    init_noise: Tensor | None = None,
    shift: float = 3.0,
    grid: str = "uniform",
) -> Tensor:
    """Deterministic ODE sampling for evaluation (Flow-GRPO evaluates with the ODE, 40 steps, §3.2).

    Uses the same ``policy_velocity`` and ``ode_step`` as training rollouts but records nothing.

    Args:
        model: a FlowModel.
        prompts: B prompt strings.
        steps: number of steps T (grid from ``time_grid(T, shift, grid)``), or a (T+1,) grid tensor.
        guidance_scale: CFG scale w.
        generator: torch.Generator for the initial noise when ``init_noise`` is None.
        init_noise: (B, *latent) optional initial noise.
        shift: SD3 shift for the grid (when ``steps`` is an int).
        grid: grid kind for ``time_grid`` (when ``steps`` is an int).

    Returns:
        (B, *latent) fp32 final latents x^(T).
    """
    timesteps = time_grid(steps, shift, grid) if isinstance(steps, int) else torch.as_tensor(steps)
    batch = len(prompts)
    cond = model.encode_prompts(list(prompts))
    uncond = cond_repeat(model.encode_prompts([""]), batch) if float(guidance_scale) != 1.0 else None
    device = _cond_device(cond)
    timesteps = timesteps.to(device=device, dtype=torch.float32)
    if init_noise is None:
        init_noise = make_initial_noise(batch, model.latent_shape, torch.arange(batch), False, generator, device)
    x = init_noise.to(device=device, dtype=torch.float32)
    params = SamplerParams(name="ode")
    for step in range(timesteps.shape[0] - 1):
        t, t_next = timesteps[step].expand(batch), timesteps[step + 1].expand(batch)
        x = sampler_step(params, x, policy_velocity(model, x, t, cond, uncond, guidance_scale), t, t_next).x_next
    return x
