"""A cheap image-statistics reward (no model): brightness, contrast, saturation, colorfulness.

Useful as a second term in tests and smoke runs, and as a hacking probe (e.g. the OCR reward that blanks the
background shows up as a brightness/contrast drift). All statistics are in [0, 1] for images in [0, 1]:
- brightness: mean luma (Rec. 601 weights 0.299, 0.587, 0.114);
- contrast: std of luma, ×2 (a 50/50 black-white image gives 1);
- saturation: mean over pixels of max(r,g,b) − min(r,g,b);
- colorfulness: Hasler & Süsstrunk (2003) M = σ_rgyb + 0.3·μ_rgyb on the [0, 1] scale, /1.5 and clipped to 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .base import Reward, RewardOutput, check_inputs

STATS = ("brightness", "contrast", "saturation", "colorfulness")


def image_stats(images: Tensor) -> dict[str, Tensor]:
    """(B, 3, H, W) float [0, 1] → dict of (B,) float32 statistics (see the module docstring)."""
    x = images.detach().float().clamp(0, 1)
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    luma = 0.299 * r + 0.587 * g + 0.114 * b
    rg, yb = r - g, 0.5 * (r + g) - b
    sigma = (rg.flatten(1).var(1, unbiased=False) + yb.flatten(1).var(1, unbiased=False)).sqrt()
    mu = (rg.flatten(1).mean(1) ** 2 + yb.flatten(1).mean(1) ** 2).sqrt()
    return {
        "brightness": luma.flatten(1).mean(1),
        "contrast": (2 * luma.flatten(1).std(1, unbiased=False)).clamp(max=1),
        "saturation": (x.amax(1) - x.amin(1)).flatten(1).mean(1),
        "colorfulness": ((sigma + 0.3 * mu) / 1.5).clamp(max=1),
    }


class ImageStatsReward(Reward):
    """score = stat, or 1 − |stat − target| when `target` is given (stat ∈ STATS). Components: all four stats."""

    name = "imagestats"

    def __init__(self, stat: str = "contrast", target: float | None = None):
        if stat not in STATS:
            raise ValueError(f"reward 'imagestats': stat must be one of {STATS}, got {stat!r}")
        self.stat, self.target = stat, target

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        check_inputs(self.name, images, prompts, metadata)
        st = image_stats(images)
        s = st[self.stat]
        if self.target is not None:
            s = 1.0 - (s - float(self.target)).abs()
        return RewardOutput(s.clone(), st)
