"""The shapes verifier as a reward: dense by default, binary strict/correct as options (issue D stagnation regime)."""

import numpy as np
import pytest
import torch

from flowcredit.rewards.registry import build_reward
from flowcredit.shapes.prompts import load_prompts
from flowcredit.shapes.render import render_record


def _batch(n=4):
    return load_prompts("shapes:test_unique").metadata[:n]


@pytest.mark.parametrize("score", ["dense", "strict", "correct"])
def test_score_option_selects_the_signal(score):
    meta = _batch(4)
    gt = np.stack([render_record(m, seed=0, index=i) for i, m in enumerate(meta)])  # (4, 32, 32, 3) uint8
    blank = np.full_like(gt, 127)
    imgs = torch.from_numpy(np.concatenate([gt, blank])).permute(0, 3, 1, 2).float() / 255.0  # (8, 3, 32, 32) in [0, 1]
    prompts = [m["prompt"] for m in meta] * 2
    out = build_reward("shapes", score=score)(imgs, prompts, meta + meta)
    assert torch.equal(out.scores, out.components[score])
    assert out.scores[:4].tolist() == [1.0] * 4 and out.scores[4:].tolist() == [0.0] * 4
    assert set(out.components) == {"dense", "strict", "correct"}


def test_unknown_score_names_the_choices():
    with pytest.raises(ValueError, match=r"reward.options.score.*dense, strict, correct"):
        build_reward("shapes", score="binary")
    with pytest.raises(ValueError, match="only the option 'score'"):
        build_reward("shapes", threshold=0.5)
