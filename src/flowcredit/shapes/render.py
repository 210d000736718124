"""Deterministic, anti-aliased ground-truth renderer for shapes-world metadata records.

Design: SHAPES_BENCHMARK.md §4.4. Each shape is defined inside the box [−1, 1]² so that the box is the object's
tight bounding box (needed by GenEval's box-based position rule and by template matching). Coverage is computed
on an ss×ss supersampled grid and averaged; the colour is composited over the gray background:
img = bg·(1 − α) + colour·α. Only elementwise float64 operations are used, so the same seed gives the same bytes.

Coordinates: x to the right, y DOWN (image convention, as GenEval's boxes). Pixel (row i, col j) covers
[j, j+1) × [i, i+1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .vocab import BACKGROUND, COLOR_NAMES, COLORS, RELATIONS, World, get_world

CROSS_ARM = 0.36  # half-width of the cross arms, in box units (the arm is 36% of the half-size)


@dataclass(frozen=True)
class Obj:
    """One object to draw: shape, colour name, centre (cx, cy) and half-sizes (sx, sy) in pixels."""

    shape: str
    color: str
    cx: float
    cy: float
    sx: float
    sy: float

    @property
    def box(self) -> tuple[float, float, float, float]:
        """Exact box [x0, y0, x1, y1] in continuous pixel coordinates."""
        return (self.cx - self.sx, self.cy - self.sy, self.cx + self.sx, self.cy + self.sy)


def inside(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Membership of points (u, v) ∈ [−1, 1]² (v down) in the unit shape. Returns a bool array like u."""
    if shape == "circle":
        return u * u + v * v <= 1.0
    if shape == "square":
        return (np.abs(u) <= 1.0) & (np.abs(v) <= 1.0)
    if shape == "triangle":  # apex up: (0, −1), base from (−1, 1) to (1, 1)
        return (v <= 1.0) & (np.abs(u) <= (v + 1.0) / 2.0)
    if shape == "cross":  # plus sign
        a = CROSS_ARM
        return ((np.abs(u) <= a) & (np.abs(v) <= 1.0)) | ((np.abs(v) <= a) & (np.abs(u) <= 1.0))
    if shape == "diamond":
        return np.abs(u) + np.abs(v) <= 1.0
    raise ValueError(f"unknown shape '{shape}'; valid shapes: circle, square, triangle, cross, diamond")


def coverage(
    shape: str, cx: float, cy: float, sx: float, sy: float, height: int, width: int, ss: int = 4
) -> np.ndarray:
    """Anti-aliased coverage α ∈ [0, 1] of one shape on an (height, width) pixel grid.

    Args:
        shape: shape name.
        cx, cy: centre in pixels; sx, sy: half-sizes in pixels (the box is [cx−sx, cx+sx] × [cy−sy, cy+sy]).
        height, width: canvas size.
        ss: supersampling factor per axis.

    Returns:
        (height, width) float64 coverage.
    """
    out = np.zeros((height, width), dtype=np.float64)
    x0 = max(int(np.floor(cx - sx)), 0)
    x1 = min(int(np.ceil(cx + sx)), width)
    y0 = max(int(np.floor(cy - sy)), 0)
    y1 = min(int(np.ceil(cy + sy)), height)
    if x1 <= x0 or y1 <= y0:
        return out
    offs = (np.arange(ss) + 0.5) / ss
    xs = (np.arange(x0, x1)[:, None] + offs[None, :]).reshape(-1)  # (nx·ss,)
    ys = (np.arange(y0, y1)[:, None] + offs[None, :]).reshape(-1)  # (ny·ss,)
    u = (xs[None, :] - cx) / sx
    v = (ys[:, None] - cy) / sy
    mask = inside(shape, np.broadcast_to(u, (ys.size, xs.size)), np.broadcast_to(v, (ys.size, xs.size)))
    cov = mask.reshape(y1 - y0, ss, x1 - x0, ss).mean(axis=(1, 3))
    out[y0:y1, x0:x1] = cov
    return out


def render_objects(objects: Sequence[Obj], resolution: int, ss: int = 4) -> np.ndarray:
    """Composite objects over the gray background.

    Returns:
        (resolution, resolution, 3) uint8 RGB image.
    """
    img = np.empty((resolution, resolution, 3), dtype=np.float64)
    img[:] = np.asarray(BACKGROUND, dtype=np.float64)
    for o in objects:
        a = coverage(o.shape, o.cx, o.cy, o.sx, o.sy, resolution, resolution, ss)[..., None]
        img = img * (1.0 - a) + np.asarray(COLORS[o.color], dtype=np.float64) * a
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------------------
# Layout sampling
# ---------------------------------------------------------------------------------------------------------------


def relative_position(
    box_a: Sequence[float], box_b: Sequence[float], threshold: float = 0.1
) -> tuple[set[str], tuple[float, float]]:
    """GenEval's `relative_position(A, B)` on [x0, y0, x1, y1] boxes (SHAPES_BENCHMARK.md §1.3).

    Returns:
        (relations of A with respect to B, (dx, dy) normalised revised offset). Empty set if too close.
    """
    ca = np.array([(box_a[0] + box_a[2]) / 2, (box_a[1] + box_a[3]) / 2])
    cb = np.array([(box_b[0] + box_b[2]) / 2, (box_b[1] + box_b[3]) / 2])
    dim_a = np.array([box_a[2] - box_a[0], box_a[3] - box_a[1]])
    dim_b = np.array([box_b[2] - box_b[0], box_b[3] - box_b[1]])
    offset = ca - cb
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
    return rels, (float(dx), float(dy))


