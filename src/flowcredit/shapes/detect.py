"""Rule-based object detector for shapes-world images (SHAPES_BENCHMARK.md §4.5, §4.8).

Pipeline, for a uint8 RGB (H, W, 3) image:

1. **Background unmixing**, vectorised over all pixels. For pixel p, background b and palette colour c_k with
   d_k = c_k − b: α_k = clip(((p−b)·d_k)/|d_k|², 0, 1), residual e_k = |p − b − α_k d_k|, label k* = argmin_k e_k.
   A pixel is *foreground* iff α_{k*} ≥ 0.49 and e_{k*} ≤ 60: anti-aliased edges lie on the background→colour
   segment, so they keep the right colour (naive nearest-palette quantisation makes brown rings on red).
   The design value is α ≥ 0.5; we use 0.49 because the renderer's 4×4 supersampling makes coverage exactly 8/16
   common, and uint8 rounding puts such a pixel at α = 0.5 for some colours and at 0.5 − 1/(2·117) for others
   (white: 128 + 0.5·117 = 186.5 rounds to 186). With 0.5 the masks depended on colour parity and a 10-px white
   circle lost its top and bottom rows and read as a square. Rounding moves α by < 0.007; the next coverage level
   is 7/16 = 0.44.
   A pixel that fits no segment (e_{k*} > 60, e.g. an off-palette colour or a mix of two object colours) is
   *off-palette*: it never becomes an object, but its components are unknown blobs / junk.
2. **Connected components** per colour label (scipy.ndimage.label, 4-connectivity), then filters:
   area < min_area (≈ 25% of the smallest ground-truth object: 12 px at 32×32, 32 px at 64×64) → speck;
   touching the image border → border blob (never an object: guards against painting the background);
   area > 50% of the image → giant blob; off-palette → unknown blob; box aspect ratio outside [0.75, 1.33] →
   unknown blob.
3. **Shape classification** by template IoU: each allowed shape is rasterised with `render.coverage` at the
   component's box size (± slack, below), also Gaussian-blurred (σ ∈ {0, 0.7, 1.2}), thresholded at 0.5;
   score = IoU − 0.05·σ. One more template per shape is drawn at the centre and size implied by the soft-mask
   moments (α-weighted centroid and variance over the component and its one-pixel ring), which locates the shape
   to a fraction of a pixel. The best shape is accepted if its score ≥ 0.6, else the component is an unknown blob.

Output (`Detections`): GenEval's structure {shape: [Detection...]} sorted by score (ties: larger area first, then
top-to-bottom, left-to-right), at most 16 per class (GenEval's max_objects), the unknown and border blobs, and the
junk area fraction (pixels of specks, unknown, border and giant blobs over the image area) for the reward guards.
Boxes are [x0, y0, x1, y1] pixel edges of the component (x1, y1 exclusive).

Template slack. A thresholded render does not fill its continuous box exactly (a circle's extreme columns and a
triangle's apex rows fall below 50% coverage) and noise adds one-pixel spurs that widen the box. Sharp templates
are drawn on 44 boxes around the component box (`SHARP_INSETS`: slightly extended, and/or shrunk by 1 px on one or
two sides), blurred ones on the 4 `BASE_INSETS` boxes, plain and extended by σ/2 per side. Measured with a
throwaway sweep of single objects (sizes from the World's ranges, all colours, random sub-pixel positions),
per-object errors / smallest own-vs-best-other IoU margin on clean renders:
32 px: clean 0/12000 (margin 0.067), blur 0.7 + noise 8: 0/600, blur 1.0 + noise 10: 9/600;
64 px: clean 0/5000 (margin 0.120), both degradations 0/750.
Without the shrunk boxes, blur 1.0 + noise 10 at 32 px gave ~50/600 errors (noise spurs made squares read as
circles); without the moment templates 17/600.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

import numpy as np
from scipy import ndimage

from .geneval import Detection
from .render import coverage
from .vocab import BACKGROUND, COLOR_NAMES, COLORS, World, get_world

# Unmixing constants.
_B = np.asarray(BACKGROUND, dtype=np.float64)
_D = np.asarray([COLORS[c] for c in COLOR_NAMES], dtype=np.float64) - _B  # (K, 3) background → colour
_DD = (_D * _D).sum(axis=1)  # |d_k|²
OFF_PALETTE = len(COLOR_NAMES)  # label value of off-palette pixels

# Template boxes as insets (left, right, top, bottom) in px from the component box. Negative = the template extends
# past the box (thresholding drops a circle's extreme columns and a triangle's apex rows); positive = it stops short
# of it (a one-pixel noise spur, or a half-covered edge column, widened the box by one pixel).
BASE_INSETS: tuple[tuple[float, float, float, float], ...] = (
    (0.0, 0.0, 0.0, 0.0),
    (-0.25, -0.25, -0.25, -0.25),
    (0.0, 0.0, -0.5, 0.0),
    (-0.25, -0.25, -0.75, -0.25),
)
SHRINKS: tuple[tuple[float, float, float, float], ...] = (
    (0.0, 0.0, 0.0, 0.0),
    (1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0), (0.0, 0.0, 0.0, 1.0),
    (1.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 1.0), (1.0, 0.0, 1.0, 0.0), (1.0, 0.0, 0.0, 1.0),
    (0.0, 1.0, 1.0, 0.0), (0.0, 1.0, 0.0, 1.0),
)  # fmt: skip
# Sharp (σ = 0) templates use every base inset combined with every shrink (44 boxes); blurred templates use the base
# insets, at the plain box and extended by σ/2 per side (blur eats corners, which shrinks the thresholded box).
SHARP_INSETS: tuple[tuple[float, float, float, float], ...] = tuple(
    sorted({tuple(b[i] + k[i] for i in range(4)) for b in BASE_INSETS for k in SHRINKS})  # type: ignore[misc]
)
MAX_OBJECTS = 16  # GenEval's `max_objects`: at most this many detections per class


def _shape_fill(shape: str) -> float:
    n = 200
    return float(coverage(shape, n / 2, n / 2, n / 2, n / 2, n, n, ss=2).mean())


@dataclass(frozen=True)
class DetectorConfig:
    """Detector thresholds (defaults: SHAPES_BENCHMARK.md §4.5; `for_world` scales min_area).

    Attributes:
        shapes: shape names to detect (the World's shapes).
        min_area: components smaller than this (pixels) are specks.
        alpha_min: foreground needs unmixing α ≥ alpha_min (0.49, not 0.5: see the module docstring).
        residual_max: foreground needs unmixing residual ≤ residual_max (RGB units); above it a pixel is off-palette.
        max_area_frac: components larger than this fraction of the image are giant blobs.
        iou_min: accept the best template if IoU − blur penalty ≥ iou_min.
        blur_sigmas: Gaussian σ (px) of the template variants.
        blur_penalty: score penalty per unit σ.
        aspect_range: accepted box width/height range.
        moment_templates: also score one template per shape fitted to the soft-mask moments.
    """

    shapes: tuple[str, ...]
    min_area: int
    alpha_min: float = 0.49
    residual_max: float = 60.0
    max_area_frac: float = 0.5
    iou_min: float = 0.6
    blur_sigmas: tuple[float, ...] = (0.0, 0.7, 1.2)
    blur_penalty: float = 0.05
    aspect_range: tuple[float, float] = (0.75, 1.33)
    moment_templates: bool = True

    @classmethod
    def for_world(cls, world: World, **overrides) -> DetectorConfig:
        """Config for a World: its shapes, and min_area ≈ 25% of the smallest ground-truth object's area."""
        s_min = min(world.size_range_crowded[0], world.size_range[0])
        smallest = min(_shape_fill(s) for s in world.shapes) * (2.0 * s_min) ** 2
        kw: dict[str, Any] = {"shapes": tuple(world.shapes), "min_area": max(int(np.floor(0.25 * smallest)), 1)}
        kw.update(overrides)
        return cls(**kw)


@cache
def config_for_resolution(resolution: int) -> DetectorConfig:
    """The default detector config of the shapes World at this resolution (32 or 64)."""
    return DetectorConfig.for_world(get_world(resolution))


@dataclass
class Blob:
    """A component that is not a valid object.

    kind: 'border' (touches the image border), 'giant' (> max_area_frac of the image), 'offpalette' (no palette
    colour fits), 'aspect' (box aspect ratio out of range), 'shape' (no template scored ≥ iou_min).
    """

    box: tuple[float, float, float, float]
    area: int
    color: str | None
    kind: str
    shape: str | None = None  # best template, if one was tried
    score: float = 0.0


@dataclass
class Detections:
    """Detector output: GenEval's {class: [Detection]} plus what the reward guards need."""

    detected: dict[str, list[Detection]]
    unknown: list[Blob] = field(default_factory=list)
    border: list[Blob] = field(default_factory=list)
    junk_area_fraction: float = 0.0
    n_specks: int = 0

    def count(self, cls: str) -> int:
        return len(self.detected.get(cls, []))

    @property
    def n_objects(self) -> int:
        return sum(len(v) for v in self.detected.values())

    def details(self) -> dict[str, list[list[float]]]:
        """GenEval's `details` column: {class: [[x0, y0, x1, y1, score], ...]}."""
        return {k: [d.as_detail() for d in v] for k, v in self.detected.items()}


def unmix(
    image: np.ndarray, alpha_min: float = 0.49, residual_max: float = 60.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-pixel background unmixing against every palette colour.

    Returns:
        labels (H, W) int: palette index of foreground pixels, OFF_PALETTE for off-palette pixels, −1 for
        background; alpha (H, W) and residual (H, W) of the chosen colour.
    """
    h, w = image.shape[:2]
    q = image.reshape(-1, 3).astype(np.float64) - _B
    qd = q @ _D.T  # (N, K)
    a = np.clip(qd / _DD, 0.0, 1.0)
    e2 = (q * q).sum(axis=1)[:, None] - 2.0 * a * qd + a * a * _DD
    k = np.argmin(e2, axis=1)
    rows = np.arange(k.size)
    ak = a[rows, k]
    ek = np.sqrt(np.maximum(e2[rows, k], 0.0))
    labels = np.full(k.size, -1, dtype=np.int64)
    fg = (ak >= alpha_min) & (ek <= residual_max)
    labels[fg] = k[fg]
    labels[ek > residual_max] = OFF_PALETTE
    return labels.reshape(h, w), ak.reshape(h, w), ek.reshape(h, w)


def _template_variants(sigmas: tuple[float, ...]) -> list[tuple[tuple[float, float, float, float], float, float]]:
    """(inset, σ, extra extension g) of every template of one shape."""
    out = [(ins, 0.0, 0.0) for ins in SHARP_INSETS] if 0.0 in sigmas else []
    for s in sigmas:
        if s > 0:
            out += [(ins, s, g) for ins in BASE_INSETS for g in (0.0, s / 2.0)]
    return out


@lru_cache(maxsize=256)
def _templates(shapes: tuple[str, ...], h: int, w: int, sigmas: tuple[float, ...], penalty: float):
    """Stacked thresholded templates for an (h, w) box: (T, h·w) float32 masks, their areas, shape index, penalty.

    ~300 templates per box size (≈ 10 ms to build, cached; ~0.4 MB for a 12×12 box).
    """
    pad = 4
    masks, shape_idx, pen = [], [], []
    for si, shape in enumerate(shapes):
        for (il, ir, it, ib), sigma, g in _template_variants(sigmas):
            x0, x1 = il - g, w - ir + g
            y0, y1 = it - g, h - ib + g
            cov = coverage(
                shape, (x0 + x1) / 2 + pad, (y0 + y1) / 2 + pad, (x1 - x0) / 2, (y1 - y0) / 2, h + 2 * pad, w + 2 * pad
            )
            if sigma > 0:
                cov = ndimage.gaussian_filter(cov, sigma, mode="constant")
            masks.append((cov[pad : pad + h, pad : pad + w] >= 0.5).reshape(-1))
            shape_idx.append(si)
            pen.append(penalty * sigma)
    t = np.asarray(masks, dtype=np.float32)
    return t, t.sum(axis=1), np.asarray(shape_idx), np.asarray(pen)


@cache
def _unit_moments(shape: str) -> tuple[float, float, float]:
    """(centroid v, variance of u, variance of v) of the unit shape in its [−1, 1]² box (v down)."""
    n = 400
    c = coverage(shape, n / 2, n / 2, n / 2, n / 2, n, n, ss=1)
    g = (np.arange(n) + 0.5 - n / 2) / (n / 2)
    a = c.sum()
    mu = float((c.sum(axis=0) * g).sum() / a)
    mv = float((c.sum(axis=1) * g).sum() / a)
    vu = float((c.sum(axis=0) * (g - mu) ** 2).sum() / a)
    vv = float((c.sum(axis=1) * (g - mv) ** 2).sum() / a)
    return mv, vu, vv


def _moment_scores(mask: np.ndarray, soft: np.ndarray, config: DetectorConfig, pad: int = 3) -> np.ndarray:
    """Template IoU with each shape drawn at the box implied by the soft-mask moments (sub-pixel centre and size).

    `soft` is the unmixing α of the component's colour on the box grown by one pixel per side (zero off the
    component and its one-pixel ring), so anti-aliased edges locate the shape to a fraction of a pixel.
    """
    h, w = mask.shape
    a = soft
    A = float(a.sum())
    if A <= 0:
        return np.full(len(config.shapes), -1.0)
    ys = np.arange(h + 2) + 0.5 - 1.0  # soft grid coordinates in the mask's frame
    xs = np.arange(w + 2) + 0.5 - 1.0
    ax, ay = a.sum(axis=0), a.sum(axis=1)
    mx, my = float((ax * xs).sum() / A), float((ay * ys).sum() / A)
    vx = float((ax * (xs - mx) ** 2).sum() / A) - 1.0 / 12.0  # remove the pixel box-filter variance
    vy = float((ay * (ys - my) ** 2).sum() / A) - 1.0 / 12.0
    m = np.zeros((h + 2 * pad, w + 2 * pad), dtype=bool)
    m[pad : pad + h, pad : pad + w] = mask
    m_area = int(mask.sum())
    out = np.empty(len(config.shapes))
    for i, shape in enumerate(config.shapes):
        cv, vu, vv = _unit_moments(shape)
        sx, sy = np.sqrt(max(vx, 0.25) / vu), np.sqrt(max(vy, 0.25) / vv)
        cov = coverage(shape, mx + pad, my - cv * sy + pad, sx, sy, h + 2 * pad, w + 2 * pad)
        t = cov >= 0.5
        inter = int(np.count_nonzero(t & m))
        out[i] = inter / max(int(np.count_nonzero(t)) + m_area - inter, 1)
    return out


def classify(
    mask: np.ndarray, config: DetectorConfig, soft: np.ndarray | None = None
) -> tuple[str | None, float, dict[str, float]]:
    """Best shape for a box-local component mask by template IoU.

    Args:
        mask: (h, w) bool component mask cropped to its box.
        config: detector config.
        soft: optional (h + 2, w + 2) unmixing α of the component colour around the box; adds one template per
            shape fitted to the soft-mask moments.

    Returns:
        (shape or None if the best score < iou_min, best score, {shape: best score}).
    """
    h, w = mask.shape
    t, t_area, shape_idx, pen = _templates(config.shapes, h, w, tuple(config.blur_sigmas), config.blur_penalty)
    m = mask.reshape(-1).astype(np.float32)
    inter = t @ m
    union = t_area + m.sum() - inter
    score = inter / np.maximum(union, 1.0) - pen
    best_per = np.array([score[shape_idx == i].max() for i in range(len(config.shapes))])
    if soft is not None:
        best_per = np.maximum(best_per, _moment_scores(mask, soft, config))
    per_shape = {s: float(best_per[i]) for i, s in enumerate(config.shapes)}
    best = max(config.shapes, key=lambda s: per_shape[s])  # ties: first shape in World order
    return (best if per_shape[best] >= config.iou_min else None), per_shape[best], per_shape


def _soft_window(
    img: np.ndarray, cc: np.ndarray, idx: int, labels: np.ndarray, k: int, y0: int, y1: int, x0: int, x1: int
) -> np.ndarray:
    # α of colour k on the box grown by one pixel (the component is never on the border here), kept on the
    # component and on its background ring pixels (anti-aliased edges), zero elsewhere.
    win = (slice(y0 - 1, y1 + 1), slice(x0 - 1, x1 + 1))
    comp = cc[win] == idx
    ring = ndimage.binary_dilation(comp) & ~comp & (labels[win] < 0)
    q = img[win].reshape(-1, 3).astype(np.float64) - _B
    a = np.clip(q @ _D[k] / _DD[k], 0.0, 1.0).reshape(comp.shape)
    return a * (comp | ring)


def detect(image: np.ndarray, config: DetectorConfig | None = None) -> Detections:
    """Detect shapes in one uint8 RGB image (H, W, 3).

    Args:
        image: uint8 RGB, H×W×3 (H = W = a World resolution unless `config` is given).
        config: detector thresholds; default `config_for_resolution(H)`.

    Returns:
        Detections.
    """
    img = np.asarray(image)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"detect expects an (H, W, 3) RGB image, got shape {img.shape}")
    if img.dtype != np.uint8:
        raise ValueError(f"detect expects a uint8 image, got {img.dtype}; convert floats in [0, 1] with to_uint8")
    H, W = img.shape[:2]
    cfg = config if config is not None else config_for_resolution(H)
    labels, _, _ = unmix(img, cfg.alpha_min, cfg.residual_max)
    max_area = cfg.max_area_frac * H * W
    lo_ar, hi_ar = cfg.aspect_range
    detected: dict[str, list[Detection]] = {}
    unknown: list[Blob] = []
    border: list[Blob] = []
    junk = 0
    n_specks = 0
    for lv in np.unique(labels[labels >= 0]):
        cc, n = ndimage.label(labels == lv)
        if n == 0:
            continue
        areas = np.bincount(cc.ravel(), minlength=n + 1)
        color = COLOR_NAMES[lv] if lv != OFF_PALETTE else None
        for idx, sl in enumerate(ndimage.find_objects(cc), start=1):
            area = int(areas[idx])
            if area < cfg.min_area:
                junk += area
                n_specks += 1
                continue
            y0, y1, x0, x1 = sl[0].start, sl[0].stop, sl[1].start, sl[1].stop
            box = (float(x0), float(y0), float(x1), float(y1))
            if x0 == 0 or y0 == 0 or x1 == W or y1 == H:
                border.append(Blob(box, area, color, "border"))
                junk += area
                continue
            if area > max_area:
                unknown.append(Blob(box, area, color, "giant"))
                junk += area
                continue
            if color is None:
                unknown.append(Blob(box, area, None, "offpalette"))
                junk += area
                continue
            h, w = y1 - y0, x1 - x0
            if not (lo_ar <= w / h <= hi_ar):
                unknown.append(Blob(box, area, color, "aspect"))
                junk += area
                continue
            mask = cc[sl] == idx
            soft = _soft_window(img, cc, idx, labels, lv, y0, y1, x0, x1) if cfg.moment_templates else None
            shape, score, per_shape = classify(mask, cfg, soft)
            if shape is None:
                best = max(per_shape, key=lambda name: per_shape[name])
                unknown.append(Blob(box, area, color, "shape", best, score))
                junk += area
                continue
            detected.setdefault(shape, []).append(Detection(box, score, color, mask, shape, area))
    for k in detected:
        detected[k].sort(key=lambda d: (-d.score, -d.area, d.box[1], d.box[0]))
        del detected[k][MAX_OBJECTS:]
    return Detections(detected, unknown, border, junk / float(H * W), n_specks)


__all__ = [
    "Blob",
    "DetectorConfig",
    "Detections",
    "OFF_PALETTE",
    "classify",
    "config_for_resolution",
    "detect",
    "unmix",
]
