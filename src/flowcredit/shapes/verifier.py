"""Shapes-GenEval verifier: GenEval-parity correctness, a strict flag and a dense RL reward (SHAPES_BENCHMARK.md §4.6).

For one image and its GenEval-schema record, `verify` runs the rule-based detector (`detect.py`) and returns:

* `correct` — GenEval's own decision (`geneval.evaluate`): include "≥ count" on the top-count detections, colour
  on the top-count objects, position on every pair, exclude.
* `strict` — `correct` AND exactly `count` detections for every include clause (Flow-GRPO's strict) AND no valid
  objects of classes the prompt does not ask for AND no unknown or border blobs.
* `reward` ∈ [0, 1] — 1 if strict, else 0.9·base·guards, so a fully correct image always ranks first in a group:
    - count term per include clause: max(0, 1 − |n − c| / c), n = all detections of the class;
    - colour term per colour clause: min(#right-coloured, c) / c, but 0 when n ≠ c (the §4.7 stricter variant:
      duplicated objects get no colour credit);
    - position term: 1 if GenEval's relation holds for every pair of the top-count groups, else
      0.5·clip((v + 1) / 1.5, 0, 1) with v the smallest signed normalised revised offset along the requested
      axis (GenEval passes iff v > 0.5), so failures score < 0.5 with a slope toward the right side; 0 if the
      object or its reference is missing;
    - base = mean(terms);
    - guards = 1/(1 + #valid objects of non-requested classes) × (1 − 0.5·#unknown-or-border blobs)₊
      × (1 − 4·junk_area_fraction)₊.

`verify_batch` accepts a float tensor (B, 3, H, W) in [0, 1] (converted like Flow-GRPO: ×255, round, clamp), or
uint8 arrays (B, H, W, 3) / a list of (H, W, 3) arrays. `write_results_jsonl` writes GenEval's results.jsonl
columns plus `strict` and `reward`, so GenEval's `summary_scores.py` can read our files.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .detect import Detections, DetectorConfig, config_for_resolution, detect
from .geneval import evaluate
from .render import RELATION_AXIS, relative_position
from .vocab import TAGS, World, check_color, check_shape, get_world

STRICT_REWARD = 1.0
NON_STRICT_SCALE = 0.9  # non-strict rewards are ≤ 0.9, so a strict image always ranks first
EXTRA_BLOB_PENALTY = 0.5  # per unknown or border blob
JUNK_PENALTY = 4.0  # per unit junk area fraction


@dataclass
class VerifyResult:
    """Verifier output for one image.

    Attributes:
        correct: GenEval parity.
        strict: correct + exact counts + no extra objects + no unknown/border blobs.
        reward: dense reward in [0, 1] (1 iff strict).
        terms: per-clause terms, e.g. {"count[0]": 1.0, "color[0]": 1.0, "position[1]": 0.33}.
        reason: one line describing what was wrong ("" if strict).
        details: GenEval's details {class: [[x0, y0, x1, y1, score], ...]}.
        guards: the multiplicative guards {"extra", "blobs", "junk"} and the counts behind them.
        tag, prompt, metadata: copied from the record (for results rows and summaries).
    """

    correct: bool
    strict: bool
    reward: float
    terms: dict[str, float]
    reason: str
    details: dict[str, list[list[float]]]
    guards: dict[str, float] = field(default_factory=dict)
    tag: str = ""
    prompt: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def check_record(record: Mapping[str, Any], world: World) -> None:
    """Raise ValueError naming the valid shapes/colours if the record uses a name outside the World."""
    where = record.get("prompt", "")
    if not record.get("include"):
        raise ValueError(
            f"record {where!r} has no 'include' clauses; the shapes verifier needs GenEval-schema metadata "
            "(tag, include=[{class, count, color?, position?}], exclude?, prompt)"
        )
    for cl in list(record.get("include", [])) + list(record.get("exclude", []) or []):
        check_shape(cl["class"], world, where)
        if cl.get("color") is not None:
            check_color(cl["color"], where)


def _position_term(found_a: list, found_b: list, relation: str) -> tuple[float, bool]:
    axis, sign = RELATION_AXIS[relation]
    v_min = math.inf
    holds = True
    for a in found_a:
        for b in found_b:
            rels, d = relative_position(a.box, b.box)
            holds = holds and relation in rels
            v_min = min(v_min, sign * d[axis])
    if holds:
        return 1.0, True
    return 0.5 * float(np.clip((v_min + 1.0) / 1.5, 0.0, 1.0)), False


def score_detections(det: Detections, record: Mapping[str, Any]) -> VerifyResult:
    """Score detector output against a record (no vocabulary check; `verify` does it)."""
    ev = evaluate(det.detected, record)
    include = list(record.get("include", []))
    exclude = list(record.get("exclude", []) or [])
    terms: dict[str, float] = {}
    exact = True
    problems: list[str] = [r for r in ev.reason.split("\n") if r]
    for i, cl in enumerate(include):
        cls, c = cl["class"], int(cl["count"])
        dets = det.detected.get(cls, [])
        n = len(dets)
        terms[f"count[{i}]"] = max(0.0, 1.0 - abs(n - c) / c)
        if n != c:
            exact = False
            excluded = any(ex["class"] == cls and n >= int(ex["count"]) for ex in exclude)
            if n > c and not excluded:  # n < c is already in GenEval's reason
                problems.append(f"expected {cls}=={c}, found {n}")
        if cl.get("color") is not None:
            right = sum(1 for d in dets if d.color == cl["color"])
            terms[f"color[{i}]"] = min(right, c) / c if n == c else 0.0
        if cl.get("position"):
            rel, ref = cl["position"][0], int(cl["position"][1])
            ref_cl = include[ref]
            found_a = dets[:c]
            found_b = det.detected.get(ref_cl["class"], [])[: int(ref_cl["count"])]
            if len(found_a) < c or len(found_b) < int(ref_cl["count"]):
                terms[f"position[{i}]"] = 0.0
            else:
                terms[f"position[{i}]"] = _position_term(found_a, found_b, rel)[0]
    requested = {cl["class"] for cl in include}
    extras = {k: len(v) for k, v in det.detected.items() if k not in requested and v}
    n_extra = sum(extras.values())
    n_blobs = len(det.unknown) + len(det.border)
    if n_extra:
        problems.append("extra objects: " + ", ".join(f"{k}x{v}" for k, v in extras.items()))
    if det.unknown:
        kinds = ", ".join(sorted({b.kind for b in det.unknown}))
        problems.append(f"{len(det.unknown)} unknown blob(s) ({kinds})")
    if det.border:
        problems.append(f"{len(det.border)} border blob(s)")
    if det.junk_area_fraction > 0:
        problems.append(f"junk area {det.junk_area_fraction:.1%}")
    g_extra = 1.0 / (1.0 + n_extra)
    g_blobs = max(0.0, 1.0 - EXTRA_BLOB_PENALTY * n_blobs)
    g_junk = max(0.0, 1.0 - JUNK_PENALTY * det.junk_area_fraction)
    base = float(np.mean(list(terms.values()))) if terms else 0.0
    strict = bool(ev.correct and exact and n_extra == 0 and n_blobs == 0)
    reward = STRICT_REWARD if strict else NON_STRICT_SCALE * base * g_extra * g_blobs * g_junk
    guards = {
        "extra": g_extra,
        "blobs": g_blobs,
        "junk": g_junk,
        "n_extra": float(n_extra),
        "n_blobs": float(n_blobs),
        "junk_area_fraction": float(det.junk_area_fraction),
        "base": base,
    }
    return VerifyResult(
        correct=bool(ev.correct),
        strict=strict,
        reward=float(reward),
        terms=terms,
        reason="; ".join(problems) if not strict else "",
        details=det.details(),
        guards=guards,
        tag=str(record.get("tag", "")),
        prompt=str(record.get("prompt", "")),
        metadata=dict(record),
    )


def verify(image: np.ndarray, record: Mapping[str, Any], config: DetectorConfig | None = None) -> VerifyResult:
    """Verify one uint8 RGB image (H, W, 3) against a GenEval-schema record.

    Raises:
        ValueError: the record names a shape or colour outside the World of this resolution (the message lists
            the valid ones), or the image is not (H, W, 3) uint8.
    """
    img = np.asarray(image)
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ValueError(
            f"verify expects a uint8 (H, W, 3) image, got {img.dtype} {img.shape}; use verify_batch for tensors"
        )
    if img.shape[0] != img.shape[1]:
        raise ValueError(f"shapes-world images are square, got {img.shape[0]}x{img.shape[1]}")
    world = get_world(img.shape[0])
    check_record(record, world)
    det = detect(img, config if config is not None else config_for_resolution(img.shape[0]))
    return score_detections(det, record)


def to_uint8_images(images: Any) -> list[np.ndarray]:
    """Convert a batch to a list of uint8 (H, W, 3) arrays.

    Accepts a torch tensor (B, 3, H, W) — float in [0, 1] (×255, round, clamp, as Flow-GRPO) or uint8 — a numpy
    array (B, H, W, 3) uint8 (or float in [0, 1]), or a list of (H, W, 3) arrays.
    """
    if hasattr(images, "detach") and hasattr(images, "cpu"):  # torch tensor, without importing torch here
        t = images.detach().cpu()
        if t.ndim != 4 or t.shape[1] != 3:
            raise ValueError(f"expected a (B, 3, H, W) tensor, got shape {tuple(t.shape)}")
        if t.is_floating_point():
            from ..types import to_uint8_hwc  # torch is loaded: `images` is a tensor

            arr = to_uint8_hwc(t).numpy()
        else:
            arr = t.numpy().astype(np.uint8).transpose(0, 2, 3, 1)
        return [np.ascontiguousarray(a) for a in arr]
    if isinstance(images, np.ndarray):
        if images.ndim == 3:
            images = images[None]
        seq = list(images)
    else:
        seq = list(images)
    out = []
    for a in seq:
        a = np.asarray(a)
        if a.ndim != 3 or a.shape[-1] != 3:
            raise ValueError(f"expected (H, W, 3) images, got shape {a.shape}")
        if a.dtype != np.uint8:
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(f"expected uint8 or float images in [0, 1], got {a.dtype}")
            a = np.clip(np.rint(a.astype(np.float64) * 255), 0, 255).astype(np.uint8)
        out.append(np.ascontiguousarray(a))
    return out


def verify_batch(
    images: Any, records: Sequence[Mapping[str, Any]], config: DetectorConfig | None = None
) -> list[VerifyResult]:
    """Verify a batch (see `to_uint8_images` for accepted inputs); one record per image."""
    imgs = to_uint8_images(images)
    if len(imgs) != len(records):
        raise ValueError(f"got {len(imgs)} images but {len(records)} records")
    return [verify(im, rec, config) for im, rec in zip(imgs, records)]


def flow_grpo_details(results: Sequence[VerifyResult], name: str = "geneval") -> dict[str, list[float]]:
    """Per-image lists with Flow-GRPO's `score_details` keys for the GenEval reward.

    Keys: `name` (the dense reward), `accuracy` (GenEval correct), `strict_accuracy`, `<tag>_accuracy` and
    `<tag>_strict_accuracy` for every tag present (NaN for images of other tags, instead of Flow-GRPO's −10).
    """
    out: dict[str, list[float]] = {
        name: [r.reward for r in results],
        "accuracy": [float(r.correct) for r in results],
        "strict_accuracy": [float(r.strict) for r in results],
    }
    tags = [t for t in TAGS if any(r.tag == t for r in results)]
    tags += sorted({r.tag for r in results} - set(tags))
    for t in tags:
        out[f"{t}_accuracy"] = [float(r.correct) if r.tag == t else math.nan for r in results]
        out[f"{t}_strict_accuracy"] = [float(r.strict) if r.tag == t else math.nan for r in results]
    return out


def flow_grpo_metrics(results: Sequence[VerifyResult], name: str = "geneval") -> dict[str, float]:
    """Means of `flow_grpo_details` over the images each key applies to (NaN ignored)."""
    return {k: float(np.nanmean(v)) for k, v in flow_grpo_details(results, name).items() if not np.all(np.isnan(v))}


RESULT_COLUMNS = ("filename", "tag", "prompt", "correct", "reason", "metadata", "details", "strict", "reward")


def result_row(result: VerifyResult, filename: str = "", metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One results.jsonl row: GenEval's columns (metadata and details as JSON strings) plus strict and reward."""
    meta = dict(metadata) if metadata is not None else result.metadata
    return {
        "filename": filename,
        "tag": meta.get("tag", result.tag),
        "prompt": meta.get("prompt", result.prompt),
        "correct": bool(result.correct),
        "reason": result.reason,
        "metadata": json.dumps(meta),
        "details": json.dumps(result.details),
        "strict": bool(result.strict),
        "reward": float(result.reward),
    }


def write_results_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any] | VerifyResult]) -> None:
    """Write results.jsonl with GenEval's columns (filename, tag, prompt, correct, reason, metadata, details) plus
    strict and reward. Rows may be VerifyResults or dicts; dict `metadata`/`details` values are JSON-encoded."""
    with open(path, "w") as f:
        for row in rows:
            if isinstance(row, VerifyResult):
                row = result_row(row)
            out = {}
            for col in RESULT_COLUMNS:
                v = row.get(col)
                if col in ("metadata", "details") and not isinstance(v, str):
                    v = json.dumps(v if v is not None else {})
                out[col] = v
            f.write(json.dumps(out) + "\n")


__all__ = [
    "RESULT_COLUMNS",
    "VerifyResult",
    "check_record",
    "flow_grpo_details",
    "flow_grpo_metrics",
    "result_row",
    "score_detections",
    "to_uint8_images",
    "verify",
    "verify_batch",
    "write_results_jsonl",
]
