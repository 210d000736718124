"""Prompt files: the seeded shapes-GenEval generator and ONE reader for shapes, GenEval and flow_grpo files.

Schema (GenEval `prompts/evaluation_metadata.jsonl`, SHAPES_BENCHMARK.md §1.1): one JSON object per line with
`tag`, `include` = [{class, count, color?, position?: [relation, ref_index]}], optional `exclude`
= [{class, count}], and `prompt`. Plain-text files (flow_grpo's OCR / PickScore / DrawBench) hold one prompt per
line and get empty metadata.

Splits (§4.3): the space is small, so we enumerate it per tag. A held-out combination split, like flow_grpo's
`geneval_unseen_objects`: some (shape, colour) pairs and some (A, relation, B) position triples never appear in
train. Tags too small to hold anything out (single_object: 4 prompts, two_object: 12, counting: 12) share their
prompts between train and test (different noise and layouts), which we document in the README.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .vocab import (
    COLOR_NAMES,
    NUMBER_WORDS,
    RELATIONS,
    TAGS,
    World,
    check_color,
    check_shape,
    get_world,
    plural,
    with_article,
)

PROMPT_PREFIX = "a photo of "


# ---------------------------------------------------------------------------------------------------------------
# Records and their text (GenEval's create_prompts.py templates)
# ---------------------------------------------------------------------------------------------------------------


def _phrase(clause: dict[str, Any]) -> str:
    name = clause["class"]
    color = clause.get("color")
    return with_article(f"{color} {name}" if color else name)


def make_record(tag: str, include: list[dict[str, Any]]) -> dict[str, Any]:
    """Build a GenEval-schema record with GenEval's prompt wording and, for counting, exclude = count + 1."""
    rec: dict[str, Any] = {"tag": tag, "include": include}
    if tag == "counting":
        c = include[0]
        rec["exclude"] = [{"class": c["class"], "count": int(c["count"]) + 1}]
        text = f"{NUMBER_WORDS[int(c['count'])]} {plural(c['class'])}"
    elif tag == "position":
        ref, obj = include[0], include[1]
        text = f"{_phrase(obj)} {obj['position'][0]} {_phrase(ref)}"
    elif len(include) == 2:
        text = f"{_phrase(include[0])} and {_phrase(include[1])}"
    else:
        text = _phrase(include[0])
    rec["prompt"] = PROMPT_PREFIX + text
    return rec


def enumerate_tag(tag: str, world: World) -> list[dict[str, Any]]:
    """Every distinct record of a tag for a world (ordered pairs for two_object/position/color_attr)."""
    S, C = world.shapes, COLOR_NAMES
    out: list[dict[str, Any]] = []
    if tag == "single_object":
        out = [make_record(tag, [{"class": s, "count": 1}]) for s in S]
    elif tag == "two_object":
        out = [
            make_record(tag, [{"class": a, "count": 1}, {"class": b, "count": 1}])
            for a, b in itertools.permutations(S, 2)
        ]
    elif tag == "counting":
        out = [make_record(tag, [{"class": s, "count": n}]) for s in S for n in (2, 3, 4)]
    elif tag == "colors":
        out = [make_record(tag, [{"class": s, "count": 1, "color": c}]) for s in S for c in C]
    elif tag == "position":
        out = [
            make_record(tag, [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]}])
            for a, b in itertools.permutations(S, 2)
            for rel in RELATIONS
        ]
    elif tag == "color_attr":
        out = [
            make_record(tag, [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}])
            for a, b in itertools.permutations(S, 2)
            for ca, cb in itertools.permutations(C, 2)
        ]
    else:
        raise ValueError(f"unknown tag '{tag}'; valid tags: {', '.join(TAGS)}")
    return out


@dataclass(frozen=True)
class SplitSpec:
    """How the held-out combination split is drawn (all defaults are the shipped benchmark)."""

    seed: int = 43  # GenEval's create_prompts.py default seed
    heldout_color_pairs: int = 8  # (shape, colour) pairs never seen in train (of 40 at 32 px)
    heldout_position_triples: int = 10  # (A, relation, B) triples never seen in train (of 48 at 32 px)
    color_attr_test: int = 100  # unique color_attr test prompts
    lines_per_tag: int = 80


