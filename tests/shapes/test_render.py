"""Ground-truth renderer: determinism, layout constraints (margin, gap) and GenEval's position rule with margin."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from flowcredit.shapes.prompts import make_record, make_splits
from flowcredit.shapes.render import (
    POSITION_MARGIN,
    Obj,
    coverage,
    record_rng,
    render_batch,
    render_objects,
    render_record,
    sample_layout,
)
from flowcredit.shapes.vocab import BACKGROUND, COLORS, get_world


def geneval_relations(box_a, box_b, threshold=0.1):
    """GenEval's evaluate_images.relative_position (A relative to B), re-implemented here independently.

    Returns (relations, (dx, dy)) with (dx, dy) the revised offset normalised by the centre distance.
    """
    boxes = np.array([box_a, box_b], dtype=np.float64).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set(), (0.0, 0.0)
    dx, dy = revised / np.linalg.norm(offset)
    rels = set()
    if dx < -0.5:
        rels.add("left of")
    if dx > 0.5:
        rels.add("right of")
    if dy < -0.5:
        rels.add("above")
    if dy > 0.5:
        rels.add("below")
    return rels, (dx, dy)


def test_same_seed_same_bytes():
    rec = make_record("color_attr", [{"class": "cross", "count": 1, "color": "orange"}, {"class": "square", "count": 1, "color": "blue"}])
    a = render_record(rec, seed=5, index=3, sample=1)
    b = render_record(rec, seed=5, index=3, sample=1)
    assert a.dtype == np.uint8 and a.shape == (32, 32, 3)
    assert a.tobytes() == b.tobytes()
    assert render_record(rec, seed=5, index=3, sample=2).tobytes() != a.tobytes()  # other sample index
    assert render_record(rec, seed=5, index=4, sample=1).tobytes() != a.tobytes()  # other record index
    assert render_record(rec, seed=6, index=3, sample=1).tobytes() != a.tobytes()  # other global seed
    big = render_record(make_record("single_object", [{"class": "diamond", "count": 1}]), seed=0, resolution=64)
    assert big.shape == (64, 64, 3)


def test_render_batch_deterministic_for_same_generator():
    recs = make_splits(32)["test"][:12]
    a = render_batch(recs, np.random.default_rng(0))
    b = render_batch(recs, np.random.default_rng(0))
    assert a.shape == (12, 32, 32, 3) and np.array_equal(a, b)


def test_colours_and_background_are_exact():
    img = render_objects([Obj("square", "red", 10.0, 10.0, 4.0, 4.0)], 32)
    assert tuple(img[0, 0]) == BACKGROUND and tuple(img[31, 31]) == BACKGROUND
    assert tuple(img[10, 10]) == COLORS["red"]  # fully covered pixel inside the square
    # the coverage of a pixel-aligned square is exactly its area
    cov = coverage("square", 16.0, 16.0, 4.0, 4.0, 32, 32)
    assert cov.sum() == pytest.approx(64.0) and cov.max() == 1.0


def _check_layout(objs, world):
    res = world.resolution
    boxes = [o.box for o in objs]
    for x0, y0, x1, y1 in boxes:
        assert x0 >= world.margin - 1e-9 and y0 >= world.margin - 1e-9
        assert x1 <= res - world.margin + 1e-9 and y1 <= res - world.margin + 1e-9
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            a, b = boxes[i], boxes[j]
            sep = max(a[0] - b[2], b[0] - a[2], a[1] - b[3], b[1] - a[3])
            assert sep >= world.min_gap - 1e-9, (a, b)


@pytest.mark.parametrize("resolution", [32, 64])
def test_layouts_keep_margin_and_gap(resolution):
    world = get_world(resolution)
    recs = make_splits(resolution)["test"]
    n_checked = 0
    for i, rec in enumerate(recs):
        for k in range(3):
            objs = sample_layout(rec, record_rng(0, i, k), world)
            # exactly the requested objects, with the requested colours
            want = Counter()
            for c in rec["include"]:
                want[c["class"]] += c["count"]
                if c.get("color"):
                    assert all(o.color == c["color"] for o in objs if o.shape == c["class"]), rec["prompt"]
            assert Counter(o.shape for o in objs) == want, rec["prompt"]
            assert all(o.color in COLORS for o in objs)
            lo, hi = world.size_range_crowded if len(objs) >= 3 else world.size_range
            assert all(lo <= o.sx <= hi and o.sx == o.sy for o in objs)
            _check_layout(objs, world)
            n_checked += 1
    assert n_checked == 3 * len(recs)


@pytest.mark.parametrize("resolution", [32, 64])
def test_position_layouts_satisfy_geneval_with_margin(resolution):
    world = get_world(resolution)
    recs = [r for r in make_splits(resolution)["test"] if r["tag"] == "position"]
    axis_of = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}
    for i, rec in enumerate(recs):
        ref, obj = rec["include"]
        rel = obj["position"][0]
        for k in range(4):
            objs = sample_layout(rec, record_rng(1, i, k), world)
            a = next(o for o in objs if o.shape == obj["class"])
            b = next(o for o in objs if o.shape == ref["class"])
            rels, d = geneval_relations(a.box, b.box)
            assert rel in rels, (rec["prompt"], a.box, b.box)
            ax, sign = axis_of[rel]
            assert sign * d[ax] >= POSITION_MARGIN - 1e-9
            # the image y axis points down: "above" means a smaller y centre
            if rel == "above":
                assert a.cy < b.cy
            if rel == "left of":
                assert a.cx < b.cx


def test_counting_four_objects_fit():
    world = get_world(32)
    rec = make_record("counting", [{"class": "cross", "count": 4}])
    for k in range(20):
        objs = sample_layout(rec, record_rng(0, 0, k), world)
        assert len(objs) == 4
        _check_layout(objs, world)