RELATION_AXIS = {"left of": (0, -1.0), "right of": (0, 1.0), "above": (1, -1.0), "below": (1, 1.0)}
POSITION_MARGIN = 0.7  # ground truth needs the normalised offset ≥ 0.7 along the relation axis (GenEval needs 0.5)


def _boxes_ok(
    boxes: list[tuple[float, float, float, float]], new: tuple[float, float, float, float], gap: float
) -> bool:
    for b in boxes:
        # max-norm gap between boxes: separated along x or y by at least `gap`
        sep_x = max(b[0] - new[2], new[0] - b[2])
        sep_y = max(b[1] - new[3], new[1] - b[3])
        if max(sep_x, sep_y) < gap:
            return False
    return True


class LayoutError(RuntimeError):
    """No valid layout was found for a record (too many objects for the canvas)."""


def sample_layout(record: dict[str, Any], rng: np.random.Generator, world: World, max_tries: int = 2000) -> list[Obj]:
    """Sample object boxes and colours that satisfy a GenEval-schema record exactly.

    Every include clause contributes `count` objects of its class; clauses with a colour use it, the others get a
    random palette colour per object (so the model learns that colour is independent of shape). Boxes keep a
    margin to the border and `world.min_gap` between each other; a `position` clause is rejection-sampled until
    GenEval's own rule holds with the normalised offset ≥ POSITION_MARGIN along the relation axis.
    """
    specs: list[tuple[int, str, str | None]] = []
    for ci, clause in enumerate(record["include"]):
        for _ in range(int(clause["count"])):
            specs.append((ci, clause["class"], clause.get("color")))
    n = len(specs)
    lo, hi = world.size_range_crowded if n >= 3 else world.size_range
    res = world.resolution
    for _ in range(max_tries):
        objs: list[Obj] = []
        boxes: list[tuple[float, float, float, float]] = []
        ok = True
        for _, shape, color in specs:
            s = float(rng.uniform(lo, hi))
            placed = False
            for _ in range(50):
                cx = float(rng.uniform(world.margin + s, res - world.margin - s))
                cy = float(rng.uniform(world.margin + s, res - world.margin - s))
                box = (cx - s, cy - s, cx + s, cy + s)
                if _boxes_ok(boxes, box, world.min_gap):
                    placed = True
                    break
            if not placed:
                ok = False
                break
            col = color if color is not None else COLOR_NAMES[int(rng.integers(len(COLOR_NAMES)))]
            objs.append(Obj(shape, col, cx, cy, s, s))
            boxes.append(box)
        if not ok:
            continue
        if _positions_ok(record, specs, boxes):
            return objs
    raise LayoutError(f"no layout found for prompt '{record.get('prompt', '')}' after {max_tries} tries")


def _positions_ok(record: dict[str, Any], specs: list[tuple[int, str, str | None]], boxes: list) -> bool:
    clause_boxes: dict[int, list] = {}
    for (ci, _, _), b in zip(specs, boxes):
        clause_boxes.setdefault(ci, []).append(b)
    for ci, clause in enumerate(record["include"]):
        pos = clause.get("position")
        if not pos:
            continue
        rel, ref = pos[0], int(pos[1])
        axis, sign = RELATION_AXIS[rel]
        for ba in clause_boxes[ci]:
            for bb in clause_boxes[ref]:
                rels, d = relative_position(ba, bb)
                if rel not in rels or sign * d[axis] < POSITION_MARGIN:
                    return False
    return True


def record_rng(seed: int, index: int, sample: int = 0) -> np.random.Generator:
    """The generator for (global seed, record index, sample index) — SHAPES_BENCHMARK.md §4.4 determinism."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(index), int(sample)]))


def render_record(
    record: dict[str, Any], seed: int = 0, index: int = 0, sample: int = 0, resolution: int = 32
) -> np.ndarray:
    """Render one ground-truth image for a GenEval-schema record. Same arguments → same bytes.

    Returns:
        (resolution, resolution, 3) uint8 RGB.
    """
    world = get_world(resolution)
    objs = sample_layout(record, record_rng(seed, index, sample), world)
    return render_objects(objs, resolution)


def render_batch(records: Sequence[dict[str, Any]], rng: np.random.Generator, resolution: int = 32) -> np.ndarray:
    """Render one random layout per record with a shared generator (used by pretraining).

    Returns:
        (N, resolution, resolution, 3) uint8.
    """
    world = get_world(resolution)
    return np.stack([render_objects(sample_layout(r, rng, world), resolution) for r in records])


__all__ = [
    "Obj",
    "LayoutError",
    "RELATIONS",
    "coverage",
    "inside",
    "record_rng",
    "relative_position",
    "render_batch",
    "render_objects",
    "render_record",
    "sample_layout",
]
