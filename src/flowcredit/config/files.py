"""YAML files with a line map of every key, named presets and `base:` chains."""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from .annotations import _describe_value
from .keys import ConfigError, _display_path, _is_under, _item, _join

BASE_KEY = "base"  # the YAML key naming the preset a file starts from
YAML_SUFFIXES = (".yaml", ".yml")
# `dump_yaml` (a run's config.yaml) ends the file with END_LINE and says so in its header: a file whose header says so
# but that lacks the line was cut short (an interrupted write or copy, a full disk), and is refused rather than read
# with the defaults for whatever was lost.
END_LINE = "# end of the resolved config"
END_NOTE = f"its last line is '{END_LINE}'"
# What PyYAML's SafeLoader raises, besides YAMLError, for a value it parsed but cannot build: `!!bool maybe`
# (KeyError), `!!int abc` / `!!float x` / an impossible date such as 2001-13-45 (ValueError).
YAML_VALUE_ERRORS: tuple[type[Exception], ...] = (ValueError, KeyError, TypeError, OverflowError, IndexError)


def _yaml_problem(err: Exception) -> str:
    if not isinstance(err, yaml.YAMLError):  # a value PyYAML parsed but could not build
        return f"{type(err).__name__}: {err}"
    text = ", ".join(p for p in (getattr(err, "context", None), getattr(err, "problem", None)) if p) or str(err)
    return " ".join(text.split())


def _unbuildable(node: yaml.Node | None) -> yaml.ScalarNode | None:
    """The first scalar of a parsed YAML tree that SafeLoader cannot build (for the line of the error)."""
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop(0)
        if isinstance(n, yaml.ScalarNode):
            try:
                yaml.SafeLoader("").construct_object(n)
            except (yaml.YAMLError, *YAML_VALUE_ERRORS):
                return n
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
        elif isinstance(n, yaml.MappingNode):
            stack.extend(x for pair in n.value for x in pair)
    return None


def _check_duplicate_keys(node: yaml.Node, shown: str) -> None:
    """PyYAML silently keeps the last of two equal keys; a config file with both is a mistake."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(node, "")]
    while stack:
        n, path = stack.pop()
        if id(n) in seen:  # aliases share nodes
            continue
        seen.add(id(n))
        if isinstance(n, yaml.SequenceNode):
            stack.extend((item, _item(path, i)) for i, item in enumerate(n.value))
        elif isinstance(n, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key_node, value_node in n.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    stack.append((value_node, path))
                    continue
                sub, line = _join(path, key_node.value), key_node.start_mark.line + 1
                ident = (key_node.tag, key_node.value)
                stack.append((value_node, sub))
                if ident in first:
                    raise ConfigError(f"duplicate key '{sub}' at {shown}:{line} (first set at line {first[ident]}); "
                                      "keep only one of them", key=sub, source=f"{shown}:{line}")
                first[ident] = line


def _parse(text: str, shown: str, override: bool = False) -> tuple[Any, yaml.Node | None]:
    """One YAML document -> (data, its node tree), as strictly for an override's value (`override`: `shown` is
    "override '...'") as for a file: a syntax error, a duplicate key or a value SafeLoader cannot build is one
    ConfigError line saying where."""
    loader, node = yaml.SafeLoader(text), None
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_duplicate_keys(node, shown)
        # construct_document also flattens `<<:` merge keys inside the node tree, so a walk of it sees them.
        return (loader.construct_document(node) if node is not None else None), node
    except yaml.YAMLError as e:
        if override:
            raise ConfigError(f"{shown}: the value is not valid YAML ({_yaml_problem(e)}); check its brackets and "
                              "quotes", source=shown) from None
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{shown}:{mark.line + 1}" if mark is not None else shown
        raise ConfigError(f"YAML syntax error at {where}: {_yaml_problem(e)}; fix the syntax there (indentation, ':' "
                          "after keys, matching quotes and brackets)", source=where) from None
    except ConfigError as e:  # a duplicate key (a ValueError too)
        if not override:
            raise
        raise ConfigError(f"{shown}: the value has the key '{e.key}' twice; keep only one of them",
                          source=shown) from None
    except YAML_VALUE_ERRORS as e:  # parsed, but a value cannot be built (`!!bool maybe`, 2001-13-45)
        bad = _unbuildable(node)
        what = f"the value {bad.value!r} ({bad.tag.rsplit(':', 1)[-1]})" if bad is not None else "a value"
        if override:
            raise ConfigError(f"{shown}: {what} cannot be read ({_yaml_problem(e)}); quote it to pass it as text",
                              source=shown) from None
        where = f"{shown}:{bad.start_mark.line + 1}" if bad is not None else shown
        raise ConfigError(f"YAML error at {where}: {what} cannot be read ({_yaml_problem(e)}); quote it to make it "
                          "text, or fix it", source=where) from None
    finally:
        loader.dispose()


def load_yaml_value(text: str, shown: str) -> Any:
    """An override's value -> data, with the checks a config file gets (ConfigError starting with `shown`)."""
    return _parse(text, shown, override=True)[0]


