"""Seeded fuzzing of `flowcredit train` (docs/RELIABILITY.md, "Fuzzed inputs").

1. 100 invalid inputs generated from the config schema with ``random.Random(0)``: wrong types, values outside a
   field's declared range or closed set, unknown keys (typos of real keys, registered options included) and bad YAML
   (override values and config files). Each must end in exactly one ``error:`` line, exit code 2, no traceback and
   nothing written. They run in-process (the CLI's ``main``); five of them also through a real subprocess.
2. 20 seeded corruptions of a trained run folder (its checkpoints, config.yaml, metrics.jsonl), each resumed with
   ``resume=``: the run resumes from the newest intact checkpoint (with a warning for each one skipped) and trains one
   more iteration, or, when none is intact or config.yaml is damaged, stops with one ``error:`` line and exit 2 with
   nothing changed; never a traceback, a silent restart from iteration 0 or a lost intact checkpoint.

The expected outcome of every case is stated by the generator (what it broke), not read from the code under test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

import flowcredit.trainer.loop  # noqa: F401  (imports every component package: the registries are filled)
from flowcredit import checkpoints as ck
from flowcredit.cli.main import main
from flowcredit.config.annotations import _init_fields, _is_union, _type_hints
from flowcredit.config.registry import REGISTRIES
from flowcredit.config.resolve import resolve_train_config
from flowcredit.config.schema import TrainConfig
from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel

SRC = Path(__file__).resolve().parents[1] / "src"
PRESETS = ["tiny_flow_grpo", "tiny_stepwise", "tiny_vgpo", "tiny_nft", "tiny_awm", "tiny_stepwise_adae"]
# the cheapest run that trains; run.iterations=0: a case that is wrongly accepted fails fast (it writes a run folder)
SMALL = ["model.precision=fp32", "sampler.num_steps=2", "data.prompts_per_iter=2", "data.group_size=2",
         "run.iterations=0", "run.threads=1", "run.grid_every=0", "run.eval_at_end=false", "run.eval_baseline=false",
         "run.loggers=[]"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    return TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path_factory.mktemp("model"), name="m")


def call_main(argv: list[str]) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        return int(e.code or 0)


def one_error_line(err: str) -> str:
    """stderr of a refused input: exactly one line, `error: ...`, and no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# =====================================================================================================================
# 1. invalid inputs generated from the schema
# =====================================================================================================================


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One settable key of a resolved preset: its dotted key, annotation, field metadata and its section's keys."""

    key: str
    tp: Any
    meta: dict
    siblings: frozenset[str]  # the keys of its section, and the section's old (moved) keys


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str  # wrong_type | out_of_range | unknown_key | bad_yaml
    preset: str
    overrides: tuple[str, ...] = ()  # the bad input, given after SMALL (so SMALL cannot override it)
    file: bytes | None = None  # bad YAML config file, passed instead of the preset
    key: str = ""  # the key the case is about (checked in the message); "" = not about one key

    @property
    def id(self) -> str:
        what = self.overrides[0] if self.overrides else f"file:{self.key or 'yaml'}"
        return f"{self.kind}-{self.preset.removeprefix('tiny_')}-{what}"[:90]


def _leaves(preset: str) -> list[Leaf]:
    """Every key of the preset's resolved config, registered options included (the options dataclass of the
    implementation the preset names, e.g. credit.options.* of flow_grpo)."""
    cfg, _ = resolve_train_config([preset])
    out: list[Leaf] = []

    def walk(cls: type, obj: Any, path: str) -> None:
        hints = _type_hints(cls)
        fields = _init_fields(cls)
        siblings = frozenset(f.name for f in fields)
        for f in fields:
            key = f"{path}.{f.name}" if path else f.name
            tp = hints[f.name]
            out.append(Leaf(key, tp, dict(f.metadata), siblings))
            if dataclasses.is_dataclass(tp) and isinstance(tp, type):
                walk(tp, getattr(obj, f.name), key)
            elif "options_of" in f.metadata and obj is not None:
                reg = REGISTRIES.get(f.metadata["options_of"])
                spec = reg.get(getattr(obj, f.metadata.get("name_field", "name"))) if reg is not None else None
                if spec is not None:
                    walk(spec.options, None, key)

    walk(TrainConfig, cfg, "")
    return out


