"""GenEval's evaluate() port and summary_scores.py on hand-built detections (SHAPES_BENCHMARK.md §1.3, §1.4, §4.8)."""

from __future__ import annotations

import json

import pytest

from flowcredit.shapes.geneval import Detection, evaluate, format_summary, summarize
from flowcredit.shapes.render import relative_position


def D(x0, y0, x1, y1, score=0.9, color=None):
    return Detection((x0, y0, x1, y1), score, color)


def rec(tag, include, exclude=None):
    r = {"tag": tag, "include": include, "prompt": "p"}
    if exclude is not None:
        r["exclude"] = exclude
    return r


# ---------------------------------------------------------------- include / exclude


def test_include_is_at_least_extra_instances_pass():
    r = rec("counting", [{"class": "circle", "count": 2}])  # no exclude: "≥ 2"
    dets = {"circle": [D(0, 0, 5, 5, 0.9), D(10, 0, 15, 5, 0.8), D(20, 0, 25, 5, 0.7)]}
    ok, reason, groups = evaluate(dets, r)
    assert ok and reason == ""
    assert groups[0] == dets["circle"][:2]  # top-count only


def test_include_too_few_fails_with_geneval_reason():
    r = rec("counting", [{"class": "circle", "count": 2}])
    ok, reason, groups = evaluate({"circle": [D(0, 0, 5, 5)]}, r)
    assert not ok and reason == "expected circle>=2, found 1"
    assert groups == [None]
    ok, reason, _ = evaluate({}, r)
    assert reason == "expected circle>=2, found 0"


def test_exclude_counting_two_with_three_found_fails():
    r = rec("counting", [{"class": "circle", "count": 2}], [{"class": "circle", "count": 3}])
    three = {"circle": [D(0, 0, 5, 5), D(10, 0, 15, 5), D(20, 0, 25, 5)]}
    ok, reason, groups = evaluate(three, r)
    assert not ok
    assert reason == "expected circle<3, found 3"
    assert groups[0] is not None  # the include clause itself passed
    two = {"circle": three["circle"][:2]}
    assert evaluate(two, r).correct


def test_exclude_of_absent_class_passes():
    r = rec("counting", [{"class": "circle", "count": 1}], [{"class": "square", "count": 1}])
    assert evaluate({"circle": [D(0, 0, 5, 5)]}, r).correct
    assert not evaluate({"circle": [D(0, 0, 5, 5)], "square": [D(9, 9, 12, 12)]}, r).correct


# ---------------------------------------------------------------- colour on the top-count objects only


def test_topk_colour_wrong_coloured_higher_confidence_copy_fails():
    r = rec("colors", [{"class": "circle", "count": 1, "color": "red"}])
    wrong_first = {"circle": [D(0, 0, 5, 5, 0.95, "blue"), D(10, 0, 15, 5, 0.80, "red")]}
    ok, reason, groups = evaluate(wrong_first, r)
    assert not ok
    assert reason == "expected red circle>=1, found 0 red; and 1 blue"
    assert groups == [None]
    right_first = {"circle": [D(0, 0, 5, 5, 0.95, "red"), D(10, 0, 15, 5, 0.80, "blue")]}
    assert evaluate(right_first, r).correct  # the extra blue copy is never looked at


def test_colour_count_two_needs_both_right():
    r = rec("colors", [{"class": "square", "count": 2, "color": "green"}])
    dets = {"square": [D(0, 0, 5, 5, 0.9, "green"), D(10, 0, 15, 5, 0.8, "pink"), D(20, 0, 25, 5, 0.7, "green")]}
    ok, reason, _ = evaluate(dets, r)
    assert not ok
    assert reason == "expected green square>=2, found 1 green; and 1 green, 1 pink"  # GenEval's COLORS order


def test_color_of_is_pluggable():
    r = rec("colors", [{"class": "circle", "count": 1, "color": "red"}])
    dets = {"circle": [D(0, 0, 5, 5, 0.9, None)]}
    assert not evaluate(dets, r).correct
    assert evaluate(dets, r, color_of=lambda d: "red").correct


# ---------------------------------------------------------------- position


def pos_rec(rel, ref_cls="square", cls="circle", ref_count=1, count=1, ref_color=None):
    ref = {"class": ref_cls, "count": ref_count}
    if ref_color:
        ref["color"] = ref_color
    return rec("position", [ref, {"class": cls, "count": count, "position": [rel, 0]}])


def test_no_target_when_reference_missing():
    r = pos_rec("left of")
    ok, reason, groups = evaluate({"circle": [D(0, 0, 5, 5)]}, r)
    assert not ok
    assert reason.split("\n") == ["expected square>=1, found 0", "no target for circle to be left of"]
    assert groups == [None, None]


