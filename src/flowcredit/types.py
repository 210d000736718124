"""Typed records and protocols shared by every component.

Notation (used in every docstring of the package):
    B        batch size (= number of prompts P × group size G)
    G        group size (samples per prompt)
    T        number of recorded SDE steps of a rollout (states x^(0) … x^(T))
    *latent  the model's latent shape without batch: (C, H, W) for images, (L, D) for packed tokens

Time convention (SD3 / diffusers "sigma"): t = 1 is pure noise, t = 0 is data,
x_t = (1 − t)·x0 + t·x1, and the model predicts v = x1 − x0 (ALGORITHMS.md §1.1).
A rollout walks the grid t_0 = 1 > t_1 > … > t_T = 0; step j maps x^(j) (time t_j) to x^(j+1) (time t_{j+1}).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

# A conditioning record: a dict of tensors, each with the batch on dim 0. The model decides what is inside
# (token embeddings, masks, pooled embeddings, ...). The engine only concatenates, indexes and repeats it.
Cond = dict[str, Tensor]


def to_uint8_hwc(images: Tensor) -> Tensor:
    """Decoded images → 8-bit pixels, the one conversion every reward, grid and verifier uses (Flow-GRPO's ×255).

    Args:
        images: (B, 3, H, W) float in [0, 1] (values outside are clamped), any device and float dtype.

    Returns:
        (B, H, W, 3) uint8 on CPU, each value round(255·clamp(x, 0, 1)) (round half to even).
    """
    return (images.detach().float().clamp(0, 1) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def cond_index(cond: Cond, index: Tensor | slice) -> Cond:
    """Select rows of every tensor of a conditioning record."""
    return {k: v[index] for k, v in cond.items()}


def cond_cat(conds: Sequence[Cond]) -> Cond:
    """Concatenate conditioning records along the batch."""
    keys = conds[0].keys()
    return {k: torch.cat([c[k] for c in conds], dim=0) for k in keys}


def cond_repeat(cond: Cond, n: int) -> Cond:
    """Repeat a batch-1 record n times (used for the empty-prompt embedding of CFG)."""
    return {k: v.expand(n, *v.shape[1:]).contiguous() if v.shape[0] == 1 else v for k, v in cond.items()}


@runtime_checkable
class FlowModel(Protocol):
    """The model protocol every backend implements (tiny built-in model, SD3, FLUX).

    The RL engine only ever calls these four members, so it never special-cases a model.
    """

    latent_shape: tuple[int, ...]

    def encode_prompts(self, prompts: Sequence[str]) -> Cond:
        """Encode B prompts (an empty string "" is the unconditional prompt) into a Cond with batch B."""
        ...

    def velocity(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """Predict v = x1 − x0.

        Args:
            x_t: (B, *latent) noisy latents.
            t: (B,) times in [0, 1] (1 = noise).
            cond: Cond with batch B.

        Returns:
            (B, *latent) velocity, same dtype as the computation inside (the engine upcasts to fp32).
        """
        ...

    def decode(self, x0: Tensor) -> Tensor:
        """Map (B, *latent) clean latents to (B, 3, H, W) images in [0, 1] (float32)."""
        ...

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters the RL optimizer updates (all of them, or only LoRA weights)."""
        ...


@dataclass
class Trajectory:
    """A batch of recorded rollouts.

    Attributes:
        latents: (B, T+1, *latent) fp32 states x^(0) … x^(T); x^(0) is the initial noise, x^(T) the sample.
        log_probs: (B, T) fp32 log π_old(x^(j+1) | x^(j)) under the rollout sampler (reduction as configured);
            0 where the step is deterministic (σ = 0).
        timesteps: (T+1,) fp32 time grid t_0 = 1 > … > t_T = 0.
        step_mask: (T,) bool, True where the step is stochastic and trained (σ > 0 and inside timestep_fraction).
        velocities: (B, T, *latent) fp32 rollout velocities v(x^(j), t_j) with CFG, or None when not kept.
            Kept so intermediate x̂0 estimates can reuse them (Stepwise §4.1, first substep for free).
        group_ids: (B,) int64 prompt-group index; samples with equal id share a prompt.
        prompts: B prompt strings.
        metadata: B metadata dicts (GenEval schema for the shapes world; {} for plain-text prompts).
        rewards: (B,) fp32 terminal rewards, filled after scoring.
        step_rewards: (B, T+1) fp32 rewards ρ_j of intermediate x̂0 estimates (ρ_T = terminal reward),
            filled by the stepwise/VGPO methods, else None.
    """

    latents: Tensor
    log_probs: Tensor
    timesteps: Tensor
    step_mask: Tensor
    group_ids: Tensor
    prompts: list[str]
    metadata: list[dict[str, Any]]
    velocities: Tensor | None = None
    rewards: Tensor | None = None
    step_rewards: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def num_steps(self) -> int:
        return self.latents.shape[1] - 1