def _read_yaml_file(path: Path) -> tuple[Any, dict[str, str]]:
    """Parse one file (no `base:` handling): the data and the line map of every key."""
    shown = _display_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{shown}' not found; check the path", source=shown) from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(f"config file '{shown}' is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
                          f"{shown}:{line}); save it as UTF-8", source=f"{shown}:{line}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file '{shown}' ({e.strerror}); check the path", source=shown) from None
    if END_NOTE in text.split("\n", 1)[0] and text.rstrip().rsplit("\n", 1)[-1] != END_LINE:
        raise ConfigError(
            f"config file '{shown}' is cut short: it was written by flowcredit, whose config files end with the line "
            f"'{END_LINE}', and this one does not (an interrupted write or copy, or a full disk); restore it",
            source=shown)
    data, node = _parse(text, shown)
    lines: dict[str, str] = {"": shown}
    if node is None:
        return {}, lines
    if not isinstance(node, yaml.MappingNode):
        where = f"{shown}:{node.start_mark.line + 1}"
        raise ConfigError(
            "the top level of a config file must be a mapping (key: value), got a "
            f"{'list' if isinstance(node, yaml.SequenceNode) else 'single value'} at {where}; write the config as "
            "keys and values", source=where)

    def walk(n: yaml.Node, path: str) -> None:
        mapping, sequence = isinstance(n, yaml.MappingNode), isinstance(n, yaml.SequenceNode)
        pairs = n.value if mapping else enumerate(n.value) if sequence else ()
        for k, v in pairs:
            if isinstance(k, int):
                sub, line = _item(path, k), v.start_mark.line + 1
            else:  # the key the data dict uses (`1:` is the int 1); later pairs win (a `<<:` merge's keys come first)
                key = yaml.SafeLoader("").construct_object(k) if isinstance(k, yaml.ScalarNode) else k.value
                sub, line = _join(path, key), k.start_mark.line + 1
            lines[sub] = f"{shown}:{line}"
            walk(v, sub)

    walk(node, "")
    return data, lines


def _preset_files(preset_dirs: Iterable[str | os.PathLike]) -> dict[str, Path]:
    """name -> file for every `<dir>/<name>.yaml` (first directory wins)."""
    found: dict[str, Path] = {}
    for d in map(Path, preset_dirs):
        for p in sorted(d.iterdir()) if d.is_dir() else ():
            if p.suffix in YAML_SUFFIXES and p.is_file():
                found.setdefault(p.stem, p)
    return found


def list_presets(preset_dirs: Iterable[str | os.PathLike]) -> list[str]:
    """Names of the presets (`<dir>/<name>.yaml`) in the given directories, sorted."""
    return sorted(_preset_files(preset_dirs))