def test_no_target_when_reference_fails_its_colour():
    r = pos_rec("left of", ref_color="red")
    dets = {"square": [D(20, 0, 25, 5, 0.9, "blue")], "circle": [D(0, 0, 5, 5)]}
    ok, reason, _ = evaluate(dets, r)
    assert not ok
    assert reason.split("\n")[1] == "no target for circle to be left of"


def test_diagonal_satisfies_two_relations():
    a, b = (0, 0, 10, 10), (20, 20, 30, 30)  # A up-left of B at 45°
    rels, (dx, dy) = relative_position(a, b)
    assert rels == {"left of", "above"}
    assert dx == pytest.approx(dy) and dx < -0.5
    dets = {"circle": [D(*a)], "square": [D(*b)]}
    assert evaluate(dets, pos_rec("left of")).correct
    assert evaluate(dets, pos_rec("above")).correct
    ok, reason, _ = evaluate(dets, pos_rec("right of"))
    assert not ok and reason == "expected circle right of target, found left of and above target"


def test_position_dead_zone_gives_no_relation():
    # centres 2 px apart with 10-px boxes: |offset| 2 < 0.1·(10 + 10) → too close, empty relation set
    dets = {"circle": [D(0, 0, 10, 10)], "square": [D(2, 0, 12, 10)]}
    ok, reason, _ = evaluate(dets, pos_rec("left of"))
    assert not ok and reason == "expected circle left of target, found  target"


def test_position_every_pair_must_hold():
    r = pos_rec("left of", count=2)
    square = [D(40, 20, 50, 30)]
    both_left = {"square": square, "circle": [D(0, 20, 10, 30, 0.9), D(15, 20, 25, 30, 0.8)]}
    assert evaluate(both_left, r).correct
    one_right = {"square": square, "circle": [D(0, 20, 10, 30, 0.9), D(60, 20, 70, 30, 0.8)]}
    ok, reason, groups = evaluate(one_right, r)
    assert not ok and reason == "expected circle left of target, found right of target"
    assert groups[1] is None and groups[0] == square
    # the third, lower-confidence circle is outside the top-count group and is never checked
    third_ignored = {"square": square, "circle": both_left["circle"] + [D(60, 20, 70, 30, 0.1)]}
    assert evaluate(third_ignored, r).correct
    # every reference object too
    r2 = pos_rec("left of", ref_count=2)
    refs = {"circle": [D(20, 20, 30, 30)], "square": [D(40, 20, 50, 30, 0.9), D(0, 20, 10, 30, 0.8)]}
    assert not evaluate(refs, r2).correct


def test_position_not_checked_when_count_fails():
    r = pos_rec("left of", count=2)
    ok, reason, _ = evaluate({"square": [D(40, 20, 50, 30)], "circle": [D(0, 20, 10, 30)]}, r)
    assert reason == "expected circle>=2, found 1"


# ---------------------------------------------------------------- summary_scores.py


def _row(tag, meta_id, correct, strict=None):
    meta = {"tag": tag, "include": [{"class": "circle", "count": 1}], "prompt": f"prompt {meta_id}"}
    r = {"tag": tag, "metadata": json.dumps(meta), "correct": correct}
    if strict is not None:
        r["strict"] = strict
    return r


def test_summary_unweighted_tag_mean_and_correct_prompts():
    rows = (
        [_row("two_object", 0, True, True), _row("two_object", 0, False, False)]  # prompt 0: 1 of 2
        + [_row("single_object", 1, True, False)] * 4  # prompt 1: 4 of 4 (not strict)
        + [_row("two_object", 2, False, False), _row("two_object", 2, False, False)]  # prompt 2: 0 of 2
    )
    s = summarize(rows)
    assert s["total_images"] == 8 and s["total_prompts"] == 3
    c = s["correct"]
    assert c["images"] == pytest.approx(5 / 8)
    assert c["prompts"] == pytest.approx(2 / 3)  # any image correct per prompt
    assert list(c["tags"]) == ["two_object", "single_object"]  # order of first appearance
    assert c["tags"]["two_object"] == {"accuracy": 0.25, "correct": 1, "total": 4}
    assert c["overall"] == pytest.approx((0.25 + 1.0) / 2)  # unweighted over tags, not 5/8
    st = s["strict"]
    assert st["images"] == pytest.approx(1 / 8)
    assert st["overall"] == pytest.approx((0.25 + 0.0) / 2)
    text = format_summary(s)
    assert "Total prompts: 3" in text and "% correct prompts: 66.67%" in text
    assert "two_object       = 25.00% (1 / 4)" in text
    assert text.endswith("Overall score (avg. over tasks): 0.62500")


def test_summary_accepts_dict_metadata_and_skips_absent_strict():
    meta = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}], "prompt": "x"}
    rows = [{"tag": "colors", "metadata": dict(meta), "correct": True}, {"tag": "colors", "metadata": dict(meta), "correct": False}]
    s = summarize(rows)
    assert s["total_prompts"] == 1 and s["correct"]["prompts"] == 1.0
    assert "strict" not in s