def _pairs(rec: dict[str, Any]) -> set[tuple[str, str]]:
    return {(c["class"], c["color"]) for c in rec["include"] if c.get("color")}


def _triple(rec: dict[str, Any]) -> tuple[str, str, str]:
    ref, obj = rec["include"][0], rec["include"][1]
    return (obj["class"], obj["position"][0], ref["class"])


def make_splits(resolution: int = 32, spec: SplitSpec = SplitSpec()) -> dict[str, Any]:
    """Generate the shapes benchmark prompt splits, deterministically from `spec.seed`.

    Returns:
        dict with `train` (unique records), `test` (unique records), `test_lines` (every test record repeated
        ceil(lines_per_tag / n_tag) times, flow_grpo's test_metadata.jsonl convention), and the held-out
        `heldout_color_pairs` / `heldout_position_triples`.
    """
    world = get_world(resolution)
    rng = np.random.default_rng(spec.seed)
    all_pairs = [(s, c) for s in world.shapes for c in COLOR_NAMES]
    held_pairs = {all_pairs[i] for i in rng.choice(len(all_pairs), spec.heldout_color_pairs, replace=False)}
    position = enumerate_tag("position", world)
    triples = [_triple(r) for r in position]
    held_triples = {triples[i] for i in rng.choice(len(triples), spec.heldout_position_triples, replace=False)}

    train: list[dict[str, Any]] = []
    test: list[dict[str, Any]] = []
    for tag in TAGS:
        recs = enumerate_tag(tag, world)
        if tag in ("single_object", "two_object", "counting"):
            train += recs
            test += recs
        elif tag == "colors":
            test += recs  # all 40: seen and unseen pairs
            train += [r for r in recs if not (_pairs(r) & held_pairs)]
        elif tag == "position":
            test += recs
            train += [r for r in recs if _triple(r) not in held_triples]
        elif tag == "color_attr":
            unseen = [r for r in recs if _pairs(r) & held_pairs]
            seen = [r for r in recs if not (_pairs(r) & held_pairs)]
            n_un = spec.color_attr_test // 2
            pick_un = [unseen[i] for i in sorted(rng.choice(len(unseen), n_un, replace=False))]
            pick_seen_idx = set(rng.choice(len(seen), spec.color_attr_test - n_un, replace=False).tolist())
            test += pick_un + [seen[i] for i in sorted(pick_seen_idx)]
            # train: seen pairs only, minus the seen test prompts (flow_grpo's geneval_filter_test.py)
            train += [r for i, r in enumerate(seen) if i not in pick_seen_idx]
    lines: list[dict[str, Any]] = []
    for tag in TAGS:
        recs = [r for r in test if r["tag"] == tag]
        reps = -(-spec.lines_per_tag // len(recs))  # every prompt of a tag equally often (flow_grpo repeats ×4)
        lines += [r for _ in range(reps) for r in recs]
    return {
        "train": train,
        "test": test,
        "test_lines": lines,
        "heldout_color_pairs": sorted(held_pairs),
        "heldout_position_triples": sorted(held_triples),
    }


VAL_FRACTION = 0.2  # of every tag's train prompts (at least one), for tuning
VAL_LINES_PER_TAG = 40  # shapes:val repeats every tag's prompts to this many lines, as shapes:test does to 80


def balanced_lines(recs: list[dict[str, Any]], per_tag: int) -> list[dict[str, Any]]:
    """Every tag's records repeated (whole rounds) to at least `per_tag` lines, tags in TAGS order."""
    out: list[dict[str, Any]] = []
    for tag in TAGS:
        rs = [r for r in recs if r["tag"] == tag]
        if rs:
            out += [r for _ in range(-(-per_tag // len(rs))) for r in rs]
    return out


def validation_split(train: list[dict[str, Any]], seed: int = 43) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(fit, val): `val` draws VAL_FRACTION of every tag's train prompts (at least one; seeded), `fit` keeps the rest.
    Tune on `shapes:val` with `shapes:fit` as the training prompts, report on `shapes:test` (never tuned on)."""
    rng = np.random.default_rng(seed + 1)
    val_idx: set[int] = set()
    for tag in TAGS:
        idx = [i for i, r in enumerate(train) if r["tag"] == tag]
        if idx:
            k = max(1, round(VAL_FRACTION * len(idx)))
            val_idx |= {idx[i] for i in rng.choice(len(idx), k, replace=False)}
    return ([r for i, r in enumerate(train) if i not in val_idx], [r for i, r in enumerate(train) if i in val_idx])


def is_unseen(record: dict[str, Any], splits: dict[str, Any]) -> bool:
    """True if a record contains a held-out (shape, colour) pair or position triple."""
    held_pairs = {tuple(p) for p in splits["heldout_color_pairs"]}
    if _pairs(record) & held_pairs:
        return True
    if record.get("tag") == "position":
        return _triple(record) in {tuple(t) for t in splits["heldout_position_triples"]}
    return False


def write_prompt_files(
    out_dir: str | os.PathLike, resolution: int = 32, spec: SplitSpec = SplitSpec()
) -> dict[str, Path]:
    """Write GenEval files (`evaluation_metadata.jsonl`, `generation_prompts.txt`) and flow_grpo-style
    `train_metadata.jsonl` / `test_metadata.jsonl` for the shapes benchmark."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    splits = make_splits(resolution, spec)
    paths = {
        "evaluation_metadata": out / "evaluation_metadata.jsonl",
        "generation_prompts": out / "generation_prompts.txt",
        "train_metadata": out / "train_metadata.jsonl",
        "test_metadata": out / "test_metadata.jsonl",
    }
    write_jsonl(paths["evaluation_metadata"], splits["test"])
    paths["generation_prompts"].write_text("".join(r["prompt"] + "\n" for r in splits["test"]))
    write_jsonl(paths["train_metadata"], splits["train"])
    write_jsonl(paths["test_metadata"], splits["test_lines"])
    return paths


def write_jsonl(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Reading prompt files (one code path for shapes, GenEval and flow_grpo)
# ---------------------------------------------------------------------------------------------------------------


class PromptFileError(ValueError):
    """A prompt file is missing, empty or malformed. The message is one line with file:line and the fix."""


_CLAUSE_KEYS = {"class", "count", "color", "position"}
_RECORD_KEYS = {"tag", "include", "exclude", "prompt"}


def validate_record(rec: Any, where: str) -> dict[str, Any]:
    """Check a GenEval-schema record; raise PromptFileError naming `where` (file:line) and the offending key."""
    if not isinstance(rec, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "prompt" not in rec or not isinstance(rec["prompt"], str):
        raise PromptFileError(f"{where}: missing string key 'prompt' (GenEval schema: tag, include, exclude?, prompt)")
    if "include" in rec or "tag" in rec:
        if not isinstance(rec.get("tag"), str):
            raise PromptFileError(f"{where}: key 'tag' must be a string (one of {', '.join(TAGS)})")
        inc = rec.get("include")
        if not isinstance(inc, list) or not inc:
            raise PromptFileError(
                f"{where}: key 'include' must be a non-empty list of {{class, count, color?, position?}}"
            )
        for k, cl in enumerate(inc):
            if not isinstance(cl, dict):
                raise PromptFileError(f"{where}: include[{k}] must be an object")
            extra = set(cl) - _CLAUSE_KEYS
            if extra:
                raise PromptFileError(
                    f"{where}: include[{k}] has unknown key '{sorted(extra)[0]}' (valid: class, count, color, "
                    "position)"
                )
            if not isinstance(cl.get("class"), str):
                raise PromptFileError(f"{where}: include[{k}].class must be a string")
            if not isinstance(cl.get("count"), int) or cl["count"] < 1:
                raise PromptFileError(f"{where}: include[{k}].count must be a positive integer")
            pos = cl.get("position")
            if pos is not None:
                if not (
                    isinstance(pos, list)
                    and len(pos) == 2
                    and pos[0] in RELATIONS
                    and isinstance(pos[1], int)
                    and 0 <= pos[1] < k
                ):
                    raise PromptFileError(
                        f"{where}: include[{k}].position must be [relation, earlier_index] with relation in "
                        f"{list(RELATIONS)}"
                    )
        for k, cl in enumerate(rec.get("exclude", []) or []):
            if (
                not isinstance(cl, dict)
                or not isinstance(cl.get("class"), str)
                or not isinstance(cl.get("count"), int)
            ):
                raise PromptFileError(f"{where}: exclude[{k}] must be {{class: str, count: int}}")
    return rec


def check_shapes_vocab(rec: dict[str, Any], world: World, where: str = "") -> None:
    """Check that every class/colour of a record exists in the shapes world (clear error listing valid names)."""
    try:
        for cl in rec.get("include", []) + (rec.get("exclude") or []):
            check_shape(cl["class"], world, where)
            if cl.get("color") is not None:
                check_color(cl["color"], where)
    except ValueError as e:
        raise PromptFileError(str(e)) from None


@dataclass
class PromptSet:
    """Prompts and their metadata (GenEval schema dicts, or {} for plain-text prompts)."""

    prompts: list[str]
    metadata: list[dict[str, Any]]
    source: str

    def __len__(self) -> int:
        return len(self.prompts)


def read_prompt_file(path: str | os.PathLike) -> PromptSet:
    """Read a `.jsonl` GenEval-schema file or a `.txt` one-prompt-per-line file.

    `.txt`: lines are stripped, empty lines dropped, a missing final newline tolerated, duplicates kept (they
    encode samples per prompt, flow_grpo's convention). `.jsonl`: every line is validated; the whole dict is the
    metadata. Errors are one line with file:line and the fix.
    """
    p = Path(path)
    if not p.exists():
        raise PromptFileError(
            f"prompt file '{p}' does not exist; pass an existing .jsonl/.txt file or a split like shapes:train"
        )
    text = p.read_text(encoding="utf-8")
    prompts: list[str] = []
    meta: list[dict[str, Any]] = []
    if p.suffix == ".jsonl":
        for ln, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(
                    f"{p}:{ln}: invalid JSON ({e.msg} at column {e.colno}); one JSON object per line"
                ) from None
            rec = validate_record(rec, f"{p}:{ln}")
            prompts.append(rec["prompt"])
            meta.append(rec)
    else:
        for line in text.splitlines():
            s = line.strip()
            if s:
                prompts.append(s)
                meta.append({})
    if not prompts:
        raise PromptFileError(
            f"prompt file '{p}' has no prompts; write one prompt per line (.txt) or one JSON record per line (.jsonl)"
        )
    return PromptSet(prompts, meta, str(p))


def load_prompts(spec: str) -> PromptSet:
    """Load prompts from a split name or a file.

    `spec` is `shapes:train`, `shapes:test` (the ≥400-line held-out test file), `shapes:test_unique`, `shapes:val`
    (a seeded fifth of every tag's train prompts, ≥ 40 lines per tag, to tune on) and `shapes:fit` (train without
    val, to train on while tuning),
    `shapes64:train` …, optionally restricted to tags (`shapes:train@single_object,colors`), or a path to a
    .jsonl/.txt file.
    """
    if ":" in spec and not Path(spec).exists():
        world_name, split = spec.split(":", 1)
        tags = None
        if "@" in split:  # e.g. shapes:train@single_object,colors — only these tags
            split, tag_list = split.split("@", 1)
            tags = tag_list.split(",")
            bad = [t for t in tags if t not in TAGS]
            if bad:
                raise PromptFileError(
                    f"unknown tag '{bad[0]}' in prompt split '{spec}'; valid tags: {', '.join(TAGS)}"
                )
        res = {"shapes": 32, "shapes32": 32, "shapes64": 64}.get(world_name)
        valid = ("train", "test", "test_unique", "fit", "val")
        if res is None or split not in valid:
            raise PromptFileError(
                f"unknown prompt split '{spec}'; use shapes:train, shapes:test, shapes:test_unique, shapes:fit, "
                "shapes:val (or shapes64:...) "
                "or a file path"
            )
        splits = make_splits(res)
        fit, val = validation_split(splits["train"])
        recs = {"train": splits["train"], "test": splits["test_lines"], "test_unique": splits["test"], "fit": fit,
                "val": balanced_lines(val, VAL_LINES_PER_TAG)}[split]
        if tags is not None:
            recs = [r for r in recs if r["tag"] in tags]
        return PromptSet([r["prompt"] for r in recs], [dict(r) for r in recs], spec)
    return read_prompt_file(spec)
