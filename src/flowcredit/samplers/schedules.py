"""Time grids for flow-matching samplers (pure functions).

Notation: see ``flowcredit.types`` (B, G, T, *latent).

Time convention (ALGORITHMS.md §1.1): t = 1 is pure noise, t = 0 is data; t is diffusers' ``sigma``
(the SD3 transformer is called with ``timestep = 1000·t``). A grid runs t_0 = 1 > t_1 > … > t_T = 0.

The SD3 "shift" warps a uniform grid s ∈ [0, 1] towards the noisy end (ALGORITHMS.md §1.4):

    t = shift·s / (1 + (shift − 1)·s)          s = t / (shift − (shift − 1)·t)   (inverse)
"""

from __future__ import annotations

import torch
from torch import Tensor

GRID_KINDS = ("uniform", "diffusers")

# diffusers' FlowMatchEulerDiscreteScheduler default ``num_train_timesteps``; sets its smallest sigma (§1.4).
DIFFUSERS_NUM_TRAIN_TIMESTEPS = 1000


def shift_time(s: Tensor, shift: float) -> Tensor:
    """SD3 time shift t = shift·s / (1 + (shift − 1)·s) (ALGORITHMS.md §1.4).

    Args:
        s: any shape, values in [0, 1]; the dtype is kept (use float64 for round-trip checks).
        shift: shift factor > 0 (1 = identity; SD3.5 uses 3).

    Returns:
        Shifted times, same shape and dtype as ``s``.
    """
    _check_shift(shift)
    return shift * s / (1 + (shift - 1) * s)


def unshift_time(t: Tensor, shift: float) -> Tensor:
    """Inverse of :func:`shift_time`: s = t / (shift − (shift − 1)·t) (derived, ALGORITHMS.md §1.4).

    Args:
        t: any shape, values in [0, 1]; the dtype is kept.
        shift: shift factor > 0.

    Returns:
        Unshifted times, same shape and dtype as ``t``.
    """
    _check_shift(shift)
    return t / (shift - (shift - 1) * t)


def time_grid(
    num_steps: int,
    shift: float = 3.0,
    kind: str = "uniform",
    num_train_timesteps: int = DIFFUSERS_NUM_TRAIN_TIMESTEPS,
) -> Tensor:
    """The sampling grid t_0 = 1 > … > t_T = 0 (exactly 1 and exactly 0 at the ends).

    ``kind="uniform"``: s_j = linspace(1, 0, T+1), t_j = shift_time(s_j).

    ``kind="diffusers"``: reproduces diffusers ``FlowMatchEulerDiscreteScheduler.set_timesteps`` (ALGORITHMS.md
    §1.4): its smallest training sigma is s_min = shift_time(1/num_train_timesteps); then
    s_j = linspace(1, s_min, T), t_j = shift_time(s_j) (the shift is applied a second time, as diffusers does), and
    t_T = 0 is appended. For T=10, shift=3: 1.0000, 0.9601, 0.9133, …, 0.2780, 0.0089, 0.

    Computed in float64 and returned as float32.

    Args:
        num_steps: T ≥ 1, the number of steps (the grid has T+1 points).
        shift: SD3 shift factor > 0.
        kind: "uniform" or "diffusers".
        num_train_timesteps: diffusers' training-grid size (only for ``kind="diffusers"``).

    Returns:
        (T+1,) float32 grid, strictly decreasing from 1 to 0.
    """
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}.")
    if kind == "uniform":
        s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        t = shift_time(s, shift)
        t[0], t[-1] = 1.0, 0.0  # exact ends (already exact analytically; guards rounding)
    elif kind == "diffusers":
        s_min = shift_time(torch.tensor(1.0 / num_train_timesteps, dtype=torch.float64), shift)
        s = torch.linspace(1.0, float(s_min), num_steps, dtype=torch.float64)
        t = torch.cat([shift_time(s, shift), torch.zeros(1, dtype=torch.float64)])
        t[0] = 1.0
    else:
        raise ValueError(f"Unknown time-grid kind {kind!r}; valid kinds are {GRID_KINDS}.")
    return t.to(torch.float32)


def _check_shift(shift: float) -> None:
    if not shift > 0:
        raise ValueError(f"shift must be > 0 (1 = no shift, SD3.5 uses 3.0), got {shift!r}.")


def rollout_grid(sampler_cfg, model, model_name: str) -> torch.Tensor:
    """(T+1,) rollout grid: sampler.grid = model → the model's own scheduler sigmas (`model.time_grid(T)`), else
    `time_grid` at sampler.shift. ValueError (one line) when the model has no scheduler of its own."""
    sc = sampler_cfg
    if sc.grid != "model":
        return time_grid(sc.num_steps, sc.shift, sc.grid)
    own = getattr(model, "time_grid", None)
    if not callable(own):
        raise ValueError(f"sampler.grid=model: model.name={model_name} has no scheduler of its own; "
                         "use sampler.grid=uniform or diffusers with sampler.shift")
    return own(sc.num_steps).float().cpu()
