"""Shapes verifier: ground-truth parity, reward-hacking probes, reward terms, batch input, results files (§4.6–§4.8)."""

from __future__ import annotations

import copy
import json
import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from flowcredit.shapes import prompts, render
from flowcredit.shapes.geneval import summarize
from flowcredit.shapes.render import Obj, render_objects, sample_layout
from flowcredit.shapes.verifier import (
    RESULT_COLUMNS,
    flow_grpo_details,
    flow_grpo_metrics,
    result_row,
    verify,
    verify_batch,
    write_results_jsonl,
)
from flowcredit.shapes.vocab import BACKGROUND, COLOR_NAMES, TAGS, get_world

SEED = 2024


def _records(res: int) -> list[dict]:
    sp = prompts.make_splits(res)
    return sp["train"] + sp["test"]


def _test_records(res: int) -> list[dict]:
    return prompts.make_splits(res)["test"]


# ---------------------------------------------------------------------------------------------------------------
# Ground truth: every render is correct, strict and rewarded 1
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("res", [32, 64])
def test_every_ground_truth_render_scores_one(res):
    recs = _records(res)
    assert len(recs) >= 500 and {r["tag"] for r in recs} == set(TAGS)
    bad = []
    for i, r in enumerate(recs):
        v = verify(render.render_record(r, seed=SEED, index=i, resolution=res), r)
        if not (v.correct and v.strict and v.reward == 1.0):
            bad.append((i, r["prompt"], v.reason))
    assert not bad, f"{len(bad)} of {len(recs)} ground-truth renders failed, e.g. {bad[:5]}"


# ---------------------------------------------------------------------------------------------------------------
# Reward-hacking probes
# ---------------------------------------------------------------------------------------------------------------


