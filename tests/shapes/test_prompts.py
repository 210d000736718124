"""Prompt generator (GenEval wording, held-out split) and the ONE prompt-file reader (shapes, GenEval, flow_grpo)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from flowcredit.shapes.prompts import (
    PromptFileError,
    SplitSpec,
    check_shapes_vocab,
    enumerate_tag,
    is_unseen,
    load_prompts,
    make_record,
    make_splits,
    read_prompt_file,
    write_prompt_files,
)
from flowcredit.shapes.vocab import COLOR_NAMES, TAGS, get_world

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def _pairs(rec):
    return {(c["class"], c["color"]) for c in rec["include"] if c.get("color")}


def _triple(rec):
    ref, obj = rec["include"][0], rec["include"][1]
    return (obj["class"], obj["position"][0], ref["class"])


@pytest.mark.parametrize("resolution", [32, 64])
def test_make_splits_is_deterministic(resolution):
    a, b = make_splits(resolution), make_splits(resolution)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    c = make_splits(resolution, SplitSpec(seed=7))
    assert c["heldout_color_pairs"] != a["heldout_color_pairs"] or c["heldout_position_triples"] != a["heldout_position_triples"]


@pytest.mark.parametrize("resolution", [32, 64])
def test_heldout_combinations_never_in_train(resolution):
    s = make_splits(resolution)
    held_pairs = {tuple(p) for p in s["heldout_color_pairs"]}
    held_triples = {tuple(t) for t in s["heldout_position_triples"]}
    assert len(held_pairs) == SplitSpec().heldout_color_pairs and len(held_triples) == SplitSpec().heldout_position_triples
    for r in s["train"]:
        assert not (_pairs(r) & held_pairs), r["prompt"]
        if r["tag"] == "position":
            assert _triple(r) not in held_triples, r["prompt"]
        assert not is_unseen(r, s)
    # the test split does contain them (otherwise the split measures nothing)
    test_pairs = set().union(*(_pairs(r) for r in s["test"]))
    test_triples = {_triple(r) for r in s["test"] if r["tag"] == "position"}
    assert held_pairs <= test_pairs and held_triples <= test_triples
    unseen_ca = [r for r in s["test"] if r["tag"] == "color_attr" and is_unseen(r, s)]
    assert len(unseen_ca) == SplitSpec().color_attr_test // 2
    # seen color_attr test prompts are removed from train (no test prompt leaks into train for that tag)
    train_ca = {r["prompt"] for r in s["train"] if r["tag"] == "color_attr"}
    assert not train_ca & {r["prompt"] for r in s["test"] if r["tag"] == "color_attr"}
    assert Counter(r["tag"] for r in s["train"]).keys() == set(TAGS)


@pytest.mark.parametrize("resolution", [32, 64])
def test_test_lines_per_tag(resolution):
    spec = SplitSpec()
    s = make_splits(resolution, spec)
    counts = Counter(r["tag"] for r in s["test_lines"])
    assert len(s["test_lines"]) >= 400
    for tag in TAGS:  # every unique test prompt of a tag is repeated ceil(lines_per_tag / n) times, in order
        uniq = [r for r in s["test"] if r["tag"] == tag]
        reps = -(-spec.lines_per_tag // len(uniq))
        assert counts[tag] == reps * len(uniq) >= spec.lines_per_tag
        lines = [r for r in s["test_lines"] if r["tag"] == tag]
        assert lines == uniq * reps
    assert len(load_prompts(f"shapes{'' if resolution == 32 else '64'}:test")) == len(s["test_lines"])


def test_test_lines_cover_every_test_prompt():
    s = make_splits(32)
    assert {r["prompt"] for r in s["test_lines"]} == {r["prompt"] for r in s["test"]}


def test_geneval_wording():
    world = get_world(32)
    assert make_record("colors", [{"class": "circle", "count": 1, "color": "orange"}])["prompt"] == "a photo of an orange circle"
    assert make_record("colors", [{"class": "circle", "count": 1, "color": "red"}])["prompt"] == "a photo of a red circle"
    cnt = make_record("counting", [{"class": "cross", "count": 3}])
    assert cnt["prompt"] == "a photo of three crosses"
    assert cnt["exclude"] == [{"class": "cross", "count": 4}]
    assert make_record("counting", [{"class": "square", "count": 2}])["prompt"] == "a photo of two squares"
    pos = make_record("position", [{"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}])
    assert pos["prompt"] == "a photo of a circle left of a square"
    assert pos["include"][0] == {"class": "square", "count": 1}  # the reference comes first
    two = make_record("two_object", [{"class": "triangle", "count": 1}, {"class": "cross", "count": 1}])
    assert two["prompt"] == "a photo of a triangle and a cross"
    ca = make_record("color_attr", [{"class": "cross", "count": 1, "color": "orange"}, {"class": "square", "count": 1, "color": "white"}])
    assert ca["prompt"] == "a photo of an orange cross and a white square"
    for rec in enumerate_tag("position", world):
        assert rec["include"][0].get("position") is None and rec["include"][1]["position"][1] == 0
    for rec in enumerate_tag("counting", world):
        assert rec["exclude"][0]["count"] == rec["include"][0]["count"] + 1
    assert len(enumerate_tag("colors", world)) == len(world.shapes) * len(COLOR_NAMES)
    with pytest.raises(ValueError, match="valid tags"):
        enumerate_tag("texture", world)


def test_write_and_read_prompt_files_round_trip(tmp_path):
    paths = write_prompt_files(tmp_path / "p")
    assert {p.name for p in paths.values()} == {
        "evaluation_metadata.jsonl", "generation_prompts.txt", "train_metadata.jsonl", "test_metadata.jsonl",
    }
    assert sorted(x.name for x in (tmp_path / "p").iterdir()) == sorted(p.name for p in paths.values())
    s = make_splits(32)
    for key, recs in (("evaluation_metadata", s["test"]), ("train_metadata", s["train"]), ("test_metadata", s["test_lines"])):
        ps = read_prompt_file(paths[key])
        assert ps.metadata == recs
        assert ps.prompts == [r["prompt"] for r in recs]
    txt = read_prompt_file(paths["generation_prompts"])
    assert txt.prompts == [r["prompt"] for r in s["test"]] and all(m == {} for m in txt.metadata)
    # the split names load the same records as the files
    assert load_prompts("shapes:test_unique").metadata == s["test"]
    assert load_prompts(str(paths["train_metadata"])).prompts == load_prompts("shapes:train").prompts


@pytest.mark.skipif(not DATA.is_dir(), reason="shared/data (GenEval and flow_grpo prompt files) not present")
@pytest.mark.parametrize(
    "rel, n, has_meta",
    [
        ("geneval/evaluation_metadata.jsonl", 553, True),
        ("flow_grpo/geneval/test_metadata.jsonl", 2212, True),
        ("flow_grpo/ocr/test.txt", None, False),
        ("flow_grpo/pickscore/test.txt", None, False),
    ],
)
def test_reader_loads_real_files(rel, n, has_meta):
    path = DATA / rel
    if not path.exists():
        pytest.skip(f"{rel} not present in shared/data")
    ps = read_prompt_file(path)
    expected = n if n is not None else sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    assert len(ps) == expected and len(ps.metadata) == expected
    assert all(isinstance(p, str) and p and p == p.strip() for p in ps.prompts)
    if has_meta:
        assert all(m["tag"] in TAGS and m["include"] and m["prompt"] == p for m, p in zip(ps.metadata, ps.prompts))
        assert set(Counter(m["tag"] for m in ps.metadata)) == set(TAGS)
    else:
        assert all(m == {} for m in ps.metadata)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def _one_line(err):
    msg = str(err.value)
    assert "\n" not in msg
    return msg


GOOD = json.dumps({"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": "a photo of a circle"})


def test_malformed_json_names_file_and_line(tmp_path):
    p = _write(tmp_path, "bad.jsonl", GOOD + "\n\n" + '{"tag": "single_object", "include": [\n')
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(p)
    assert f"{p}:3:" in _one_line(e) and "invalid JSON" in str(e.value)


def test_missing_prompt_key(tmp_path):
    p = _write(tmp_path, "np.jsonl", GOOD + "\n" + json.dumps({"tag": "single_object", "include": [{"class": "circle", "count": 1}]}) + "\n")
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(p)
    assert f"{p}:2:" in _one_line(e) and "'prompt'" in str(e.value)


def test_unknown_clause_key(tmp_path):
    rec = {"tag": "colors", "include": [{"class": "circle", "count": 1, "colour": "red"}], "prompt": "a photo of a red circle"}
    p = _write(tmp_path, "uk.jsonl", json.dumps(rec) + "\n")
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(p)
    assert f"{p}:1:" in _one_line(e) and "'colour'" in str(e.value)


@pytest.mark.parametrize(
    "rec, key",
    [
        ({"tag": "counting", "include": [{"class": "circle", "count": 0}], "prompt": "x"}, "count"),
        ({"tag": "position", "include": [{"class": "circle", "count": 1, "position": ["left of", 0]}], "prompt": "x"}, "position"),
        ({"tag": "colors", "include": [], "prompt": "x"}, "include"),
        ({"include": [{"class": "circle", "count": 1}], "prompt": "x"}, "tag"),
        (["a photo"], "JSON object"),
    ],
)
def test_invalid_records_name_the_key(tmp_path, rec, key):
    p = _write(tmp_path, "inv.jsonl", json.dumps(rec) + "\n")
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(p)
    assert key in _one_line(e) and f"{p}:1" in str(e.value)


@pytest.mark.parametrize("name, text", [("empty.jsonl", ""), ("blank.txt", "\n  \n\n"), ("empty.txt", "")])
def test_empty_file_one_line_error(tmp_path, name, text):
    p = _write(tmp_path, name, text)
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(p)
    assert "no prompts" in _one_line(e)


def test_missing_file_and_unknown_split(tmp_path):
    with pytest.raises(PromptFileError) as e:
        read_prompt_file(tmp_path / "nope.jsonl")
    assert "does not exist" in _one_line(e)
    with pytest.raises(PromptFileError) as e:
        load_prompts(str(tmp_path / "nope.jsonl"))
    assert "does not exist" in _one_line(e)
    with pytest.raises(PromptFileError) as e:
        load_prompts("shapes:validation")
    assert "shapes:test_unique" in _one_line(e)


def test_txt_reader_strips_and_keeps_duplicates(tmp_path):
    p = _write(tmp_path, "p.txt", "  a cat \n\na cat\na dog")  # no final newline
    ps = read_prompt_file(p)
    assert ps.prompts == ["a cat", "a cat", "a dog"] and ps.metadata == [{}, {}, {}]


def test_check_shapes_vocab_lists_valid_names():
    world = get_world(32)
    rec = make_record("colors", [{"class": "circle", "count": 1, "color": "red"}])
    check_shapes_vocab(rec, world)  # valid: no error
    bad_shape = {"tag": "single_object", "include": [{"class": "hexagon", "count": 1}], "prompt": "a photo of a hexagon"}
    with pytest.raises(PromptFileError) as e:
        check_shapes_vocab(bad_shape, world, "f.jsonl:3")
    msg = _one_line(e)
    assert "hexagon" in msg and "f.jsonl:3" in msg and all(s in msg for s in world.shapes)
    # diamond exists only in the 64-px world
    with pytest.raises(PromptFileError, match="diamond"):
        check_shapes_vocab({"include": [{"class": "diamond", "count": 1}]}, world)
    check_shapes_vocab({"include": [{"class": "diamond", "count": 1}]}, get_world(64))
    bad_color = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "teal"}], "prompt": "a photo of a teal circle"}
    with pytest.raises(PromptFileError) as e:
        check_shapes_vocab(bad_color, world)
    msg = _one_line(e)
    assert "teal" in msg and all(c in msg for c in COLOR_NAMES)


def test_validation_split_is_held_out_from_the_train_prompts():
    from collections import Counter

    from flowcredit.shapes.prompts import load_prompts

    train, fit = load_prompts("shapes:train"), load_prompts("shapes:fit")
    val = load_prompts("shapes:val")
    fit_set, val_set = set(fit.prompts), set(val.prompts)
    assert not fit_set & val_set and fit_set | val_set == set(train.prompts)  # a partition of train
    per_tag = Counter(m["tag"] for m in load_prompts("shapes:train").metadata)
    val_tags = Counter(m["tag"] for m in val.metadata)
    uniq = {t: len({p for p, m in zip(val.prompts, val.metadata) if m["tag"] == t}) for t in per_tag}
    assert uniq == {t: max(1, round(0.2 * n)) for t, n in per_tag.items()}  # a fifth of every tag, at least one
    assert min(val_tags.values()) >= 40  # repeated to 40 lines per tag, as shapes:test is to 80
    assert load_prompts("shapes:val").prompts == val.prompts  # seeded
