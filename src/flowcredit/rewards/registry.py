"""Reward registry: a literal table of built-in rewards (name → "module:attr"), resolved lazily so heavy
dependencies (transformers, easyocr) are imported only when a reward is used (STYLE.md R4). A dotted
"package.module:Class" path is accepted for third-party rewards.

| name | what | needs |
|---|---|---|
| shapes | shapes-world verifier (GenEval parity) | option score: dense (default), strict, correct |
| imagestats | brightness / contrast / saturation / colorfulness | — |
| mix | weighted mix of other rewards, optional normalization | the components' needs |
| pickscore | PickScore (CLIP), flow_grpo's logit_scale·cos/26 | transformers + weights |
| clipscore | CLIP-S = w·max(cos, 0), w = 2.5 (Hessel et al. 2021) | transformers + weights |
| aesthetic | LAION aesthetic predictor v2 (CLIP ViT-L/14 embedding + MLP head) | transformers + weights |
| hpsv2 | HPSv2-style CLIP preference score (cos, optional scale) | transformers + weights |
| imagereward | ImageReward (BLIP + MLP) on transformers' BLIP | transformers + weights |
| ocr | flow_grpo's OCR edit-distance reward on the quoted text, easyocr | easyocr (+ offline weights) |
| vlm, unifiedreward | VLM judge over an OpenAI-compatible chat endpoint | a running server |
| remote | a reward served by `flowcredit serve-reward` | a running server |
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from ..config.registry import import_user_module

REWARDS: dict[str, str] = {
    "shapes": "flowcredit.rewards.shapes:ShapesReward",
    "imagestats": "flowcredit.rewards.imagestats:ImageStatsReward",
    "mix": "flowcredit.rewards.mix:build_mix",
    "pickscore": "flowcredit.rewards.clip:PickScoreReward",
    "clipscore": "flowcredit.rewards.clip:CLIPScoreReward",
    "aesthetic": "flowcredit.rewards.clip:AestheticReward",
    "hpsv2": "flowcredit.rewards.clip:HPSv2Reward",
    "imagereward": "flowcredit.rewards.imagereward:ImageRewardReward",
    "ocr": "flowcredit.rewards.ocr:OCRReward",
    "vlm": "flowcredit.rewards.vlm:VLMJudgeReward",
    "unifiedreward": "flowcredit.rewards.vlm:UnifiedReward",
    "remote": "flowcredit.rewards.remote:RemoteReward",
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
            raise ValueError(f"unknown reward '{name}' (reward.name){hint} valid rewards: {', '.join(names())}, or a "
                             "'module:Class' path")
    mod, attr = target.split(":", 1)
    try:
        module = import_user_module(mod) if name not in REWARDS else importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if name in REWARDS:  # a built-in reward whose optional dependency is missing
            raise ValueError(
                f"reward '{name}' needs the Python package '{e.name}': pip install 'flowcredit[rewards]'"
            ) from e
        raise ValueError(f"reward '{name}': cannot import module '{mod}' ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"reward '{name}': module '{mod}' has no attribute '{attr}'") from None


def build_reward(name: str, **kwargs: Any):
    """Instantiate a reward by name with its options (keyword arguments of its constructor)."""
    return resolve(name)(**kwargs)


def reward_from_config(rc: Any):
    """The reward of a `reward:` config section (config.schema.RewardCfg): one reward, or the weighted mix of
    `reward.components` when name is 'mix'."""
    if rc.name != "mix":
        return build_reward(rc.name, **rc.options)
    if not rc.components:
        raise ValueError("reward.name=mix needs reward.components, e.g. [{name: shapes, weight: 1.0}]")
    comps = [{"name": c.name, "weight": c.weight, "options": c.options, "label": c.label} for c in rc.components]
    return build_reward("mix", components=comps, normalize=rc.normalize)