def _arms(tp: Any) -> list[Any]:
    return [a for a in typing.get_args(tp) if a is not type(None)] if _is_union(tp) else [tp]


def _base(tp: Any) -> Any:
    """The annotation a value must match, without Optional: int, float, bool, str, Literal[...], list, dict, a
    dataclass, or Any (None for a union of several types)."""
    arms = _arms(tp)
    if len(arms) != 1:
        return None
    a = arms[0]
    return typing.get_origin(a) or a


def _wrong_values(tp: Any) -> list[str]:
    """Override values (YAML text) of the wrong type for annotation `tp`."""
    b = _base(tp)
    if b is bool:
        return ["2", "maybe", "[true]", "{a: 1}", "0.5"]
    if b is int:
        return ["many", "2.5", "[1, 2]", "{a: 1}", "true", "''"]
    if b is float:
        return ["fast", "[0.1]", "{a: 1}", "true", "1.0.0"]
    if b is str:
        return ["5", "1.5", "[a, b]", "{a: 1}", "true"]
    if b is Literal:
        return ["3", "[a]", "true", "{a: 1}"]
    if b is list:
        return ["5", "{a: 1}", "abc", "[[1], {a: 2}]"]
    if b is dict:
        return ["5", "[1, 2]", "abc", "true"]
    if dataclasses.is_dataclass(b):
        return ["5", "[1, 2]", "true"]  # a section given a scalar or a list (a string would name its implementation)
    return []


def _num(x: float, tp: Any) -> str:
    return str(int(x)) if _base(tp) is int else repr(float(x))


def _out_of_range_values(leaf: Leaf, rng: random.Random) -> list[str]:
    """Values just outside the declared range of a numeric field (and NaN for floats), or outside a closed set."""
    m, tp, b = leaf.meta, leaf.tp, _base(leaf.tp)
    vals: list[str] = []
    if b in (int, float):
        if "ge" in m:
            vals.append(_num(m["ge"] - (1 if b is int else rng.choice([1e-6, 0.5, 3.0])), tp))
        if "gt" in m:
            vals.append(_num(m["gt"] - rng.choice([0, 1]), tp))
        if "le" in m:
            vals.append(_num(m["le"] + (1 if b is int else rng.choice([1e-6, 0.5, 10.0])), tp))
        if "lt" in m:
            vals.append(_num(m["lt"] + rng.choice([0, 1]), tp))
        if b is float and vals:
            vals.append(rng.choice([".nan", "nan"]))
    elif b is list and any(k in m for k in ("ge", "gt", "le", "lt")):  # a list of numbers, e.g. optim.betas
        lo = m.get("ge", m.get("gt", 0))
        hi = m.get("le", m.get("lt", 1))
        vals += [f"[{lo - 0.5}, {hi}]" if "lt" in m else f"[{lo - 0.5}, {lo}]", f"[{(lo + hi) / 2}, {hi + 1}]"]
    elif b is Literal:
        choices = [c for tp_arm in _arms(tp) for c in typing.get_args(tp_arm)]
        c = str(rng.choice(choices))
        vals += [c.upper() if c.upper() != c else c + "x", c[:-1] or "x", c + "_" + c]
        vals = [v for v in vals if v not in map(str, choices)]
    return [v for v in vals if v]


def _closed_set_names(leaves: list[Leaf]) -> list[tuple[str, list[str]]]:
    """(key, registered names) of every `{name, options}` section of the config, and reward.name."""
    from flowcredit.rewards.registry import REWARDS

    out = [(r.name_key, r.names()) for r in REGISTRIES.values() if r.name_key in {lf.key for lf in leaves}]
    return out + [("reward.name", sorted(REWARDS))]


