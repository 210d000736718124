"""The reward protocol: a batch of images + prompts + metadata → scores (B,) and named sub-scores.

Images are float tensors (B, 3, H, W) in [0, 1] (what `FlowModel.decode` returns). Rewards accept `**meta` so new
metadata never breaks an old reward (TRL's convention, STYLE.md R2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor


@dataclass
class RewardOutput:
    """Scores of one batch.

    Attributes:
        scores: (B,) float32, the scalar the RL objective maximises.
        components: name → (B,) float32 sub-scores (logged separately; e.g. strict / correct for the verifier,
            or each reward of a weighted mix).
        info: free-form per-batch extras (e.g. per-image reason strings).
    """

    scores: Tensor
    components: dict[str, Tensor] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class RewardFn(Protocol):
    """images: (B, 3, H, W) float in [0, 1]; prompts: B strings; metadata: B dicts → RewardOutput."""

    name: str

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any) -> RewardOutput:
        ...


def to_uint8_hwc(images: Tensor) -> Tensor:
    """(B, 3, H, W) float [0, 1] → (B, H, W, 3) uint8 (round to nearest), on CPU."""
    return (images.detach().float().clamp(0, 1) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
