"""Training objectives behind one protocol (`base.Objective`): grpo (PPO-clip on SDE log-probs), nft
(DiffusionNFT), awm (Advantage Weighted Matching). `build_objective(name, options, train_cfg)`; register new ones
with `register_objective`. Importing the package registers the built-ins."""

from . import awm, grpo, nft  # noqa: F401  (the built-in objectives register themselves)
from .base import (
    OBJECTIVES,
    LossContext,
    LossOut,
    Objective,
    build_objective,
    objective_options,
    objective_spec,
    register_objective,
)

__all__ = [
    "OBJECTIVES",
    "LossContext",
    "LossOut",
    "Objective",
    "build_objective",
    "objective_options",
    "objective_spec",
    "register_objective",
]
