"""GenEval's decision logic, ported once and detector-agnostic.

This is `evaluate()` from djghosh13/geneval `evaluation/evaluate_images.py` and the numbers printed by
`evaluation/summary_scores.py` (SHAPES_BENCHMARK.md §1.3–§1.4), re-implemented on a plain structure so that the
same code scores the rule-based shapes detector (`detect.py`) or any other detector (e.g. Mask2Former + CLIP):

    detected: {class: [Detection, ...]}   # each list sorted by confidence, highest first

Semantics kept exactly:

* include clauses are AND-ed. For each clause, `found = detected[class][:count]` (the `count` most confident).
  Fewer than `count` → fail ("expected X>=n, found m"). Extra instances of the class are allowed ("at least").
* colour (if the clause has one) is judged on `found` only: the clause fails unless #found with the requested
  colour ≥ count. A wrong-coloured, more confident copy therefore fails the clause even if a right one exists.
* position (only if count and colour passed): "no target" if the reference clause failed; otherwise EVERY object
  of `found` must stand in the relation to EVERY object of the reference group (GenEval's `relative_position`
  with threshold 0.1; a diagonal offset can satisfy two relations at once).
* passing clauses store `found` in `matched_groups`, failing ones store None.
* exclude clauses are OR-ed: the image fails if len(all detections of class) ≥ count.

The one intentional difference: GenEval joins a Python `set` of relations into its position reason, whose order
changes between runs; we list them in the fixed order left of, right of, above, below.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .render import relative_position
from .vocab import COLOR_NAMES, RELATIONS

POSITION_THRESHOLD = 0.1  # GenEval's default `position_threshold`


@dataclass(eq=False)  # identity equality: a numpy mask makes field-wise == ambiguous
class Detection:
    """One detected object, in GenEval's terms.

    Attributes:
        box: [x0, y0, x1, y1] in pixel-edge coordinates (x1, y1 exclusive: a one-pixel object at column 3 spans
            x 3..4), the same convention as a detector's continuous boxes.
        score: confidence; lists in `detected` are sorted by it, highest first.
        color: colour name (the rule-based colour for shapes, or whatever `color_of` should return).
        mask: optional boolean mask (detect.py stores the box-local mask).
        label: the class name (optional; informational).
        area: mask area in pixels (optional; informational).
    """

    box: tuple[float, float, float, float]
    score: float = 1.0
    color: str | None = None
    mask: np.ndarray | None = None
    label: str | None = None
    area: int = 0

    def as_detail(self) -> list[float]:
        """GenEval's `details` entry: [x0, y0, x1, y1, score]."""
        return [float(v) for v in self.box] + [float(self.score)]


class EvalResult(NamedTuple):
    """What `evaluate` returns: unpacks as (correct, reason, matched_groups)."""

    correct: bool
    reason: str
    matched_groups: list[list[Detection] | None]


def _default_color_of(det: Detection) -> str | None:
    return det.color


def _rels_text(rels: set[str]) -> str:
    return " and ".join(r for r in RELATIONS if r in rels)


def evaluate(
    detected: Mapping[str, Sequence[Detection]],
    metadata: Mapping[str, Any],
    color_of: Callable[[Detection], str | None] = _default_color_of,
    position_threshold: float = POSITION_THRESHOLD,
    color_names: Sequence[str] = COLOR_NAMES,
) -> EvalResult:
    """GenEval's `evaluate(image, objects, metadata)` on detector-agnostic detections.

    Args:
        detected: {class: detections sorted by score, highest first}. Absent classes have no detections.
        metadata: a GenEval-schema record (tag, include, exclude?, prompt).
        color_of: colour classifier for one detection (default: `det.color`; GenEval uses CLIP on the crop).
        position_threshold: GenEval's relative dead zone (0.1).
        color_names: colour order used in the colour failure reason (GenEval's COLORS list).

    Returns:
        EvalResult(correct, reason, matched_groups); `reason` joins GenEval's messages with newlines ("" if correct).
    """
    correct = True
    reason: list[str] = []
    matched_groups: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        classname = req["class"]
        count = int(req["count"])
        matched = True
        found = list(detected.get(classname, []))[:count]
        if len(found) < count:
            correct = matched = False
            reason.append(f"expected {classname}>={count}, found {len(found)}")
        else:
            if "color" in req:
                colors = [color_of(o) for o in found]
                n_right = colors.count(req["color"])
                if n_right < count:
                    correct = matched = False
                    reason.append(
                        f"expected {req['color']} {classname}>={count}, found {n_right} {req['color']}; and "
                        + ", ".join(f"{colors.count(c)} {c}" for c in color_names if c in colors)
                    )
            if "position" in req and matched:
                expected_rel, target_group = req["position"][0], int(req["position"][1])
                targets = matched_groups[target_group]
                if targets is None:
                    correct = matched = False
                    reason.append(f"no target for {classname} to be {expected_rel}")
                else:
                    for obj in found:
                        for target in targets:
                            rels, _ = relative_position(obj.box, target.box, position_threshold)
                            if expected_rel not in rels:
                                correct = matched = False
                                reason.append(f"expected {classname} {expected_rel} target, found {_rels_text(rels)} "
                                              "target")
                                break
                        if not matched:
                            break
        matched_groups.append(found if matched else None)
    for req in metadata.get("exclude", []) or []:
        classname = req["class"]
        n = len(detected.get(classname, []))
        if n >= int(req["count"]):
            correct = False
            reason.append(f"expected {classname}<{req['count']}, found {n}")
    return EvalResult(correct, "\n".join(reason), matched_groups)