def _typo(name: str, rng: random.Random) -> str:
    """A small edit of `name`: two letters swapped, one dropped, doubled or inserted, '_' ↔ '-'."""
    ops = ["swap", "drop", "double", "insert", "dash"]
    while True:
        op = rng.choice(ops)
        i = rng.randrange(len(name))
        if op == "swap" and len(name) > 1:
            i = min(i, len(name) - 2)
            new = name[:i] + name[i + 1] + name[i] + name[i + 2 :]
        elif op == "drop" and len(name) > 1:
            new = name[:i] + name[i + 1 :]
        elif op == "double":
            new = name[:i] + name[i] + name[i:]
        elif op == "insert":
            new = name[:i] + rng.choice("aeiourstln") + name[i:]
        elif op == "dash" and "_" in name:
            new = name.replace("_", "-", 1)
        else:
            continue
        if new != name:
            return new


BROKEN_VALUES = ["{a: [1", "[1, 2", '"abc', "'abc", "{x: 1]", "]", "}", "&a [*b]", "*x", "!!python/name:os.system",
                 "@x", "`x", "a: b: c", "[1]]", "!!bool maybe", "!!int abc", "!!float x", "2001-13-45",
                 "{a: 1, a: 2}", "!!binary 123", "!x y", "[a, b]c", "'a''", "{[1]: 2}", '"\\q"']

# (template, what it breaks); {p} = preset, {s}/{k} = a section and one of its keys, {v} = a valid value of the key
BROKEN_FILES: list[tuple[str, str]] = [
    ("base: {p}\n{s}:\n  {k}: [{v}\n", "unclosed bracket"),
    ("base: {p}\n{s}:\n  {k}: {v}\n   other: 1\n", "bad indentation"),
    ("base: {p}\n{s}:\n\t{k}: {v}\n", "tab indentation"),
    ("base: {p}\n{s}:\n  {k}: {v}\n  {k}: {v}\n", "duplicate key"),
    ("base: {p}\n{s}:\n  {k}: {v}\n{s}:\n  {k}: {v}\n", "duplicate section"),
    ("- base: {p}\n- {s}:\n    {k}: {v}\n", "a list at the top level"),
    ("{p} {s}.{k}={v}\n", "a single value at the top level"),
    ("base: {p}\n{s}: !!python/object/apply:os.system [echo {k}]\n", "unsafe tag"),
    ("base: {p}\n{s}:\n  {k}: \"{v}\n", "unclosed quote"),
    ("base: {p}\n{s}: &a\n  {k}: *b\n", "undefined alias"),
    ("base: {p}\n{s}:\n  {k}: !!bool maybe\n", "a tag whose value cannot be built"),
    ("base: {p}\n{s}:\n  {k}: 2001-13-45\n", "an impossible date"),
    ("base: {p}\n{s}:\n  {k}: \xff\xfe{v}\n", "not UTF-8"),
]


