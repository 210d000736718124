"""The one policy forward: the (CFG) velocity used by rollout, intermediate estimates and the loss.

Notation: see ``flowcredit.types`` (B batch, *latent the latent shape without batch).

Keeping a single function for every caller is what guarantees that the trainer's recomputed log-probs use the same
velocity as the rollout (STYLE.md R5.2; flow_grpo writes CFG twice and the two copies can drift).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowcredit.types import Cond, FlowModel, cond_cat, cond_repeat


def cfg_active(uncond: Cond | None, guidance_scale: float) -> bool:
    """True when classifier-free guidance needs the unconditional branch (uncond given and w != 1)."""
    return uncond is not None and float(guidance_scale) != 1.0


def nfe_per_sample(uncond: Cond | None, guidance_scale: float) -> int:
    """Model forward evaluations one :func:`policy_velocity` call costs per sample (2 with CFG, else 1)."""
    return 2 if cfg_active(uncond, guidance_scale) else 1


def policy_velocity(
    model: FlowModel,
    x_t: Tensor,
    t: Tensor | float,
    cond: Cond,
    uncond: Cond | None = None,
    guidance_scale: float = 1.0,
) -> Tensor:
    """Velocity with classifier-free guidance, v = v_u + w·(v_c − v_u) (Flow-GRPO §3.2 "CFG during training").

    With CFG the unconditional and conditional branches run in ONE batched model call on [uncond; cond]; with
    ``guidance_scale == 1`` or ``uncond is None`` the model is called once on ``cond`` only. Gradients flow through
    both branches when enabled by the caller.

    Args:
        model: a FlowModel.
        x_t: (B, *latent) states.
        t: (B,) times, or 0-dim / float (broadcast to every sample).
        cond: Cond with batch B.
        uncond: Cond with batch B or 1 (repeated to B), or None.
        guidance_scale: w; 1 disables CFG.

    Returns:
        (B, *latent) fp32 velocity.
    """
    batch = x_t.shape[0]
    t = torch.as_tensor(t, dtype=torch.float32, device=x_t.device)
    t = t.expand(batch) if t.ndim == 0 else t
    if t.shape != (batch,):
        raise ValueError(f"t must be 0-dim or (B,)=({batch},), got shape {tuple(t.shape)}.")
    if not cfg_active(uncond, guidance_scale):
        v = model.velocity(x_t, t, cond).float()
    else:
        assert uncond is not None  # cfg_active
        if batch > 1 and next(iter(uncond.values())).shape[0] == 1:
            uncond = cond_repeat(uncond, batch)
        v_both = model.velocity(
            torch.cat([x_t, x_t], dim=0), torch.cat([t, t], dim=0), cond_cat([uncond, cond])
        ).float()  # (2B, *latent)
        v_uncond, v_cond = v_both.chunk(2, dim=0)
        v = v_uncond + guidance_scale * (v_cond - v_uncond)
    if v.shape != x_t.shape:
        raise ValueError(f"model.velocity returned shape {tuple(v.shape)}, expected {tuple(x_t.shape)}.")
    return v