# ---------------------------------------------------------------------------------------------------------------
# summary_scores.py
# ---------------------------------------------------------------------------------------------------------------


def _get(row: Any, key: str, default: Any = None) -> Any:
    if isinstance(row, Mapping):
        return row.get(key, default)
    return getattr(row, key, default)


def _metadata_key(meta: Any) -> str:
    # GenEval groups by the `metadata` column, a JSON string. Dicts are serialised the way the writer does.
    return meta if isinstance(meta, str) else json.dumps(meta)


def summarize(results: Iterable[Any], keys: Sequence[str] = ("correct", "strict")) -> dict[str, Any]:
    """GenEval's `summary_scores.py` numbers, for `correct` and (when present) `strict`.

    Args:
        results: rows (dicts like results.jsonl lines, or objects) with `tag`, `metadata` (dict or JSON string)
            and the boolean columns named in `keys`.
        keys: which boolean columns to summarise; a key absent from every row is skipped.

    Returns:
        {"total_images": N, "total_prompts": P, key: {"images": % correct images, "prompts": % correct prompts
        (any image of the prompt correct), "tags": {tag: {"accuracy", "correct", "total"}} (order of first
        appearance), "overall": UNWEIGHTED mean of the per-tag accuracies}} — fractions in [0, 1].
    """
    rows = list(results)
    out: dict[str, Any] = {"total_images": len(rows)}
    prompt_keys = [_metadata_key(_get(r, "metadata")) for r in rows]
    out["total_prompts"] = len(set(prompt_keys))
    tags = [_get(r, "tag") for r in rows]
    for key in keys:
        vals = [_get(r, key) for r in rows]
        if not rows or all(v is None for v in vals):
            continue
        vals_b = [bool(v) for v in vals]
        per_prompt: dict[str, bool] = {}
        for pk, v in zip(prompt_keys, vals_b):
            per_prompt[pk] = per_prompt.get(pk, False) or v
        per_tag: dict[str, list[bool]] = {}
        for t, v in zip(tags, vals_b):
            per_tag.setdefault(t, []).append(v)
        tag_stats = {
            t: {"accuracy": float(np.mean(v)), "correct": int(sum(v)), "total": len(v)} for t, v in per_tag.items()
        }
        out[key] = {
            "images": float(np.mean(vals_b)),
            "prompts": float(np.mean(list(per_prompt.values()))),
            "tags": tag_stats,
            "overall": float(np.mean([s["accuracy"] for s in tag_stats.values()])),
        }
    return out


def format_summary(summary: Mapping[str, Any], key: str = "correct") -> str:
    """The text `summary_scores.py` prints, for one of the summarised columns."""
    s = summary[key]
    lines = [
        "Summary",
        "=======",
        f"Total images: {summary['total_images']}",
        f"Total prompts: {summary['total_prompts']}",
        f"% correct images: {s['images']:.2%}",
        f"% correct prompts: {s['prompts']:.2%}",
        "",
        "Task breakdown",
        "==============",
    ]
    for tag, t in s["tags"].items():
        lines.append(f"{tag:<16} = {t['accuracy']:.2%} ({t['correct']} / {t['total']})")
    lines += ["", f"Overall score (avg. over tasks): {s['overall']:.5f}"]
    return "\n".join(lines)


__all__ = ["Detection", "EvalResult", "POSITION_THRESHOLD", "evaluate", "format_summary", "summarize"]
