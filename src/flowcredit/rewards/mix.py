"""Weighted reward mixing (e.g. Stepwise's OCR mix 0.8·ocr + 0.2·pickscore), optionally z-normalizing each
component over the batch first (GDPO-style), with every component logged separately."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .base import RewardOutput


class MixedReward:
    """scores = Σ_k w_k · s_k, where s_k is reward k's score, or its batch z-score when `normalize`."""

    name = "mix"

    def __init__(self, parts: Sequence[tuple[Any, float]], normalize: bool = False, eps: float = 1e-6):
        if not parts:
            raise ValueError("a mixed reward needs at least one component")
        self.parts = list(parts)
        self.normalize = normalize
        self.eps = eps

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any) -> RewardOutput:
        total = torch.zeros(images.shape[0])
        comps: dict[str, Tensor] = {}
        info: dict[str, Any] = {}
        for fn, w in self.parts:
            out = fn(images, prompts, metadata, **meta)
            s = out.scores.float()
            comps[fn.name] = s
            for k, v in out.components.items():
                comps[f"{fn.name}/{k}"] = v
            if "results" in out.info and "results" not in info:
                info["results"] = out.info["results"]
            if self.normalize:
                s = (s - s.mean()) / (s.std(unbiased=False) + self.eps)
            total = total + w * s
        return RewardOutput(total, comps, info)