def generate_cases(seed: int = 0, n_per_kind: int = 25) -> list[Case]:
    rng = random.Random(seed)
    leaves = {p: _leaves(p) for p in PRESETS}
    cases: list[Case] = []

    def add(case: Case) -> None:
        if case not in cases:
            cases.append(case)

    # -- wrong type --------------------------------------------------------------------------------------------
    while len(cases) < n_per_kind:
        p = rng.choice(PRESETS)
        lf = rng.choice(leaves[p])
        vals = _wrong_values(lf.tp)
        if vals:
            add(Case("wrong_type", p, (f"{lf.key}={rng.choice(vals)}",), key=lf.key))
    # -- out of range / outside a closed set -------------------------------------------------------------------
    while len(cases) < 2 * n_per_kind:
        p = rng.choice(PRESETS)
        if rng.random() < 0.2:  # a registered implementation's name with a typo (sampler.name=flow_sdee)
            key, names = rng.choice(_closed_set_names(leaves[p]))
            bad = _typo(rng.choice(names), rng)
            if bad not in names:
                add(Case("out_of_range", p, (f"{key}={bad}",), key=key))
            continue
        lf = rng.choice(leaves[p])
        vals = _out_of_range_values(lf, rng)
        if vals:
            add(Case("out_of_range", p, (f"{lf.key}={rng.choice(vals)}",), key=lf.key))
    # -- unknown key: a typo of a real key (its section, or its own name) --------------------------------------
    top = frozenset(f.name for f in _init_fields(TrainConfig))
    while len(cases) < 3 * n_per_kind:
        p = rng.choice(PRESETS)
        options = [x for x in leaves[p] if ".options." in x.key]
        lf = rng.choice(options if options and rng.random() < 0.3 else leaves[p])  # registered options more often
        parts = lf.key.split(".")
        i = len(parts) - 1 if len(parts) == 1 or rng.random() < 0.7 else rng.randrange(len(parts) - 1)
        bad = _typo(parts[i], rng)
        siblings = lf.siblings if i == len(parts) - 1 else top if i == 0 else frozenset()
        if i > 0 and i < len(parts) - 1:  # a middle segment: the section's own keys are the siblings
            siblings = next((x.siblings for x in leaves[p] if x.key == ".".join(parts[: i + 1])), frozenset())
        if bad in siblings or bad in ("base", "resume") or "=" in bad:
            continue
        key = ".".join([*parts[:i], bad, *parts[i + 1 :]])
        add(Case("unknown_key", p, (f"{key}={rng.choice(['1', 'true', 'x', '0.5', '[1]'])}",), key=key))
    # -- bad YAML: override values, then config files ----------------------------------------------------------
    broken = rng.sample(BROKEN_VALUES, 15)  # 15 different forms (test_every_broken_form_is_refused: all of them)
    while len(cases) < 3 * n_per_kind + 15:
        p = rng.choice(PRESETS)
        lf = rng.choice(leaves[p])
        add(Case("bad_yaml", p, (f"{lf.key}={broken[len(cases) - 3 * n_per_kind]}",), key=lf.key))
    files = list(BROKEN_FILES)
    rng.shuffle(files)
    for template, _what in files[: 4 * n_per_kind - len(cases)]:
        p = rng.choice(PRESETS)
        lf = rng.choice([x for x in leaves[p] if x.key.count(".") == 1 and _base(x.tp) in (int, float, str, bool)])
        s, k = lf.key.split(".")
        v = {int: "3", float: "0.5", str: "x", bool: "true"}[_base(lf.tp)]
        text = template.format(p=p, s=s, k=k, v=v)
        data = text.encode("latin-1") if "\xff" in text else text.encode()
        add(Case("bad_yaml", p, (), file=data, key=lf.key))
    assert len(cases) == 4 * n_per_kind, len(cases)
    return cases


CASES = generate_cases()


def _argv(case: Case, model_path: Path, tmp_path: Path) -> list[str]:
    src: str = case.preset
    if case.file is not None:
        (tmp_path / "bad.yaml").write_bytes(case.file)
        src = str(tmp_path / "bad.yaml")
    return ["train", src, f"model.path={model_path}", *SMALL, f"run.out_dir={tmp_path / 'run'}", *case.overrides]


def _check_refused(case: Case, rc: int, out: str, err: str, tmp_path: Path) -> None:
    line = one_error_line(err)
    assert rc == 2, (rc, err)
    assert "run folder:" not in out, out
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == (["bad.yaml"] if case.file is not None else []), (written, line)  # no run folder, no runs/
    if case.file is not None:
        assert "bad.yaml" in line, line  # names the file
    else:  # about the key it broke: its name (an option's message may name only the option)
        assert case.key.rsplit(".", 1)[-1] in line, line