def grid_image(n: int, res: int, rng: np.random.Generator) -> np.ndarray:
    """n×n grid of every World shape (cycled, shuffled) in random colours, boxes 2 px apart."""
    world = get_world(res)
    cell = res / n
    s = (cell - world.min_gap) / 2 - 0.05
    shapes = list(world.shapes) * (n * n // len(world.shapes) + 1)
    rng.shuffle(shapes)
    objs = [
        Obj(shapes[i * n + j], COLOR_NAMES[int(rng.integers(len(COLOR_NAMES)))], (j + 0.5) * cell, (i + 0.5) * cell, s, s)
        for i in range(n)
        for j in range(n)
    ]
    return render_objects(objs, res)


def duplicated_image(record: dict, res: int, rng: np.random.Generator, tries: int = 30) -> np.ndarray | None:
    """Ground truth with every object duplicated (same shape, colour, size) in free space; None if it can't fit."""
    world = get_world(res)
    for _ in range(tries):
        objs = sample_layout(record, rng, world)
        boxes = [o.box for o in objs]
        out = list(objs)
        for o in objs:
            for _ in range(500):
                cx, cy = rng.uniform(world.margin + o.sx, res - world.margin - o.sx, size=2)
                b = (cx - o.sx, cy - o.sy, cx + o.sx, cy + o.sy)
                if all(max(bb[0] - b[2], b[0] - bb[2], bb[1] - b[3], b[1] - bb[3]) >= world.min_gap for bb in boxes):
                    out.append(Obj(o.shape, o.color, float(cx), float(cy), o.sx, o.sy))
                    boxes.append(b)
                    break
            else:
                break
        if len(out) == 2 * len(objs):
            return render_objects(out, res)
    return None


@pytest.mark.parametrize("res", [32, 64])
def test_empty_canvas_scores_zero(res):
    empty = np.full((res, res, 3), BACKGROUND, np.uint8)
    for r in _test_records(res):
        v = verify(empty, r)
        assert v.reward == 0.0 and not v.correct and not v.strict


@pytest.mark.parametrize("res", [32, 64])
def test_giant_blobs_score_zero(res):
    touching = render_objects([Obj("square", "red", res / 2, res / 2, 0.6 * res, 0.6 * res)], res)  # covers all
    inside = render_objects([Obj("circle", "white", res / 2, res / 2, 0.46 * res, 0.46 * res)], res)  # > 50%
    for img in (touching, inside):
        for r in _test_records(res)[::7]:
            assert verify(img, r).reward == 0.0


@pytest.mark.parametrize("res", [32, 64])
def test_grid_of_all_shapes_is_not_rewarded(res):
    rng = np.random.default_rng(SEED + res)
    recs = _test_records(res)
    vals = [verify(grid_image(3, res, rng), r) for r in recs]
    mean = float(np.mean([v.reward for v in vals]))
    assert mean < 0.1, mean  # measured ≈ 0.02 at both resolutions
    assert not any(v.strict for v in vals)


def test_one_of_every_shape_is_ranked_far_below_ground_truth():
    # 2×2 grid at 32 px = each of the 4 shapes once: for "a circle" that is the circle + 3 extra objects
    # (0.9 · 1/(1+3) = 0.225). Measured mean ≈ 0.12 over the test prompts; never strict.
    rng = np.random.default_rng(SEED)
    vals = [verify(grid_image(2, 32, rng), r) for r in _test_records(32)]
    assert float(np.mean([v.reward for v in vals])) < 0.2
    assert max(v.reward for v in vals) <= 0.9 * 0.5 and not any(v.strict for v in vals)


@pytest.mark.parametrize("res", [32, 64])
def test_duplicated_objects_are_not_rewarded(res):
    rng = np.random.default_rng(SEED + 1)
    per_tag: dict[str, list[float]] = defaultdict(list)
    n_correct = 0
    for r in _test_records(res):
        img = duplicated_image(r, res, rng)
        if img is None:  # e.g. four crosses ×2 do not fit in 32×32
            continue
        v = verify(img, r)
        assert not v.strict, r["prompt"]
        per_tag[r["tag"]].append(v.reward)
        n_correct += v.correct
    assert set(per_tag) == set(TAGS)
    rewards = [x for v in per_tag.values() for x in v]
    assert len(rewards) >= 0.9 * len(_test_records(res))
    assert float(np.mean(rewards)) < 0.6  # measured ≈ 0.05 (only position keeps its relation term)
    assert n_correct > 0.5 * len(rewards)  # ...while GenEval's "≥ count" passes most of them (§1.5)


# ---------------------------------------------------------------------------------------------------------------
# Reward terms
# ---------------------------------------------------------------------------------------------------------------


def _rec(tag, include, exclude=None):
    return prompts.make_record(tag, include) if exclude is None else {**prompts.make_record(tag, include), "exclude": exclude}


def test_extra_object_keeps_geneval_correct_but_not_strict():
    r = _rec("single_object", [{"class": "circle", "count": 1}])
    img = render_objects([Obj("circle", "red", 9, 9, 5.5, 5.5), Obj("square", "blue", 23, 23, 5.5, 5.5)], 32)
    v = verify(img, r)
    assert v.correct and not v.strict
    assert v.terms == {"count[0]": 1.0}
    assert v.reward == pytest.approx(0.9 * 1.0 * 0.5)
    assert "extra objects: squarex1" in v.reason and "\n" not in v.reason


def test_wrong_colour_and_duplicates_get_no_colour_credit():
    r = _rec("colors", [{"class": "circle", "count": 1, "color": "red"}])
    wrong = verify(render_objects([Obj("circle", "blue", 16, 16, 6, 6)], 32), r)
    assert not wrong.correct and wrong.terms == {"count[0]": 1.0, "color[0]": 0.0}
    assert wrong.reward == pytest.approx(0.9 * 0.5)
    assert wrong.reason.startswith("expected red circle>=1, found 0 red; and 1 blue")
    two = verify(render_objects([Obj("circle", "red", 9, 16, 5.5, 5.5), Obj("circle", "red", 23, 16, 5.5, 5.5)], 32), r)
    assert two.correct and not two.strict  # GenEval passes over-generation
    assert two.terms == {"count[0]": 0.0, "color[0]": 0.0} and two.reward == 0.0
    assert "expected circle==1, found 2" in two.reason


def test_position_term_is_soft_below_one_half_on_the_wrong_side():
    r = _rec("position", [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}])
    good = verify(render_objects([Obj("square", "red", 24, 16, 5, 5), Obj("circle", "blue", 8, 16, 5, 5)], 32), r)
    assert good.strict and good.reward == 1.0
    swapped = verify(render_objects([Obj("square", "red", 8, 16, 5, 5), Obj("circle", "blue", 24, 16, 5, 5)], 32), r)
    close = verify(render_objects([Obj("square", "red", 19, 8, 5, 5), Obj("circle", "blue", 13, 24, 5, 5)], 32), r)
    assert not swapped.correct and not close.correct
    assert 0.0 <= swapped.terms["position[1]"] < close.terms["position[1]"] < 0.5
    missing = verify(render_objects([Obj("circle", "blue", 8, 16, 5, 5)], 32), r)
    assert missing.terms["position[1]"] == 0.0 and "no target" in missing.reason


def test_counting_exclude_and_blob_guards():
    r = _rec("counting", [{"class": "square", "count": 2}], [{"class": "square", "count": 3}])
    three = [Obj("square", "red", 6 + 10 * i, 16, 4, 4) for i in range(3)]
    v = verify(render_objects(three, 32), r)
    assert not v.correct and v.terms == {"count[0]": pytest.approx(0.5)} and v.reward == pytest.approx(0.45)
    assert v.reason == "expected square<3, found 3"  # no duplicate "==" message next to GenEval's exclude one
    two_and_blob = render_objects(three[:2] + [Obj("square", "green", 27, 16, 9, 2.5)], 32)  # + a bar (aspect)
    w = verify(two_and_blob, r)
    assert w.correct and not w.strict and w.guards["n_blobs"] == 1.0
    assert w.reward == pytest.approx(0.9 * 1.0 * 0.5 * (1 - 4 * w.guards["junk_area_fraction"]))