def _looks_like_path(name: str | os.PathLike) -> bool:
    s = os.fspath(name)
    return isinstance(name, os.PathLike) or s.endswith(YAML_SUFFIXES) or "/" in s or os.sep in s


def _unknown_preset(name: str, preset_dirs: Sequence, context: str = "") -> ConfigError:
    names = list_presets(preset_dirs)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    avail = (f"; available presets: {', '.join(names)}" if names else "; no presets found in the preset directories"
             if preset_dirs else "; no preset directories were given")
    return ConfigError(f"unknown preset '{name}'{context}{hint}{avail}; give a preset name or a path to a .yaml file",
                       source=context.removeprefix(" at ") or None)


def _resolve_base(ref: Any, file: Path, preset_dirs: Sequence, where: str) -> Path:
    """The file a `base:` value points to: a path relative to `file`, or a preset name."""
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"'{BASE_KEY}' at {where} must be a preset name or a .yaml path, got {_describe_value(ref)}",
                          key=BASE_KEY, source=where)
    suffixes = ("",) if ref.endswith(YAML_SUFFIXES) else ("", *YAML_SUFFIXES)
    found = next((c for c in (file.parent / (ref + s) for s in suffixes) if c.is_file()), None)
    if found is None and not _looks_like_path(ref):
        found = _preset_files(preset_dirs).get(ref)
        if found is None:
            raise _unknown_preset(ref, list(preset_dirs), f" at {where}")
    if found is None:
        raise ConfigError(f"base file '{ref}' at {where} not found (paths are relative to the file that names them); "
                          "fix the path or use a preset name", key=BASE_KEY, source=where)
    return found


def _merge(base: dict, over: dict, path: str, replaced: list[str]) -> dict:
    """Deep-merge `over` into a copy of `base`: mappings merge, everything else (lists too) is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, _join(path, key), replaced)
        else:
            out[key] = copy.deepcopy(value)
            replaced.append(_join(path, key))
    return out


def _load_with_bases(path: Path, preset_dirs: Sequence, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    real = path.resolve()
    if real in chain:
        cycle = " -> ".join(_display_path(p) for p in (*chain, real))
        raise ConfigError(f"'{BASE_KEY}' presets form a cycle: {cycle}; remove one of the '{BASE_KEY}:' keys")
    data, lines = _read_yaml_file(path)
    if BASE_KEY not in data:
        return data, lines
    ref, where = data.pop(BASE_KEY), lines.pop(BASE_KEY)
    base_data, base_lines = _load_with_bases(_resolve_base(ref, path, preset_dirs, where), preset_dirs, (*chain, real))
    replaced: list[str] = []
    merged = _merge(base_data, data, "", replaced)
    # Values a child replaced wholesale (lists, scalars) drop the base file's lines inside them.
    merged_lines = {k: v for k, v in base_lines.items() if k and not any(_is_under(k, r) for r in replaced)}
    return merged, {**merged_lines, **lines}


def load_yaml(path: str | os.PathLike, *, preset_dirs: Iterable[str | os.PathLike] = ()) -> tuple[dict[str, Any],
                                                                                                dict[str, str]]:
    """Read a YAML config file, following its `base:` chain.

    A file may say ``base: other.yaml`` (relative to the file) or ``base: tiny`` (a preset name: first
    ``<file's dir>/tiny.yaml``, then ``<dir>/tiny.yaml`` for each of `preset_dirs`). The file is deep-merged over its
    base: mappings merge key by key, lists and scalars are replaced; the `base` key itself is removed. Returns the
    merged dict and a map from every dotted key ("sampler.noise_level", "reward.components[1].weight") to
    "file.yaml:LINE" of the file that set it (the entry "" names the file). ConfigError: a missing file, a YAML
    syntax error (with file:line), a duplicate key, a top level that is not a mapping, an unknown base preset, a
    `base:` cycle.
    """
    return _load_with_bases(Path(path), list(preset_dirs), ())
