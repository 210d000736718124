"""Intermediate clean-image estimates x̂0 of rollout states (Stepwise §4.1, ALGORITHMS.md §1.3, A7).

Notation: see ``flowcredit.types`` (B batch, T steps, *latent the latent shape without batch); N is any number of
independent states estimated together.

x̂0(t) of a state x_t is T′ forward-Euler substeps of the deterministic flow ODE from t to 0 on the uniform grid
τ_k = t·(1 − k/T′) (the grid is a best guess [G], A7), with the rollout (old) policy, the same CFG, under no_grad.
T′ = 1 is Tweedie x_t − t·v (§1.2). The first substep reuses the rollout velocity when available, so each state
costs T′ − 1 model calls (×2 with CFG).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowcredit.samplers.policy import nfe_per_sample, policy_velocity
from flowcredit.samplers.sde import expand_like
from flowcredit.types import Cond, FlowModel, Trajectory, cond_index


@dataclass
class EstimateOutput:
    """Intermediate estimates of every state of a batch of trajectories.

    Attributes:
        x0_hat: (B, T+1, *latent) fp32 x̂0 of state x^(j), j = 0..T; x0_hat[:, T] is the final sample itself.
        nfe: model forward evaluations spent, counted per sample (a CFG call on n samples counts 2n).
    """

    x0_hat: Tensor
    nfe: int


def _denoise(
    model: FlowModel,
    x_t: Tensor,
    t: Tensor,
    cond: Cond,
    uncond: Cond | None,
    guidance_scale: float,
    substeps: int,
    v_first: Tensor | None,
) -> tuple[Tensor, int]:
    """:func:`denoise_estimate` that also returns the NFEs spent."""
    if int(substeps) != substeps or substeps < 1:
        raise ValueError(f"substeps (T′) must be a positive integer, got {substeps!r}.")
    y = x_t.float()
    t = torch.as_tensor(t, dtype=torch.float32, device=y.device)
    t = t.expand(y.shape[0]) if t.ndim == 0 else t
    if v_first is not None and v_first.shape != y.shape:
        raise ValueError(f"v_first must have the states' shape {tuple(y.shape)}, got {tuple(v_first.shape)}.")
    nfe = 0
    for k in range(substeps):
        tau = t * (1 - k / substeps)  # (N,) τ_k
        tau_next = t * (1 - (k + 1) / substeps)  # (N,) τ_{k+1}; exactly 0 at k = T′−1
        if k == 0 and v_first is not None:
            v = v_first.float()
        else:
            v = policy_velocity(model, y, tau, cond, uncond, guidance_scale)
            nfe += y.shape[0] * nfe_per_sample(uncond, guidance_scale)
        y = y + expand_like(tau_next - tau, y) * v  # Euler substep, τ_{k+1} − τ_k < 0
    return y, nfe


@torch.no_grad()
def denoise_estimate(
    model: FlowModel,
    x_t: Tensor,
    t: Tensor,
    cond: Cond,
    uncond: Cond | None,
    guidance_scale: float,
    substeps: int,
    v_first: Tensor | None = None,
) -> Tensor:
    """T′-substep ODE estimate x̂0(t) (ALGORITHMS.md §1.3): y_0 = x_t, y_{k+1} = y_k + (τ_{k+1} − τ_k)·v(y_k, τ_k).

    Args:
        model: a FlowModel (the rollout policy).
        x_t: (N, *latent) states.
        t: (N,) their times (or 0-dim, broadcast).
        cond: Cond with batch N.
        uncond: Cond with batch N or 1, or None.
        guidance_scale: CFG scale w (same as the rollout).
        substeps: T′ ≥ 1 (1 = Tweedie x_t − t·v).
        v_first: (N, *latent) optional velocity at (x_t, t) to use for the first substep (saves one call).

    Returns:
        (N, *latent) fp32 x̂0.
    """
    return _denoise(model, x_t, t, cond, uncond, guidance_scale, substeps, v_first)[0]


@torch.no_grad()
def trajectory_estimates(
    model: FlowModel,
    traj: Trajectory,
    cond: Cond,
    uncond: Cond | None,
    guidance_scale: float,
    substeps: int,
    chunk_size: int,
    shared_initial: bool,
    states: Tensor | None = None,
) -> EstimateOutput:
    """x̂0 of every state x^(j), j = 0..T, of every trajectory (Stepwise §4.1 / pseudocode §4.5).

    All (trajectory, state) pairs are independent, so they are flattened and run through the model in chunks of
    ``chunk_size`` states. x̂0 of the final state (t = 0) is the state itself (no call). ``traj.velocities``, when
    present, supply the first substep; they must come from the same model, ``cond``/``uncond`` and guidance.
    With ``shared_initial`` (x_T shared within each group, A17) the j = 0 estimate is computed once per group and
    copied to its members; the shared x_T is checked.
    (Over 80 lines for its arguments and the three cases above, which share one chunked loop.)

    Args:
        model: a FlowModel (the rollout policy).
        traj: Trajectory with latents (B, T+1, *latent), timesteps (T+1,), group_ids (B,), velocities or None.
        cond: Cond with batch B.
        uncond: Cond with batch B or 1, or None.
        guidance_scale: CFG scale w (same as the rollout).
        substeps: T′ ≥ 1.
        chunk_size: max states per model call (≥ 1; a CFG call runs 2·chunk_size rows).
        shared_initial: compute the j = 0 estimate once per group.
        states: (B, T) bool, the states x^(j), j < T, to estimate (the others keep their latents and cost nothing),
            or None: all. With ``shared_initial`` state 0 is estimated for a whole group if any member needs it.

    Returns:
        EstimateOutput with x0_hat (B, T+1, *latent) and nfe.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}.")
    latents = traj.latents.float()
    batch, num_steps = latents.shape[0], latents.shape[1] - 1
    device = latents.device
    uncond_per_row = uncond is not None and next(iter(uncond.values())).shape[0] == batch and batch > 1

    # Flattened (sample, state) pairs to estimate: states j = 0..T−1 (the final state needs no call).
    sample_idx = torch.arange(batch, device=device).repeat(num_steps)  # (B·T,) sample-major within each state
    state_idx = torch.arange(num_steps, device=device).repeat_interleave(batch)  # (B·T,)
    representative = torch.arange(batch, device=device)  # j = 0 source row of each sample
    if shared_initial:
        group_ids = traj.group_ids.to(device)
        _, inverse = torch.unique(group_ids, return_inverse=True)
        first_of_group = torch.full((int(inverse.max()) + 1,), batch, device=device, dtype=torch.long)
        first_of_group = first_of_group.scatter_reduce(0, inverse, torch.arange(batch, device=device), "amin")
        representative = first_of_group[inverse]  # (B,)
        if not torch.equal(latents[:, 0], latents[representative, 0]):
            raise ValueError(
                "shared_initial=True but the initial noise x^(0) differs within a group; build it with "
                "make_initial_noise(..., shared=True) or pass shared_initial=False."
            )
        keep = (state_idx != 0) | (sample_idx == representative[sample_idx])
        sample_idx, state_idx = sample_idx[keep], state_idx[keep]
    if states is not None:
        need = states.to(device=device, dtype=torch.bool)
        if shared_initial:  # the representative stands for its group at j = 0
            need = need.clone()
            any0 = torch.zeros(batch, dtype=torch.long, device=device).scatter_reduce(
                0, representative, need[:, 0].long(), "amax")  # (B,): at each representative, any member's need
            need[:, 0] = any0[representative].bool()
        keep = need[sample_idx, state_idx]
        sample_idx, state_idx = sample_idx[keep], state_idx[keep]

    x0_hat = latents.clone()  # (B, T+1, *latent); column T stays the final sample
    nfe = 0
    for start in range(0, sample_idx.shape[0], chunk_size):
        rows, states = sample_idx[start : start + chunk_size], state_idx[start : start + chunk_size]
        v_first = traj.velocities[rows, states].float() if traj.velocities is not None else None
        chunk_uncond = cond_index(uncond, rows) if uncond is not None and uncond_per_row else uncond
        est, spent = _denoise(
            model,
            latents[rows, states],
            traj.timesteps.to(device)[states],
            cond_index(cond, rows),
            chunk_uncond,
            guidance_scale,
            substeps,
            v_first,
        )
        x0_hat[rows, states] = est
        nfe += spent
    if shared_initial:
        x0_hat[:, 0] = x0_hat[representative, 0]
    return EstimateOutput(x0_hat=x0_hat, nfe=nfe)
