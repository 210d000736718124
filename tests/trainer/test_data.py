"""PromptSampler: group-major batches with group ids, tag balancing, seeding and resumable state."""

from __future__ import annotations

from collections import Counter

import pytest

import torch

from flowcredit.shapes.prompts import PromptSet, load_prompts
from flowcredit.trainer.data import PromptSampler


def test_draw_is_group_major_with_group_ids():
    ps = load_prompts("shapes:train")
    s = PromptSampler(ps, seed=0)
    prompts, meta, gids = s.draw(3, 4)
    assert len(prompts) == len(meta) == 12
    assert gids.dtype == torch.long and gids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for g in range(3):
        block = prompts[4 * g : 4 * g + 4]
        assert len(set(block)) == 1
        assert all(m["prompt"] == p for m, p in zip(meta[4 * g : 4 * g + 4], block))


def test_same_seed_same_draws_and_state_resume():
    ps = load_prompts("shapes:train")
    a, b = PromptSampler(ps, seed=3), PromptSampler(ps, seed=3)
    assert [a.draw(2, 2)[0] for _ in range(5)] == [b.draw(2, 2)[0] for _ in range(5)]
    assert PromptSampler(ps, seed=4).draw(8, 2)[0] != PromptSampler(ps, seed=3).draw(8, 2)[0]
    # state_dict / load_state_dict resume the exact sequence
    c = PromptSampler(ps, seed=5)
    c.draw(4, 2)
    state = c.state_dict()
    expected = [c.draw(4, 2)[0] for _ in range(3)]
    d = PromptSampler(ps, seed=99)
    d.load_state_dict(state)
    assert [d.draw(4, 2)[0] for _ in range(3)] == expected


def test_balance_tags_draws_tags_uniformly():
    ps = load_prompts("shapes:train")  # 640 of 738 prompts are color_attr
    n = 3000
    balanced = Counter(m["tag"] for m in PromptSampler(ps, seed=0, balance_tags=True).draw(n, 2)[1][::2])
    assert len(balanced) == 6 and all(abs(c / n - 1 / 6) < 0.03 for c in balanced.values()), balanced
    plain = Counter(m["tag"] for m in PromptSampler(ps, seed=0, balance_tags=False).draw(n, 2)[1][::2])
    share = sum(1 for m in ps.metadata if m["tag"] == "color_attr") / len(ps)
    assert abs(plain["color_attr"] / n - share) < 0.03


def test_plain_text_prompts_without_metadata():
    ps = PromptSet(["a cat", "a dog", "a bird"], [{}, {}, {}], "mem")
    prompts, meta, gids = PromptSampler(ps, seed=0).draw(5, 2)
    assert set(prompts) <= {"a cat", "a dog", "a bird"} and meta == [{}] * 10 and gids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_tag_weights_shift_the_tag_mix_and_zero_drops_a_tag():
    ps = load_prompts("shapes:train")
    n = 3000
    s = PromptSampler(ps, seed=0, tag_weights={"single_object": 0.0, "position": 3.0})
    tags = Counter(m["tag"] for m in s.draw(n, 2)[1][::2])
    assert "single_object" not in tags
    # position: 3 / (3 + 4 tags of weight 1) = 3/7 of the draws; each other tag 1/7
    assert abs(tags["position"] / n - 3 / 7) < 0.03
    for t in ("two_object", "counting", "colors", "color_attr"):
        assert abs(tags[t] / n - 1 / 7) < 0.03


def test_tag_weights_none_keeps_the_uniform_draws_bit_for_bit():
    ps = load_prompts("shapes:train")
    assert PromptSampler(ps, seed=7).draw(16, 2)[0] == PromptSampler(ps, seed=7, tag_weights=None).draw(16, 2)[0]


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"positon": 2.0}, r"data.tag_weights: tag 'positon' is not in .*; its tags: color_attr, colors, counting"),
        ({t: 0.0 for t in ("single_object", "two_object", "counting", "colors", "position", "color_attr")}, "every tag has weight 0"),
    ],
)
def test_tag_weights_bad_input_is_one_line(weights, message):
    with pytest.raises(ValueError, match=message):
        PromptSampler(load_prompts("shapes:train"), seed=0, tag_weights=weights)


def test_tag_weights_config_checks():
    from flowcredit.config.schema import DataCfg

    with pytest.raises(ValueError, match="data.tag_weights: weights must be >= 0"):
        DataCfg(tag_weights={"position": -1.0})
    with pytest.raises(ValueError, match="needs data.balance_tags=true"):
        DataCfg(tag_weights={"position": 2.0}, balance_tags=False)
