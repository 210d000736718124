"""The shapes-world verifier as an RL reward (issue A.3): dense reward in [0, 1], plus strict / correct."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .base import RewardOutput, to_uint8_hwc


class ShapesReward:
    """Scores images with the rule-based shapes verifier (`flowcredit.shapes.verifier`).

    `scores` is the dense anti-hacking reward by default; components `strict` and `correct` (GenEval parity) are 0/1.
    Option ``score``: which of the three is the training signal: ``dense`` (default), ``strict`` or ``correct``.
    The binary ones are GenEval-style rewards as flow_grpo trains with; they make whole groups score the same (all 0
    or all 1) much more often, which is the regime VGPO's ADAE targets (studies/stagnation.yaml).
    Plain-text prompts (no GenEval metadata) are an error: this reward needs the record of every prompt.
    """

    name = "shapes"
    SCORES = ("dense", "strict", "correct")

    def __init__(self, score: str = "dense", **kwargs: Any):
        if kwargs:
            raise ValueError(f"reward 'shapes' takes only the option 'score' ({'|'.join(self.SCORES)}), got "
                             f"{sorted(kwargs)}")
        if score not in self.SCORES:
            raise ValueError(f"reward.options.score: unknown value '{score}'; use one of {', '.join(self.SCORES)}")
        self.score = score

    def check_prompts(self, metadata: Sequence[dict[str, Any]], source: str) -> None:
        """Before training: every prompt needs its GenEval record (ValueError naming the first line without one)."""
        missing = [i for i, m in enumerate(metadata) if not m or "include" not in m]
        if missing:
            raise ValueError(
                f"reward 'shapes' needs GenEval-schema .jsonl prompts, but line {missing[0] + 1} of {source} has no "
                "metadata; use shapes:train or a .jsonl file"
            )

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        from ..shapes.verifier import verify_batch

        for i, m in enumerate(metadata):
            if not m or "include" not in m:
                raise ValueError(
                    f"reward 'shapes' needs GenEval-schema metadata for every prompt, prompt {i} ('{prompts[i]}') has "
                    "none; use a .jsonl prompt file (e.g. shapes:train) or another reward"
                )
        results = verify_batch(to_uint8_hwc(images).numpy(), list(metadata))
        f = lambda xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731
        dense = f([r.reward for r in results])
        strict = f([float(r.strict) for r in results])
        correct = f([float(r.correct) for r in results])
        scores = {"dense": dense, "strict": strict, "correct": correct}[self.score]
        return RewardOutput(
            scores=scores,
            components={"dense": dense, "strict": strict, "correct": correct},
            info={"reasons": [r.reason for r in results], "results": results},
        )