# ---------------------------------------------------------------------------------------------------------------
# Inputs and outputs
# ---------------------------------------------------------------------------------------------------------------


def test_unknown_shape_or_colour_names_the_valid_ones():
    base = _rec("single_object", [{"class": "circle", "count": 1}])
    img = np.full((32, 32, 3), BACKGROUND, np.uint8)
    bad_shape = copy.deepcopy(base)
    bad_shape["include"][0]["class"] = "hexagon"
    with pytest.raises(ValueError, match="unknown shape 'hexagon'.*valid shapes: circle, square, triangle, cross"):
        verify(img, bad_shape)
    diamond = copy.deepcopy(base)
    diamond["include"][0]["class"] = "diamond"  # a 64-px shape only
    with pytest.raises(ValueError, match="valid shapes: circle, square, triangle, cross$"):
        verify(img, diamond)
    verify(np.full((64, 64, 3), BACKGROUND, np.uint8), diamond)  # fine at 64
    bad_color = copy.deepcopy(base)
    bad_color["include"][0]["color"] = "cyan"
    with pytest.raises(ValueError, match="unknown colour 'cyan'.*valid colours: red, orange, yellow, green, blue, purple, pink, brown, black, white"):
        verify(img, bad_color)
    with pytest.raises(ValueError, match="no 'include' clauses"):
        verify(img, {"prompt": "a cat"})
    with pytest.raises(ValueError, match="not supported"):
        verify(np.full((48, 48, 3), BACKGROUND, np.uint8), base)


def test_tensor_batch_matches_uint8():
    recs = _test_records(32)[::40]
    imgs = np.stack([render.render_record(r, seed=SEED, index=i, resolution=32) for i, r in enumerate(recs)])
    imgs[1] = grid_image(3, 32, np.random.default_rng(0))  # a non-trivial result in the batch
    ref = verify_batch(imgs, recs)
    t = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255.0
    for batch in (t, list(imgs), imgs.astype(np.float32) / 255.0):
        got = verify_batch(batch, recs)
        assert [(v.correct, v.strict, v.reward, v.terms, v.details, v.reason) for v in got] == [
            (v.correct, v.strict, v.reward, v.terms, v.details, v.reason) for v in ref
        ]
    with pytest.raises(ValueError, match="records"):
        verify_batch(t, recs[:-1])


def test_results_jsonl_has_geneval_columns_and_summarises(tmp_path):
    recs = _test_records(32)[::25]
    res = [verify(render.render_record(r, seed=SEED, index=i, resolution=32), r) for i, r in enumerate(recs)]
    res[0] = verify(np.full((32, 32, 3), BACKGROUND, np.uint8), recs[0])
    path = tmp_path / "results.jsonl"
    write_results_jsonl(path, [result_row(v, f"{i:05d}/samples/0000.png") for i, v in enumerate(res)])
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == len(recs)
    assert tuple(lines[0]) == RESULT_COLUMNS
    assert RESULT_COLUMNS[:7] == ("filename", "tag", "prompt", "correct", "reason", "metadata", "details")
    assert json.loads(lines[1]["metadata"]) == recs[1]
    details = json.loads(lines[1]["details"])
    assert all(len(b) == 5 for boxes in details.values() for b in boxes)
    assert lines[0]["correct"] is False and lines[0]["reward"] == 0.0 and lines[1]["strict"] is True
    s = summarize(lines)
    assert s["total_images"] == len(recs) and s["correct"]["images"] == pytest.approx(1 - 1 / len(recs))
    # VerifyResults can be written directly too
    write_results_jsonl(tmp_path / "r2.jsonl", res)
    assert [json.loads(x)["reward"] for x in (tmp_path / "r2.jsonl").read_text().splitlines()] == [v.reward for v in res]


def test_flow_grpo_keys():
    recs = [_rec("single_object", [{"class": "circle", "count": 1}]), _rec("colors", [{"class": "square", "count": 1, "color": "red"}])]
    imgs = [render.render_record(recs[0], seed=1, resolution=32), np.full((32, 32, 3), BACKGROUND, np.uint8)]
    res = verify_batch(imgs, recs)
    d = flow_grpo_details(res)
    assert d["geneval"] == [1.0, 0.0] and d["accuracy"] == [1.0, 0.0] and d["strict_accuracy"] == [1.0, 0.0]
    assert d["single_object_accuracy"][0] == 1.0 and math.isnan(d["single_object_accuracy"][1])
    assert math.isnan(d["colors_strict_accuracy"][0]) and d["colors_strict_accuracy"][1] == 0.0
    m = flow_grpo_metrics(res)
    assert m["accuracy"] == 0.5 and m["single_object_accuracy"] == 1.0 and m["colors_accuracy"] == 0.0
