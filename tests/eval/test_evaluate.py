"""Evaluation: per-line noise independent of batching, reproducible summaries, tag-balanced subsets, grids."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowcredit.eval.evaluate import caption_grid, evaluate, generate, line_noise, make_grid, tag_balanced_subset
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel
from flowcredit.shapes.prompts import PromptSet, load_prompts
from flowcredit.shapes.vocab import TAGS


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return m.eval()


def test_line_noise_depends_only_on_seed_and_index():
    shape = (3, 8, 8)
    full = line_noise(0, range(6), shape)
    assert full.shape == (6, *shape) and full.dtype == torch.float32
    assert torch.equal(line_noise(0, [4, 2], shape), full[[4, 2]])
    assert torch.equal(line_noise(0, [5], shape)[0], full[5])
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(line_noise(0, range(6), shape), full)
    assert not torch.equal(line_noise(1, [0], shape)[0], full[0])
    assert not torch.equal(full[0], full[1])


def test_generate_batching_does_not_change_samples(model):
    prompts = load_prompts("shapes:test_unique").prompts[:5]
    a = generate(model, prompts, steps=2, guidance=1.0, seed=3, batch_size=5)
    b = generate(model, prompts, steps=2, guidance=1.0, seed=3, batch_size=2)
    assert a.shape == (5, 3, 32, 32)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # the image of line i does not depend on which other lines are generated with it
    c = generate(model, prompts[3:4], steps=2, guidance=1.0, seed=3, indices=[3])
    torch.testing.assert_close(c[0], a[3], rtol=0, atol=1e-5)
    d = generate(model, prompts, steps=2, guidance=1.0, seed=4, batch_size=5)
    assert not torch.allclose(a, d)


def test_evaluate_same_seed_same_summary(model, tmp_path):
    ps = load_prompts("shapes:test_unique")
    s1 = evaluate(model, ps, steps=2, seed=0, limit=12, out_dir=tmp_path / "a")
    s2 = evaluate(model, ps, steps=2, seed=0, limit=12, out_dir=tmp_path / "b", batch_size=5)
    assert json.dumps(s1, sort_keys=True) == json.dumps(s2, sort_keys=True)
    assert s1["num_images"] == 12 and s1["settings"]["seed"] == 0
    ra = (tmp_path / "a" / "results.jsonl").read_text()
    assert ra == (tmp_path / "b" / "results.jsonl").read_text()
    for i in range(12):
        assert (tmp_path / "a" / f"{i:05d}" / "samples" / "0000.png").read_bytes() == (
            tmp_path / "b" / f"{i:05d}" / "samples" / "0000.png"
        ).read_bytes()


def test_evaluate_with_custom_reward_on_plain_prompts(model):
    ps = PromptSet(["a photo of a red circle", "a photo of a blue square"], [{}, {}], "mem")

    class Mean:
        name = "mean"

        def __call__(self, images, prompts, metadata, **kw):
            from flowcredit.rewards.base import RewardOutput

            return RewardOutput(scores=images.mean(dim=(1, 2, 3)))

    s = evaluate(model, ps, reward=Mean(), steps=2, seed=0)
    assert s["num_images"] == 2 and "strict_overall" not in s and 0 <= s["reward_mean"] <= 1
    imgs = generate(model, ps.prompts, steps=2, guidance=1.0, seed=0)
    assert s["reward_mean"] == pytest.approx(float(imgs.mean()), abs=1e-6)


def test_tag_balanced_subset_interleaves_tags():
    ps = load_prompts("shapes:test")
    sub = tag_balanced_subset(ps, 30)
    assert len(sub) == 30
    tags = [m["tag"] for m in sub.metadata]
    assert tags[:6] == list(TAGS) and tags[6:12] == list(TAGS)
    assert all(tags.count(t) == 5 for t in TAGS)
    # the k-th entry of a tag is that tag's k-th line: a fixed subset
    firsts = {t: next(i for i, m in enumerate(ps.metadata) if m["tag"] == t) for t in TAGS}
    assert [sub.prompts[k] for k in range(6)] == [ps.prompts[firsts[t]] for t in TAGS]
    assert tag_balanced_subset(ps, 30).prompts == sub.prompts
    # asking for more than there is returns everything once
    small = PromptSet(["a", "b", "c"], [{"tag": "x"}, {"tag": "x"}, {"tag": "y"}], "mem")
    assert sorted(tag_balanced_subset(small, 10).prompts) == ["a", "b", "c"]
    assert tag_balanced_subset(small, 2).prompts == ["a", "c"]


def test_make_grid_layout():
    imgs = np.stack([np.full((4, 4, 3), i, dtype=np.uint8) for i in range(5)])
    g = make_grid(imgs, ncol=2, pad=1)
    assert g.shape == (3 * 5 + 1, 2 * 5 + 1, 3)
    assert (g[1:5, 1:5] == 0).all() and (g[1:5, 6:10] == 1).all() and (g[11:15, 1:5] == 4).all()
    assert (g[11:15, 6:10] == 255).all()  # the empty cell stays white


def _band(g, top, height):
    """The caption band under a grid row (rows top..top+height): True where a pixel is not white."""
    return (g[top : top + height] < 255).any(axis=2)


def test_caption_grid_writes_each_prompt_under_its_cell():
    imgs = np.stack([np.full((4, 4, 3), 10 * i, dtype=np.uint8) for i in range(4)])
    g = caption_grid(imgs, ["red", "", "a blue square", "green"], ncol=2, scale=3, pad=2)
    cw = 12  # 4 px × scale 3
    # the images are there, enlarged 3×, untouched by the text
    assert (g[2:14, 2:14] == 0).all() and (g[2:14, 16:28] == 10).all()
    row0 = _band(g, 14, 16)  # caption band of row 0 (one text line + padding)
    assert row0[:, 2 : 2 + cw].any()  # "red" under cell 0
    assert not row0[:, 16 : 16 + cw].any()  # "" leaves cell 1 blank
    assert g.shape[1] == 2 * (cw + 2) + 2 and g.shape[0] > 2 * (12 + 2) + 2  # taller than the uncaptioned grid
    # the text is the prompt: a different prompt draws different pixels
    other = caption_grid(imgs, ["blue", "", "a blue square", "green"], ncol=2, scale=3, pad=2)
    assert not np.array_equal(g[14:30, 2 : 2 + cw], other[14:30, 2 : 2 + cw])


def test_caption_grid_shares_one_caption_per_group_row():
    # a training grid: a row = one prompt × G samples; the caption spans the row instead of being cut per cell
    imgs = np.zeros((4, 8, 8, 3), dtype=np.uint8)
    prompt = "a photo of a red circle"
    shared = caption_grid(imgs, [prompt, prompt, "b", "b"], ncol=2, scale=3)
    per_cell = caption_grid(imgs, [prompt, prompt + " ", "b", "b"], ncol=2, scale=3)  # different: wrapped per cell
    assert shared.shape[0] < per_cell.shape[0]  # one line across the row vs several lines in a narrow cell
    with pytest.raises(ValueError, match="4 images but 3 captions"):
        caption_grid(imgs, ["a", "b", "c"], ncol=2)


def test_caption_grid_wraps_and_truncates_long_prompts():
    imgs = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    long = "a " + "supercalifragilistic " * 20
    g = caption_grid(imgs, [long], ncol=1, scale=3, max_lines=2)
    g4 = caption_grid(imgs, [long], ncol=1, scale=3, max_lines=4)
    assert g.shape[0] < g4.shape[0] and g.shape[1] == g4.shape[1] == 24 + 4  # width never grows with the text


def test_evaluate_grid_has_captions(tmp_path, model):
    ps = load_prompts("shapes:test_unique")
    sub = PromptSet(ps.prompts[:3], ps.metadata[:3], "sub")
    evaluate(model, sub, steps=2, out_dir=tmp_path / "ev", write_samples=False)
    grid = np.asarray(Image.open(tmp_path / "ev" / "grid.png"))
    plain = make_grid(np.zeros((3, 32, 32, 3), dtype=np.uint8))
    assert grid.shape[1] == 3 * (32 * 3 + 2) + 2 and grid.shape[0] > plain.shape[0] * 3  # room for the prompts
    assert (grid[2 + 96 : -2] < 128).any()  # dark text under the images
