"""Registry, output validation, the image-statistics reward and weighted / normalized mixing."""

from __future__ import annotations


import pytest
import torch

from flowcredit.rewards.base import RewardError, RewardOutput, check_output
from flowcredit.rewards.imagestats import image_stats
from flowcredit.rewards.mix import MixedReward, parse_mix
from flowcredit.rewards.registry import REWARDS, build_reward, names, resolve


class Const:
    """A reward returning fixed scores (to check mixing arithmetic)."""

    def __init__(self, name, values):
        self.name, self.values = name, torch.tensor(values, dtype=torch.float32)

    def __call__(self, images, prompts, metadata, **meta):
        return RewardOutput(self.values.clone(), {"sub": self.values * 10})


def test_registry_lists_every_reward_and_resolves_lazily():
    assert {"shapes", "imagestats", "mix", "pickscore", "clipscore", "aesthetic", "hpsv2", "imagereward", "ocr", "vlm",
            "unifiedreward", "remote"} <= set(names())
    for n in REWARDS:
        assert callable(resolve(n))  # importing a reward module never imports its heavy dependency
    with pytest.raises(ValueError, match="did you mean 'pickscore'"):
        resolve("pickscor")
    assert resolve("flowcredit.rewards.imagestats:ImageStatsReward") is resolve("imagestats")


def test_imagestats_values():
    x = torch.zeros(3, 3, 4, 4)
    x[1] = 1.0
    x[2, 0] = 1.0  # pure red
    st = image_stats(x)
    torch.testing.assert_close(st["brightness"], torch.tensor([0.0, 1.0, 0.299]))
    torch.testing.assert_close(st["saturation"], torch.tensor([0.0, 0.0, 1.0]))
    assert st["contrast"].tolist() == [0.0, 0.0, 0.0]
    assert st["colorfulness"][2].item() == pytest.approx(0.3 * 1.25**0.5 / 1.5, rel=1e-5)  # σ = 0, μ = |(1, 0.5)|
    half = torch.zeros(1, 3, 4, 4)
    half[..., :2] = 1.0
    assert image_stats(half)["contrast"].item() == pytest.approx(1.0)
    r = build_reward("imagestats", stat="brightness", target=0.5)
    out = r(x, ["a", "b", "c"], [{}] * 3)
    torch.testing.assert_close(out.scores, torch.tensor([0.5, 0.5, 1 - 0.201]))
    assert set(out.components) == {"brightness", "contrast", "saturation", "colorfulness"}
    assert torch.equal(out.scores, r(x, ["a", "b", "c"], [{}] * 3).scores)


def test_parse_mix():
    assert parse_mix("0.8*ocr + 0.2*pickscore") == [("ocr", 0.8), ("pickscore", 0.2)]
    assert parse_mix("0.8*ocr+0.2*pickscore") == [("ocr", 0.8), ("pickscore", 0.2)]
    assert parse_mix("shapes - 0.1*imagestats + clipscore*2 + 1e-1*my.mod:Cls") == [
        ("shapes", 1.0), ("imagestats", -0.1), ("clipscore", 2.0), ("my.mod:Cls", 0.1)]
    for bad in ["", "0.8*", "0.8 ocr", "ocr pickscore", "0.8*ocr +"]:
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_weighted_mix_logs_every_component():
    a, b = Const("a", [1.0, 2.0, 3.0, 4.0]), Const("b", [0.0, 0.0, 1.0, 1.0])
    m = MixedReward([(a, 0.8), (b, 0.2)])
    out = m(torch.zeros(4, 3, 2, 2), ["p"] * 4, [{}] * 4)
    torch.testing.assert_close(out.scores, 0.8 * a.values + 0.2 * b.values)
    assert set(out.components) == {"a", "a/sub", "b", "b/sub"}
    assert m.describe() == "0.8*a + 0.2*b"
    dup = MixedReward([(a, 1.0), (a, 1.0)])
    assert set(dup(torch.zeros(4, 3, 2, 2), ["p"] * 4, [{}] * 4).components) >= {"a", "a#2"}


def test_normalized_mixes():
    a, b = Const("a", [1.0, 2.0, 3.0, 4.0]), Const("b", [0.0, 0.0, 1.0, 1.0])
    x, p, md = torch.zeros(4, 3, 2, 2), ["p"] * 4, [{}] * 4
    z = lambda v: (v - v.mean()) / (v.std(unbiased=False) + 1e-6)  # noqa: E731
    out = MixedReward([(a, 0.5), (b, 0.5)], normalize=True)(x, p, md)
    torch.testing.assert_close(out.scores, 0.5 * z(a.values) + 0.5 * z(b.values))
    torch.testing.assert_close(out.components["a/norm"], z(a.values))
    g = MixedReward([(a, 1.0), (b, 1.0)], normalize="group")(x, p, md, group_ids=torch.tensor([0, 0, 1, 1]))
    # GDPO: within group 0, a = [1, 2] → [-1, 1]; b = [0, 0] → [0, 0] (no spread, no signal)
    torch.testing.assert_close(g.scores, torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-4, rtol=0)
    r = MixedReward([(a, 1.0)], normalize="running")
    r(x, p, md)
    second = r(x, p, md)  # same batch again: running stats equal the batch stats
    torch.testing.assert_close(second.scores, z(a.values), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="normalize"):
        MixedReward([(a, 1.0)], normalize="softmax")


def test_build_mix_from_config_and_spec():
    m = build_reward("mix", components=[{"name": "imagestats", "weight": 0.8, "options": {"stat": "brightness"}},
                                        {"name": "imagestats", "weight": 0.2, "label": "contrast"}], parallel=True)
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    out = m(x, ["p"] * 4, [{}] * 4)
    st = image_stats(x)
    torch.testing.assert_close(out.scores, 0.8 * st["brightness"] + 0.2 * st["contrast"])
    assert {"imagestats", "contrast", "imagestats/brightness"} <= set(out.components)
    s = build_reward("mix", spec="0.5*imagestats + 0.5*imagestats")
    assert s.describe() == "0.5*imagestats + 0.5*imagestats#2"
    with pytest.raises(ValueError, match="exactly one"):
        build_reward("mix")
    with pytest.raises(ValueError, match="unknown keys"):
        build_reward("mix", components=[{"name": "imagestats", "wieght": 1}])


def test_check_output_validates():
    with pytest.raises(RewardError, match="non-finite"):
        check_output("bad", RewardOutput(torch.tensor([1.0, float("nan")])), 2)
    with pytest.raises(RewardError, match="3 scores for a batch of 2"):
        check_output("c", Const("c", [1.0, 2.0, 3.0])(torch.zeros(2, 3, 2, 2), ["a", "b"], [{}, {}]), 2)
