"""The reward protocol: a batch of images + prompts + metadata → scores (B,) and named sub-scores.

Images are float tensors (B, 3, H, W) in [0, 1] (what `FlowModel.decode` returns). Rewards accept `**meta` so new
metadata never breaks an old reward (TRL's convention, STYLE.md R2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ..types import to_uint8_hwc as to_uint8_hwc  # re-exported: rewards import it from here


class RewardError(RuntimeError):
    """A reward could not score a batch (bad input, a model that failed, a server that gave up). Never swallowed."""


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

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput: ...


def check_inputs(name: str, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None) -> int:
    """Validate a reward call's inputs; return B. Raises ValueError naming the reward and the problem."""
    if not isinstance(images, Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"reward '{name}': images must be a (B, 3, H, W) float tensor in [0, 1], got {shape}")
    if not images.is_floating_point():
        raise ValueError(f"reward '{name}': images must be float in [0, 1], got dtype {images.dtype}")
    b = images.shape[0]
    if len(prompts) != b:
        raise ValueError(f"reward '{name}': {b} images but {len(prompts)} prompts")
    if metadata is not None and len(metadata) != b:
        raise ValueError(f"reward '{name}': {b} images but {len(metadata)} metadata dicts")
    return b


def check_output(name: str, out: RewardOutput, batch: int) -> RewardOutput:
    """Validate a reward's output (shape (B,), finite) so a broken reward fails loudly, not silently.

    Scores and components are returned as float32 CPU tensors.
    """
    if not isinstance(out, RewardOutput):
        raise RewardError(f"reward '{name}' returned {type(out).__name__}, expected RewardOutput")
    s = torch.as_tensor(out.scores).detach().float().cpu().reshape(-1)
    if s.numel() != batch:
        raise RewardError(f"reward '{name}' returned {s.numel()} scores for a batch of {batch}")
    bad = (~torch.isfinite(s)).nonzero().flatten().tolist()
    if bad:
        raise RewardError(f"reward '{name}' returned non-finite scores at indices {bad[:8]}: {s[bad[:8]].tolist()}")
    comps = {}
    for k, v in out.components.items():
        v = torch.as_tensor(v).detach().float().cpu().reshape(-1)
        if v.numel() != batch:
            raise RewardError(f"reward '{name}' component '{k}' has {v.numel()} values for a batch of {batch}")
        comps[k] = v
    return RewardOutput(s, comps, out.info)


class Reward:
    """Optional base class for rewards: `name`, `__call__` and `close`.

    Subclasses set `name` and implement `__call__(images, prompts, metadata, **meta) -> RewardOutput`.
    """

    name: str = "reward"

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (models, sessions). Default: nothing."""


def chunks(n: int, size: int) -> list[slice]:
    """Slices covering range(n) in pieces of at most `size` (size <= 0: one piece)."""
    if size <= 0 or n <= size:
        return [slice(0, n)]
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def concat_outputs(outs: Sequence[RewardOutput]) -> RewardOutput:
    """Concatenate per-chunk outputs; list-valued info of matching lengths is concatenated, the rest kept first."""
    if len(outs) == 1:
        return outs[0]
    scores = torch.cat([o.scores.reshape(-1).float() for o in outs])
    comps = {k: torch.cat([o.components[k].reshape(-1).float() for o in outs]) for k in outs[0].components}
    info: dict[str, Any] = {}
    for k, v in outs[0].info.items():
        if isinstance(v, list) and all(isinstance(o.info.get(k), list) for o in outs):
            info[k] = [x for o in outs for x in o.info[k]]
        else:
            info[k] = v
    return RewardOutput(scores, comps, info)
