"""Reward registry: a literal table of built-in rewards (name → "module:attr"), resolved lazily so heavy
dependencies are imported only when a reward is used (STYLE.md R4). A dotted "package.module:Class" path
is accepted for third-party rewards."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

REWARDS: dict[str, str] = {
    "shapes": "flowcredit.rewards.shapes:ShapesReward",
}


def names() -> list[str]:
    return sorted(REWARDS)


def resolve(name: str):
    """Return the reward class/factory for a registry name or a 'module:attr' path."""
    target = REWARDS.get(name)
    if target is None:
        if ":" in name:
            target = name
        else:
            close = difflib.get_close_matches(name, REWARDS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"unknown reward '{name}' (reward.name){hint} valid rewards: {', '.join(names())}, or a 'module:Class' path")
    mod, attr = target.split(":", 1)
    return getattr(importlib.import_module(mod), attr)


def build_reward(name: str, **kwargs: Any):
    """Instantiate a reward by name with its options."""
    return resolve(name)(**kwargs)