def test_generator_is_seeded_and_covers_every_kind():
    # the same 100 cases every run: two generations agree (CASES itself was generated at collection, before other
    # test modules registered plugins in the registries the generator reads, so it is not compared here)
    assert [c.id for c in generate_cases()] == [c.id for c in generate_cases()]
    kinds = [c.kind for c in CASES]
    assert len(CASES) == 100 and len(set(CASES)) == 100
    assert all(kinds.count(k) == 25 for k in ("wrong_type", "out_of_range", "unknown_key", "bad_yaml"))
    assert sum(c.file is not None for c in CASES) == 10
    assert any(".options." in c.key for c in CASES)  # registered options are fuzzed too
    assert len({c.preset for c in CASES}) == len(PRESETS)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_invalid_input_is_one_error_line_exit_2_nothing_written(case, model_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a default run folder (runs/...) would appear here
    rc = call_main(_argv(case, model_path, tmp_path))
    cap = capsys.readouterr()
    _check_refused(case, rc, cap.out, cap.err, tmp_path)


_pick = random.Random(1)
def test_every_broken_form_is_refused(model_path, tmp_path, monkeypatch, capsys):
    """Every bad-YAML form the generator draws from (the 100 cases use some of them), on one key each."""
    monkeypatch.chdir(tmp_path)
    forms = [Case("bad_yaml", "tiny_flow_grpo", (f"optim.lr={v}",), key="optim.lr") for v in BROKEN_VALUES]
    forms += [Case("bad_yaml", "tiny_flow_grpo", (), key="run.seed",
                   file=t.format(p="tiny_flow_grpo", s="run", k="seed", v="3").encode("latin-1"))
              for t, _ in BROKEN_FILES]
    for case in forms:
        rc = call_main(_argv(case, model_path, tmp_path))
        cap = capsys.readouterr()
        _check_refused(case, rc, cap.out, cap.err, tmp_path)
        (tmp_path / "bad.yaml").unlink(missing_ok=True)


SUBPROCESS_CASES = [_pick.choice([c for c in CASES if c.kind == kind and (c.file is not None) == file])
                    for kind, file in [("wrong_type", False), ("out_of_range", False), ("unknown_key", False),
                                       ("bad_yaml", False), ("bad_yaml", True)]]


def _env() -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")


@pytest.mark.parametrize("case", SUBPROCESS_CASES, ids=[c.id for c in SUBPROCESS_CASES])
def test_invalid_input_through_a_real_subprocess(case, model_path, tmp_path):
    """What the terminal shows: the same one line, no traceback, exit 2."""
    argv = _argv(case, model_path, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "flowcredit.cli.main", *argv], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    _check_refused(case, proc.returncode, proc.stdout, proc.stderr, tmp_path)


# =====================================================================================================================
# 2. corrupted run folders, resumed
# =====================================================================================================================

BASE_ITERS = 3  # checkpoint_every=1 and the trainer keeps the 2 newest: checkpoints iter000002, iter000003
KEEP = 2


def ckpt_name(i: int) -> str:
    return f"iter{i:06d}"


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, model_path):
    """One small trained run folder (3 iterations, a checkpoint each): the original every corruption copies."""
    out = tmp_path_factory.mktemp("base") / "run"
    argv = ["train", "tiny_flow_grpo", f"model.path={model_path}", *SMALL, f"run.iterations={BASE_ITERS}",
            "run.checkpoint_every=1", f"run.out_dir={out}"]
    assert call_main(argv) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [ckpt_name(2), ckpt_name(3)]
    assert all(ck.verify(p) is None for p in (out / "checkpoints").iterdir())
    return out


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` by relative path (folders as '<dir>')."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def logged_iterations(run: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---- the damage, each drawing its details (offsets, bytes, which file) from the case's own seeded rng ---------------


def truncate(f: Path, rng: random.Random) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: rng.randrange(len(data))])


def flip_bytes(f: Path, rng: random.Random) -> None:
    data = bytearray(f.read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    f.write_bytes(bytes(data))


def junk_bytes(f: Path, rng: random.Random) -> None:
    f.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))))


def junk_safetensors(f: Path, rng: random.Random) -> None:
    """A valid safetensors file with other tensors (what a copy from another run would look like)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    save_file({"model/x": torch.randn(rng.randint(1, 64), generator=g)}, str(f), metadata={"flowcredit": ck.FORMAT})


DAMAGE: dict[str, Callable[[Path, random.Random], None]] = {
    "truncate": truncate, "flip_bytes": flip_bytes, "junk_bytes": junk_bytes, "delete": lambda f, rng: f.unlink(),
}


def damage_checkpoint(c: Path, rng: random.Random) -> str:
    """One random damage to one random file of checkpoint folder `c`; returns what was done."""
    how = rng.choice(sorted(DAMAGE))
    f = c / rng.choice([ck.TENSORS, ck.STATE, ck.MANIFEST])
    if how in ("truncate", "flip_bytes") and f.stat().st_size == 0:
        how = "delete"
    DAMAGE[how](f, rng)
    return f"{how} {f.name}"


@dataclasses.dataclass
class Corruption:
    """What one case breaks, and what must happen: `resume_from` = the iteration resumed from (None: refused with
    `error_has` in the one error line); `skipped` = the checkpoint names a warning must report as unusable."""

    name: str
    apply: Callable[[Path, random.Random], None]
    resume_from: int | None
    skipped: tuple[str, ...] = ()
    error_has: tuple[str, ...] = ()
    interrupted: bool = False  # a stray .tmp folder is reported


def _newest(run: Path) -> Path:
    return run / "checkpoints" / ckpt_name(BASE_ITERS)


def _older(run: Path) -> Path:
    return run / "checkpoints" / ckpt_name(BASE_ITERS - 1)


def _junk_newer(run: Path, rng: random.Random) -> None:
    """A newer folder that is not a checkpoint (a partial copy): junk files, no manifest."""
    d = run / "checkpoints" / ckpt_name(rng.randint(10, 99))  # never one the resumed run writes
    d.mkdir()
    junk_bytes(d / rng.choice([ck.TENSORS, ck.STATE]), rng)


MANIFEST_EDITS = [("version", 1e999), ("version", 99), ("format", "other"), ("files", [1]), ("version", "two"),
                  ("files", {ck.TENSORS: {"bytes": "x"}})]


def _manifest_edit(run: Path, rng: random.Random) -> None:
    """A manifest that parses but lies: an absurd version, a foreign format or files that are not a mapping."""
    f = _newest(run) / ck.MANIFEST
    m = json.loads(f.read_text())
    field, value = rng.choice(MANIFEST_EDITS)
    m[field] = value
    f.write_text(json.dumps(m))


def _folder_to_file(run: Path, rng: random.Random) -> None:
    shutil.rmtree(_newest(run))
    junk_bytes(_newest(run), rng)


def _all_damaged(run: Path, rng: random.Random) -> None:
    for c in (run / "checkpoints").iterdir():
        damage_checkpoint(c, rng)


def _no_checkpoints(run: Path, rng: random.Random) -> None:
    for c in (run / "checkpoints").iterdir():
        shutil.rmtree(c)
    if rng.random() < 0.5:
        (run / "checkpoints").rmdir()


def _metrics_damage(run: Path, rng: random.Random) -> None:
    f = run / "metrics.jsonl"
    lines = f.read_bytes().splitlines(keepends=True)
    lines.insert(rng.randrange(len(lines) + 1), bytes(rng.randrange(256) for _ in range(40)) + b"\n")
    f.write_bytes(b"".join(lines) + b'{"iteration": 4, "rew')  # and a torn last line


def _config_truncated(run: Path, rng: random.Random) -> None:
    f = run / "config.yaml"
    text = f.read_bytes()
    f.write_bytes(text[: rng.randrange(len(text.rstrip()) - 1)])  # at least the last line is lost


def _config_garbage(run: Path, rng: random.Random) -> None:
    f = run / "config.yaml"
    data = bytearray(f.read_bytes())
    i = rng.randrange(len(data) // 2, len(data))
    data[i:i] = b"\xff" + bytes(rng.randrange(128, 256) for _ in range(7))  # never UTF-8 (0xff never is)
    f.write_bytes(bytes(data))


CORRUPTIONS = [
    Corruption("newest tensors truncated", lambda r, g: truncate(_newest(r) / ck.TENSORS, g), 2, (ckpt_name(3),)),
    Corruption("newest tensors bytes flipped", lambda r, g: flip_bytes(_newest(r) / ck.TENSORS, g), 2,
               (ckpt_name(3),)),
    Corruption("newest state.json bytes flipped", lambda r, g: flip_bytes(_newest(r) / ck.STATE, g), 2,
               (ckpt_name(3),)),
    Corruption("newest state.json replaced by junk", lambda r, g: junk_bytes(_newest(r) / ck.STATE, g), 2,
               (ckpt_name(3),)),
    Corruption("newest manifest deleted", lambda r, g: (_newest(r) / ck.MANIFEST).unlink(), 2, (ckpt_name(3),)),
    Corruption("newest manifest replaced by junk", lambda r, g: junk_bytes(_newest(r) / ck.MANIFEST, g), 2,
               (ckpt_name(3),)),
    Corruption("newest manifest edited", _manifest_edit, 2, (ckpt_name(3),)),
    Corruption("newest tensors deleted", lambda r, g: (_newest(r) / ck.TENSORS).unlink(), 2, (ckpt_name(3),)),
    Corruption("newest tensors replaced by a foreign safetensors file",
               lambda r, g: junk_safetensors(_newest(r) / ck.TENSORS, g), 2, (ckpt_name(3),)),
    Corruption("newest checkpoint folder emptied",
               lambda r, g: [f.unlink() for f in _newest(r).iterdir()], 2, (ckpt_name(3),)),
    Corruption("newest checkpoint folder replaced by a file", _folder_to_file, 2, (ckpt_name(3),)),
    Corruption("older checkpoint damaged", lambda r, g: damage_checkpoint(_older(r), g), 3),
    Corruption("a newer junk folder", _junk_newer, 3, ("<junk>",)),
    Corruption("a newer junk folder and the newest damaged",
               lambda r, g: (_junk_newer(r, g), damage_checkpoint(_newest(r), g)), 2, ("<junk>", ckpt_name(3))),
    Corruption("an interrupted checkpoint write (.tmp)",
               lambda r, g: shutil.copytree(_newest(r), r / "checkpoints" / f"{ckpt_name(4)}.tmp"), 3,
               interrupted=True),
    Corruption("metrics.jsonl: a junk line and a torn last line", _metrics_damage, 3),
    Corruption("every checkpoint damaged", _all_damaged, None, error_has=("no intact checkpoint", ckpt_name(2),
                                                                           ckpt_name(3))),
    Corruption("every checkpoint deleted", _no_checkpoints, None, error_has=("metrics.jsonl", "no checkpoint")),
    Corruption("config.yaml truncated", _config_truncated, None, error_has=("config.yaml",)),
    Corruption("config.yaml with non-UTF-8 bytes", _config_garbage, None, error_has=("config.yaml",)),
]


def test_corruption_catalogue():
    assert len(CORRUPTIONS) == 20 and len({c.name for c in CORRUPTIONS}) == 20
    assert sum(c.resume_from is None for c in CORRUPTIONS) == 4


@pytest.mark.parametrize("case", range(len(CORRUPTIONS)), ids=[c.name for c in CORRUPTIONS])
def test_corrupted_run_folder_resumes_from_the_newest_intact_checkpoint_or_refuses(case, base_run, tmp_path, capsys):
    c = CORRUPTIONS[case]
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    c.apply(run, random.Random(1000 + case))
    d = run / "checkpoints"
    # what the generator put beside the real checkpoints: folders or files named like a newer checkpoint
    junk = sorted(p.name for p in (d.iterdir() if d.is_dir() else [])
                  if p.name[4:].isdigit() and int(p.name[4:]) > BASE_ITERS)
    before = tree_hashes(run)
    metrics_before = (base_run / "metrics.jsonl").read_text().splitlines()
    capsys.readouterr()
    target = (c.resume_from or BASE_ITERS) + 1  # one more iteration after the one resumed from
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = call_main(["train", f"resume={run}", f"run.iterations={target}"])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    warned = [str(w.message) for w in caught]

    if c.resume_from is None:  # refused: one line, exit 2, nothing trained, written or deleted
        line = one_error_line(err)
        assert rc == 2, err
        for fragment in c.error_has:
            assert fragment in line, (fragment, line)
        assert tree_hashes(run) == before
        return

    # resumed: from the newest intact checkpoint, said so, with a warning for each one skipped
    assert rc == 0, err
    resumed = d / ckpt_name(c.resume_from)
    assert f"resuming from {resumed} (iteration {c.resume_from})" in err, err
    unusable = [m for m in warned if " is unusable: " in m]
    expected_skips = [ckpt_name(3) if s != "<junk>" else junk[0] for s in c.skipped]
    assert len(unusable) == len(expected_skips), warned
    for name in expected_skips:
        assert any(f"checkpoint {d / name} is unusable: " in m and f"newest intact one: {resumed}" in m
                   for m in unusable), (name, warned)
    assert c.interrupted == any("was interrupted before it completed" in m for m in warned), warned
    # never a silent restart: iterations 1..resumed kept as they were, the rest redone once
    assert logged_iterations(run) == list(range(1, target + 1))
    assert (run / "metrics.jsonl").read_text().splitlines()[: c.resume_from] == metrics_before[: c.resume_from]
    # never a lost checkpoint: the KEEP newest intact ones plus what the run could not read and did not replace (a
    # newer junk folder is left as it is); the checkpoint resumed from and the junk are byte-identical
    kept = [ckpt_name(target - i) for i in range(KEEP)]  # the one resumed from is among them
    assert sorted(p.name for p in d.iterdir()) == sorted({*kept, *junk})
    for name in kept:
        assert ck.verify(d / name) is None, name
    now = tree_hashes(run)
    for rel, digest in before.items():
        top = rel.split(os.sep)
        if top[0] == "checkpoints" and len(top) > 1 and (top[1] == ckpt_name(c.resume_from) or top[1] in junk):
            assert now.get(rel) == digest, f"{rel} changed or vanished"


@pytest.mark.parametrize("field, value", MANIFEST_EDITS)
def test_a_manifest_that_parses_but_lies_is_reported_not_raised(base_run, tmp_path, field, value):
    c = tmp_path / ckpt_name(3)
    shutil.copytree(base_run / "checkpoints" / ckpt_name(3), c)
    m = json.loads((c / ck.MANIFEST).read_text())
    m[field] = value
    (c / ck.MANIFEST).write_text(json.dumps(m))
    problem = ck.verify(c)
    assert isinstance(problem, str) and problem, problem


def test_every_cut_of_config_yaml_is_refused(base_run, tmp_path):
    """config.yaml cut short anywhere (in its header, mid-key, at a line end) is one error naming it, never a config
    read with defaults for what was lost."""
    from flowcredit.config import ConfigError

    run = tmp_path / "run"
    shutil.copytree(base_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    text = (base_run / "config.yaml").read_bytes()
    rng = random.Random(0)
    line_ends = [i + 1 for i, b in enumerate(text[:-2]) if b == ord("\n")]
    cuts = sorted({0, 5, *rng.sample(range(len(text.rstrip()) - 1), 20), *rng.sample(line_ends, 10)})
    for cut in cuts:
        (run / "config.yaml").write_bytes(text[:cut])
        with pytest.raises(ConfigError, match="config.yaml"):
            resolve_train_config([f"resume={run}"])


def test_corrupted_run_folder_through_a_real_subprocess(base_run, tmp_path):
    """What the terminal shows: `warning: checkpoint ... is unusable ...` as one line (no Python warning location),
    and for a folder with no intact checkpoint one `error:` line and exit 2."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    flip_bytes(_newest(run) / ck.TENSORS, random.Random(7))
    cmd = [sys.executable, "-m", "flowcredit.cli.main", "train", f"resume={run}", f"run.iterations={BASE_ITERS}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "UserWarning" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "unusable" in ln]
    assert lines == [f"warning: checkpoint {_newest(run)} is unusable: tensors.safetensors: sha256 differs from the "
                     f"manifest (corrupt); falling back to the newest intact one: {_older(run)}"], proc.stderr
    assert f"resuming from {_older(run)} (iteration {BASE_ITERS - 1})" in proc.stderr

    for p in (run / "checkpoints").iterdir():
        truncate(p / ck.TENSORS, random.Random(p.name))
    before = tree_hashes(run)
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no intact checkpoint" in one_error_line(proc.stderr)
    assert tree_hashes(run) == before
