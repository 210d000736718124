"""YAML presets + dotlist overrides -> typed, nested dataclasses (STYLE.md R3).

The schema is plain ``@dataclass``es whose fields carry ``metadata={"help": "..."}``. This module is the generic
machinery around it and knows nothing about the project's schema:

* ``load_yaml(path)`` reads a YAML file and records the line of every key, so errors can say ``file.yaml:LINE``.
  A file may start from another one with ``base: other.yaml`` (deep merge, lists are replaced).
* ``apply_overrides(data, ["sampler.noise_level=0.5", ...])`` applies command-line dotlist overrides.
* ``from_dict(cls, data)`` builds the dataclasses strictly: unknown keys, wrong types and values outside a
  ``Literal`` are errors that name the key, where it came from and how to fix it. This is what prevents the
  flow_grpo "dead key" bug (STYLE.md §4.2): a key the code never reads can't be set.
* ``load_config(cls, "tiny", overrides)`` does all three; ``to_dict``/``dump_yaml`` write the fully resolved config
  back (it loads again to an equal object); ``describe(cls)`` is the ``--help-config`` listing.

Field metadata the loader reads besides ``help``:

* ranges: ``ge``, ``gt``, ``le``, ``lt`` (>=, >, <=, <) bound a number, each item of a list of numbers, or each
  value of a mapping of numbers; null passes (an ``Optional`` field is checked when set). Every value read is
  checked right after its type, before any ``__post_init__`` runs, so cross-field checks may assume ranges hold::

      ConfigError: run.iterations = -5 (override 'run.iterations=-5') must be >= 0

  ``check_ranges(obj)`` runs the same check on an object built in code.
* links: ``sets="section.key"`` (relative to the field's dataclass) makes the field's value the default of that
  key, except for the values in ``unless=(...)``; setting both to different values is an error naming both keys
  and where each was set (this is how ``method`` picks ``credit.name``).

Every problem is raised as a one-line ``ConfigError``. Example::

    >>> cfg = load_config(TrainCfg, "tiny", ["sampler.noise_levle=0.5"], preset_dirs=[configs_dir])
    ConfigError: unknown key 'sampler.noise_levle' at override 'sampler.noise_levle=0.5'; did you mean
    'noise_level'? valid keys in 'sampler': noise_level, num_steps

Type rules: ``int`` -> ``float`` is accepted, and so is a string a float parses (YAML 1.1 reads ``1e-4`` as a
string); ``bool`` accepts only ``true``/``false`` (not 0/1 or ``yes``-strings); ``int`` never accepts floats or
strings; ``str`` never accepts numbers (quote them); ``None`` only where the type is ``Optional``. Supported types:
``bool, int, float, str, pathlib.Path, Any, Literal[...], Optional/Union, list[T], tuple[T, ...], tuple[A, B],
dict[K, V]`` and nested dataclasses (also inside lists and dicts).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

__all__ = [
    "ConfigError",
    "apply_overrides",
    "check_ranges",
    "describe",
    "dump_yaml",
    "fields_without_help",
    "from_dict",
    "list_presets",
    "load_config",
    "load_yaml",
    "range_text",
    "to_dict",
]

T = TypeVar("T")

BASE_KEY = "base"  # the YAML key naming the preset a file starts from
YAML_SUFFIXES = (".yaml", ".yml")

# A source map says where each value came from: dotted key -> "file.yaml:LINE" or "override 'a.b=c'".
# Dotted keys index lists with brackets: "reward.components[1].weight". The root entry "" names the file.
SourceMap = Mapping[str, str]


class ConfigError(ValueError):
    """A config problem, explained in one line: the key, where it was set, and how to fix it.

    Attributes:
        key: dotted key of the offending value ("" for the whole config, None if not about one key).
        source: where the value came from ("file.yaml:LINE", "override 'a.b=c'"), or None if unknown.
    """

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None):
        # One line, always: messages may embed user text or a __post_init__ message with newlines.
        super().__init__(re.sub(r"\s*[\r\n]+\s*", " ", message).strip())
        self.key = key
        self.source = source


# ----------------------------------------------------------------------------------------------------------------
# Dotted keys and sources
# ----------------------------------------------------------------------------------------------------------------


def _join(path: str, key: Any) -> str:
    """Dotted key of a mapping entry: _join("a", "b") -> "a.b"."""
    return f"{path}.{key}" if path else str(key)


def _item(path: str, index: int) -> str:
    """Dotted key of a list item: _item("a.b", 3) -> "a.b[3]"."""
    return f"{path}[{index}]"


def _ancestors(path: str) -> list[str]:
    """The path and its ancestors, nearest first: "a.b[1].c" -> ["a.b[1].c", "a.b[1]", "a.b", "a", ""]."""
    out = [path]
    while path:
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
        out.append(path)
    return out


def _is_under(path: str, prefix: str) -> bool:
    """True if `path` is `prefix` or lies inside it."""
    if not prefix:
        return True
    return path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "[")


def _source_of(sources: SourceMap, path: str) -> str | None:
    """Where the value at `path` came from: its own entry, else one inside it, else the enclosing section's."""
    if path in sources:
        return sources[path]
    for key, value in sources.items():
        if key and _is_under(key, path):
            return value
    for p in _ancestors(path):
        if p in sources:
            return sources[p]
    return None


def _sources_inside(sources: SourceMap, path: str) -> list[str]:
    """Every distinct source of values inside a section (for errors about the section as a whole)."""
    found = [v for k, v in sources.items() if k and _is_under(k, path)]
    if not found:
        own = _source_of(sources, path)
        return [own] if own else []
    return list(dict.fromkeys(found))


def _at(source: str | None) -> str:
    return f" at {source}" if source else ""


def _display_path(path: Path) -> str:
    """A path for messages: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# ----------------------------------------------------------------------------------------------------------------
# from_dict: dict -> dataclasses
# ----------------------------------------------------------------------------------------------------------------

_HINTS_CACHE: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    """Resolved field types (string annotations from `from __future__ import annotations` included)."""
    if cls not in _HINTS_CACHE:
        _HINTS_CACHE[cls] = typing.get_type_hints(cls)
    return _HINTS_CACHE[cls]


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    """Readable name of a type annotation: "float | null", "list[RewardComponent]", "'sde' | 'ode'"."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if _is_union(tp):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, Sequence) or tp is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return f"tuple[{', '.join(_type_name(a) for a in args)}]"
    if origin in (dict, Mapping) or tp is dict:
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]" if args else "dict"
    return getattr(tp, "__name__", str(tp))


def _describe_value(value: Any) -> str:
    """`value` for messages: its YAML type name and a short repr."""
    names = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping", tuple: "list"}
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{names.get(type(value), type(value).__name__)} {text}"


def _how_to_write(tp: Any) -> str:
    """The 'fix' part of a wrong-type message."""
    if tp is bool:
        return "write true or false"
    if tp is int:
        return "write a whole number such as 10"
    if tp is float:
        return "write a number such as 0.5 or 1e-4"
    if tp is str or tp is Path:
        return "write text, quoted if YAML would read it as something else (e.g. '1.0', 'yes', 'null')"
    origin = typing.get_origin(tp)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        return "write a YAML list such as [a, b] (override: key=[a,b])"
    if origin in (dict, Mapping) or tp is dict:
        return "write a mapping such as {key: value}"
    if dataclasses.is_dataclass(tp):
        keys = ", ".join(f.name for f in _init_fields(tp))
        return f"write a mapping with keys among: {keys}"
    return f"write a value of type {_type_name(tp)}"


# ----------------------------------------------------------------------------------------------------------------
# Ranges and linked fields declared in field metadata
# ----------------------------------------------------------------------------------------------------------------

RANGE_KEYS = ("ge", "gt", "le", "lt")  # metadata keys of numeric bounds: >=, >, <=, <


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _num_text(x: Any) -> str:
    return repr(x) if isinstance(x, int) else f"{x:g}"


def range_text(metadata: Mapping[str, Any]) -> str | None:
    """The declared range of a field, e.g. ">= 0", "> 0" or "(0, 1]"; None when the field declares none.

    Raises:
        TypeError: a schema that declares both ``ge`` and ``gt`` (or both ``le`` and ``lt``).
    """
    if "ge" in metadata and "gt" in metadata or "le" in metadata and "lt" in metadata:
        raise TypeError(f"a field declares two bounds on one side: {dict(metadata)}; keep one of ge/gt and of le/lt")
    lo = ("[", ">=", metadata["ge"]) if "ge" in metadata else ("(", ">", metadata["gt"]) if "gt" in metadata else None
    hi = ("]", "<=", metadata["le"]) if "le" in metadata else (")", "<", metadata["lt"]) if "lt" in metadata else None
    if lo and hi:
        return f"{lo[0]}{_num_text(lo[2])}, {_num_text(hi[2])}{hi[0]}"
    if lo or hi:
        _, op, bound = lo or hi  # type: ignore[misc]
        return f"{op} {_num_text(bound)}"
    return None


def _in_range(metadata: Mapping[str, Any], x: float) -> bool:
    # Written as `x >= b` etc. so that NaN is out of every range.
    return (
        ("ge" not in metadata or x >= metadata["ge"])
        and ("gt" not in metadata or x > metadata["gt"])
        and ("le" not in metadata or x <= metadata["le"])
        and ("lt" not in metadata or x < metadata["lt"])
    )


def _out_of_range(metadata: Mapping[str, Any], value: Any, path: str) -> tuple[str, Any, str] | None:
    """(dotted key, value, "must be ...") of the first number in `value` outside the field's declared range.

    The range applies to a number, to each item of a list/tuple and to each value of a mapping; None and other
    values are not numbers and pass (their type was checked already).
    """
    text = range_text(metadata)
    if text is None:
        return None
    if isinstance(value, Mapping):
        items: Iterable[tuple[str, Any]] = ((_join(path, k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((_item(path, i), v) for i, v in enumerate(value))
    else:
        items = [(path, value)]
    for key, x in items:
        if _number(x) and not _in_range(metadata, x):
            return key, x, f"must be {'in ' if text[0] in '[(' else ''}{text}"
    return None


def _range_error(key: str, value: Any, must: str, source: str | None) -> ConfigError:
    frm = f" ({source})" if source else ""
    return ConfigError(f"{key} = {value!r}{frm} {must}", key=key, source=source)


def check_ranges(obj: Any, path: str = "") -> None:
    """Check every declared range of an already built config object (e.g. one constructed in code).

    `load_config`/`from_dict` check the values they read; this is the same check for objects made otherwise.

    Raises:
        ConfigError: ``key = value must be ...`` for the first value outside its field's range.
    """
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return
    for f in _init_fields(type(obj)):
        sub, value = _join(path, f.name), getattr(obj, f.name)
        bad = _out_of_range(f.metadata, value, sub)
        if bad is not None:
            raise _range_error(*bad, None)
        for i, v in enumerate(value) if isinstance(value, (list, tuple)) else ():
            check_ranges(v, _item(sub, i))
        for k, v in value.items() if isinstance(value, Mapping) else ():
            check_ranges(v, _join(sub, k))
        check_ranges(value, sub)


def _lookup(data: Mapping, dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key inside nested mappings."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _with_value(data: Mapping, dotted: str, value: Any) -> dict | None:
    """A copy of `data` with `dotted` set to `value` (missing or null sections are created); None if a section on the
    way is some other value (the type check will report it)."""
    head, _, rest = dotted.partition(".")
    out = dict(data)
    if not rest:
        out[head] = value
        return out
    inner = data.get(head)
    if inner is None:
        inner = {}
    if not isinstance(inner, Mapping):
        return None
    sub = _with_value(inner, rest, value)
    if sub is None:
        return None
    out[head] = sub
    return out


class _Builder:
    """One conversion run: holds the source map so every error can say where the value came from."""

    def __init__(self, sources: SourceMap):
        self.sources = sources

    def error(self, path: str, message: Callable[[str, str], str]) -> ConfigError:
        """ConfigError for the value at `path`; `message(key, at)` gets the key and " at <source>" (or "")."""
        source = _source_of(self.sources, path)
        return ConfigError(message(path or "<config>", _at(source)), key=path, source=source)

    def wrong_type(self, path: str, value: Any, tp: Any, extra: str = "") -> ConfigError:
        got = f"{_describe_value(value)}{extra}; {_how_to_write(tp)}"
        return self.error(path, lambda key, at: f"'{key}'{at} must be {_type_name(tp)}, got {got}")

    def convert(self, value: Any, tp: Any, path: str, coerce: bool = True) -> Any:
        """Check `value` against annotation `tp`, coercing where safe; raise ConfigError otherwise."""
        origin, args = typing.get_origin(tp), typing.get_args(tp)

        if tp is Any or tp is object:
            return copy.deepcopy(value)

        if value is None:
            if tp is type(None) or (_is_union(tp) and type(None) in args):
                return None
            if dataclasses.is_dataclass(tp) and isinstance(tp, type):
                return self.build(tp, {}, path)  # an empty section header (`sampler:`) means "all defaults"
            raise self.error(
                path, lambda key, at: f"'{key}'{at} is null but must be {_type_name(tp)}; give a value or remove it"
            )

        if _is_union(tp):
            arms = [a for a in args if a is not type(None)]
            # Exact matches first, so `int | str` keeps "3" a str and `float | str` keeps "1e-4" a str.
            for strict in (True, False):
                for arm in arms:
                    try:
                        return self.convert(value, arm, path, coerce=not strict)
                    except ConfigError:
                        pass
            raise self.wrong_type(path, value, tp)

        if origin is Literal:
            if any(value == a and type(value) is type(a) for a in args):
                return value
            allowed = ", ".join(repr(a) for a in args)
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise self.error(path, lambda key, at: f"'{key}'{at} must be one of {allowed}, got {value!r}{hint}")

        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            if isinstance(value, tp):
                return copy.deepcopy(value)
            if not isinstance(value, Mapping):
                raise self.wrong_type(path, value, tp)
            return self.build(tp, value, path)

        if tp is bool:
            if isinstance(value, bool):
                return value
            if coerce and isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise self.wrong_type(path, value, tp)

        if tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise self.wrong_type(path, value, tp)

        if tp is float:
            if isinstance(value, float) or (coerce and isinstance(value, int) and not isinstance(value, bool)):
                return float(value)
            if coerce and isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise self.wrong_type(path, value, tp)

        if tp is str:
            if isinstance(value, str):
                return value
            raise self.wrong_type(path, value, tp)

        if tp is Path:
            if isinstance(value, (str, Path)):
                return Path(value)
            raise self.wrong_type(path, value, tp)

        if origin in (list, Sequence) or tp in (list, Sequence):
            if not isinstance(value, (list, tuple)):
                raise self.wrong_type(path, value, tp)
            item_tp = args[0] if args else Any
            return [self.convert(v, item_tp, _item(path, i), coerce) for i, v in enumerate(value)]

        if origin is tuple or tp is tuple:
            if not isinstance(value, (list, tuple)):
                raise self.wrong_type(path, value, tp)
            if not args or (len(args) == 2 and args[1] is Ellipsis):
                item_tp = args[0] if args else Any
                return tuple(self.convert(v, item_tp, _item(path, i), coerce) for i, v in enumerate(value))
            if len(value) != len(args):
                raise self.wrong_type(path, value, tp, f" ({len(value)} items instead of {len(args)})")
            return tuple(self.convert(v, a, _item(path, i), coerce) for i, (v, a) in enumerate(zip(value, args)))

        if origin in (dict, Mapping) or tp in (dict, Mapping):
            if not isinstance(value, Mapping):
                raise self.wrong_type(path, value, tp)
            key_tp, val_tp = args if args else (Any, Any)
            out = {}
            for k, v in value.items():
                sub = _join(path, k)
                out[self.convert(k, key_tp, sub + " (key)", coerce)] = self.convert(v, val_tp, sub, coerce)
            return out

        if isinstance(tp, type):
            if isinstance(value, tp):
                return copy.deepcopy(value)
            raise self.wrong_type(path, value, tp)
        raise TypeError(f"flowcredit.config does not support the annotation {tp!r} (key '{path}')")

    def apply_links(self, cls: type, data: Mapping, path: str) -> Mapping:
        """Fields whose value is the default of another key: metadata ``sets="section.key"`` (relative to `cls`),
        optionally ``unless=(values that set nothing,)``.

        When the other key is not in `data` it takes the field's value; when it is set to a different value the
        two contradict each other: ConfigError naming both keys, where each came from, and the two ways to fix it.
        Returns `data`, or a copy with the linked key filled in.
        """
        hints = _type_hints(cls)
        for f in _init_fields(cls):
            target = f.metadata.get("sets")
            if target is None:
                continue
            sub = _join(path, f.name)
            value = self.convert(data[f.name], hints[f.name], sub) if f.name in data else _default(f)
            unless = tuple(f.metadata.get("unless", ()))
            if value in unless:
                continue
            found, given = _lookup(data, target)
            if not found:
                data = _with_value(data, target, value) or data
                continue
            if type(given) is not type(value) or given == value:
                continue  # equal, or a wrong type that the type check reports
            key = _join(path, target)
            src_given = _source_of(self.sources, key)
            src_value = _source_of(self.sources, sub) if f.name in data else "default"
            fixes = []
            try:
                self.convert(given, hints[f.name], sub)
                fixes.append(f"{sub}={given}")
            except ConfigError:
                pass
            if unless:
                fixes.append(f"{sub}={unless[0]} with {key}={given}")
            fix = f"use {', or '.join(fixes)}" if fixes else f"remove {key} (it follows {sub})"
            raise ConfigError(
                f"{key} = {given!r}{f' ({src_given})' if src_given else ''} contradicts {sub} = {value!r}"
                f"{f' ({src_value})' if src_value else ''}, which sets {key}; {fix}",
                key=key,
                source=src_given,
            )
        return data

    def build(self, cls: type[T], data: Mapping, path: str) -> T:
        """Build dataclass `cls` from mapping `data` found at dotted `path`."""
        hints = _type_hints(cls)
        fields = {f.name: f for f in _init_fields(cls)}
        section = f"'{path}'" if path else "the top level"

        for key in data:
            if key not in fields:
                close = difflib.get_close_matches(str(key), list(fields), n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                tail = "" if close else "; remove it or move it to the section it belongs to"
                valid = f"valid keys in {section}: {', '.join(fields) or '(none)'}{tail}"
                raise self.error(_join(path, key), lambda k, at: f"unknown key '{k}'{at}; {hint}{valid}")

        data = self.apply_links(cls, data, path)
        kwargs = {}
        for name, f in fields.items():
            sub = _join(path, name)
            if name in data:
                kwargs[name] = self.convert(data[name], hints[name], sub)
                bad = _out_of_range(f.metadata, kwargs[name], sub)
                if bad is not None:
                    raise _range_error(*bad, _source_of(self.sources, bad[0]))
            elif not _has_default(f):
                source = _source_of(self.sources, path)
                raise ConfigError(
                    f"missing required key '{sub}' (type {_type_name(hints[name])}) in {section}{_at(source)};"
                    f" set it in the YAML or with the override {sub}=VALUE",
                    key=sub,
                    source=source,
                )

        try:
            return cls(**kwargs)
        except ValueError as e:  # a cross-field check in __post_init__ (ConfigError included)
            where = f"section '{path}'" if path else f"config {cls.__name__}"
            origins = _sources_inside(self.sources, path)
            frm = f" (values from {', '.join(origins[:4])}{', ...' if len(origins) > 4 else ''})" if origins else ""
            raise ConfigError(
                f"invalid {where}{frm}: {e}; fix these values", key=path, source=", ".join(origins)
            ) from e


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, source: SourceMap | str | None = None) -> T:
    """Build the nested dataclass `cls` from a plain mapping, strictly.

    Args:
        cls: the root config dataclass.
        data: nested mappings as read from YAML (missing keys take the dataclass defaults). Not modified.
        source: where the values came from, for error messages: a map dotted key -> "file.yaml:LINE" /
            "override 'a.b=c'" (the line map of `load_yaml`), or one string for all values.

    Returns:
        An instance of `cls`.

    Raises:
        ConfigError: unknown key (with a close-match suggestion), wrong type, value outside a Literal or outside
            its declared range, two linked keys that contradict each other, missing required key, or a ValueError
            raised by a ``__post_init__`` (re-raised naming the section).
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    sources: SourceMap = {"": source} if isinstance(source, str) else (source or {})
    builder = _Builder(sources)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        got = _describe_value(data)
        raise builder.error("", lambda key, at: f"the config{at} must be a mapping of keys, got {got}")
    return builder.build(cls, data, "")


# ----------------------------------------------------------------------------------------------------------------
# YAML files, line maps and `base:` presets
# ----------------------------------------------------------------------------------------------------------------


def _yaml_problem(err: yaml.YAMLError) -> str:
    parts = [getattr(err, "context", None), getattr(err, "problem", None)]
    text = ", ".join(p for p in parts if p) or str(err)
    return " ".join(text.split())


def _check_duplicate_keys(node: yaml.Node, shown: str) -> None:
    """PyYAML silently keeps the last of two equal keys; a config file with both is a mistake."""
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(node, "")]
    while stack:
        n, path = stack.pop()
        if id(n) in seen_nodes:  # aliases share nodes
            continue
        seen_nodes.add(id(n))
        if isinstance(n, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key_node, value_node in n.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    stack.append((value_node, path))
                    continue
                sub = _join(path, key_node.value)
                stack.append((value_node, sub))
                line = key_node.start_mark.line + 1
                ident = (key_node.tag, key_node.value)
                if ident in first:
                    raise ConfigError(
                        f"duplicate key '{sub}' at {shown}:{line} (first set at line {first[ident]});"
                        " keep only one of them",
                        key=sub,
                        source=f"{shown}:{line}",
                    )
                first[ident] = line
        elif isinstance(n, yaml.SequenceNode):
            stack.extend((item, _item(path, i)) for i, item in enumerate(n.value))


def _read_yaml_file(path: Path) -> tuple[Any, dict[str, str]]:
    """Parse one file (no `base:` handling): the data and the line map of every key."""
    shown = _display_path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{shown}' not found; check the path", source=shown) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file '{shown}' ({e.strerror}); check the path", source=shown) from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_duplicate_keys(node, shown)
        # construct_document also flattens `<<:` merge keys inside the node tree, so the walk below sees them.
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{shown}:{mark.line + 1}" if mark is not None else shown
        raise ConfigError(
            f"YAML syntax error at {where}: {_yaml_problem(e)}; fix the syntax there (indentation, ':' after"
            " keys, matching quotes and brackets)",
            source=where,
        ) from None

    lines: dict[str, str] = {"": shown}
    if node is None:
        return {}, lines
    if not isinstance(node, yaml.MappingNode):
        where = f"{shown}:{node.start_mark.line + 1}"
        raise ConfigError(
            f"the top level of a config file must be a mapping (key: value), got a"
            f" {'list' if isinstance(node, yaml.SequenceNode) else 'single value'} at {where};"
            " write the config as keys and values",
            source=where,
        )

    def walk(n: yaml.Node, path: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                # The same key the data dict uses (`1:` is the int 1), named like from_dict names it.
                key = loader.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else key_node.value
                sub = _join(path, key)
                # Later pairs win: after `<<:` merges are flattened, the mapping's own keys come last.
                lines[sub] = f"{shown}:{key_node.start_mark.line + 1}"
                walk(value_node, sub)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                sub = _item(path, i)
                lines[sub] = f"{shown}:{item.start_mark.line + 1}"
                walk(item, sub)

    walk(node, "")
    return data, lines


def _preset_files(preset_dirs: Iterable[str | os.PathLike]) -> dict[str, Path]:
    """name -> file for every `<dir>/<name>.yaml` (first directory wins)."""
    found: dict[str, Path] = {}
    for d in preset_dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
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
    if names:
        avail = f"; available presets: {', '.join(names)}"
    elif preset_dirs:
        avail = "; no presets found in the preset directories"
    else:
        avail = "; no preset directories were given"
    return ConfigError(
        f"unknown preset '{name}'{context}{hint}{avail}; give a preset name or a path to a .yaml file",
        source=context.removeprefix(" at ") or None,
    )


def _resolve_base(ref: Any, file: Path, preset_dirs: Sequence, where: str) -> Path:
    """The file a `base:` value points to: a path relative to `file`, or a preset name."""
    if not isinstance(ref, str) or not ref:
        raise ConfigError(
            f"'{BASE_KEY}' at {where} must be a preset name or a .yaml path, got {_describe_value(ref)}",
            key=BASE_KEY,
            source=where,
        )
    candidates = [file.parent / ref]
    if not ref.endswith(YAML_SUFFIXES):
        candidates += [file.parent / (ref + s) for s in YAML_SUFFIXES]
    for c in candidates:
        if c.is_file():
            return c
    if not _looks_like_path(ref):
        preset = _preset_files(preset_dirs).get(ref)
        if preset is not None:
            return preset
        raise _unknown_preset(ref, list(preset_dirs), f" at {where}")
    raise ConfigError(
        f"base file '{ref}' at {where} not found (paths are relative to the file that names them);"
        " fix the path or use a preset name",
        key=BASE_KEY,
        source=where,
    )


def _merge(base: dict, over: dict, path: str, replaced: list[str]) -> dict:
    """Deep-merge `over` into a copy of `base`: mappings merge, everything else (lists too) is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        sub = _join(path, key)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, sub, replaced)
        else:
            out[key] = copy.deepcopy(value)
            replaced.append(sub)
    return out


def _load_with_bases(path: Path, preset_dirs: Sequence, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
    real = path.resolve()
    if real in chain:
        cycle = " -> ".join(_display_path(p) for p in (*chain, real))
        raise ConfigError(f"'{BASE_KEY}' presets form a cycle: {cycle}; remove one of the '{BASE_KEY}:' keys")
    data, lines = _read_yaml_file(path)
    if BASE_KEY not in data:
        return data, lines

    ref = data.pop(BASE_KEY)
    where = lines.pop(BASE_KEY)
    base_data, base_lines = _load_with_bases(
        _resolve_base(ref, path, preset_dirs, where), preset_dirs, (*chain, real)
    )
    replaced: list[str] = []
    merged = _merge(base_data, data, "", replaced)
    # Values a child replaced wholesale (lists, scalars) drop the base file's lines inside them.
    merged_lines = {k: v for k, v in base_lines.items() if k and not any(_is_under(k, r) for r in replaced)}
    merged_lines.update(lines)
    return merged, merged_lines


def load_yaml(
    path: str | os.PathLike, *, preset_dirs: Iterable[str | os.PathLike] = ()
) -> tuple[dict[str, Any], dict[str, str]]:
    """Read a YAML config file, following its `base:` chain.

    A file may say ``base: other.yaml`` (relative to the file) or ``base: tiny`` (a preset name: first
    ``<file's dir>/tiny.yaml``, then ``<dir>/tiny.yaml`` for each of `preset_dirs`). The file is deep-merged over its
    base: mappings merge key by key, lists and scalars are replaced. The `base` key itself is removed.

    Args:
        path: the YAML file.
        preset_dirs: directories searched for bare preset names in `base:`.

    Returns:
        (data, line_map): the merged nested dict, and a map from every dotted key ("sampler.noise_level",
        "reward.components[1].weight") to "file.yaml:LINE" of the file that set it. The entry "" names the file.

    Raises:
        ConfigError: missing file, YAML syntax error (with file:line), duplicate key, top level not a mapping,
            unknown base preset, or a `base:` cycle.
    """
    return _load_with_bases(Path(path), list(preset_dirs), ())


# ----------------------------------------------------------------------------------------------------------------
# Dotlist overrides
# ----------------------------------------------------------------------------------------------------------------

_SEGMENT = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")


def _parse_override_key(key: str, text: str) -> list[str | int]:
    """ "a.b[1].c" or "a.b.1.c" -> ["a", "b", 1, "c"] (numbers index lists where a list is found)."""
    parts: list[str | int] = []
    for seg in key.split("."):
        m = _SEGMENT.fullmatch(seg)
        if m is None:
            raise ConfigError(
                f"override '{text}' has a malformed key '{key}'; write dotted keys like sampler.noise_level=0.5",
                source=f"override '{text}'",
            )
        parts.append(int(m.group(1)) if m.group(1).isdigit() else m.group(1))
        parts.extend(int(i) for i in re.findall(r"\d+", m.group(2)))
    return parts


def _apply_overrides(data: Mapping, overrides: Iterable[str]) -> tuple[dict, dict[str, str]]:
    """apply_overrides, also returning the source map (dotted key -> "override '...'")."""
    out = copy.deepcopy(dict(data)) if data else {}
    sources: dict[str, str] = {}
    for text in overrides:
        if not isinstance(text, str) or "=" not in text:
            raise ConfigError(
                f"override {text!r} is not of the form key=value; write e.g. sampler.noise_level=0.5"
                " (dotted key, '=', a YAML value such as 1e-4, true, null or [1,2])",
                source=f"override {text!r}",
            )
        key, raw = text.split("=", 1)
        key = key.strip()
        where = f"override '{text}'"
        parts = _parse_override_key(key, text)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(
                f"{where}: the value is not valid YAML ({_yaml_problem(e)}); check its brackets and quotes",
                source=where,
            ) from None

        node: Any = out
        path = ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not isinstance(part, int):
                    raise ConfigError(
                        f"{where}: '{path}' is a list, so the next key must be an item number, got '{part}'",
                        key=path,
                        source=where,
                    )
                if not 0 <= part < len(node):
                    raise ConfigError(
                        f"{where}: '{path}' has {len(node)} items, so item {part} does not exist;"
                        f" set the whole list instead, e.g. {path.replace('[', '.').replace(']', '')}=[...]",
                        key=path,
                        source=where,
                    )
            elif isinstance(node, dict):
                part = str(part)
            else:
                raise ConfigError(
                    f"{where}: '{path}' is {_describe_value(node)}, not a section, so it has no key '{part}';"
                    f" override '{path}' itself or fix the key",
                    key=path,
                    source=where,
                )
            path = _item(path, part) if isinstance(node, list) else _join(path, part)
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}  # a section the file did not set, or an empty `section:` header
                node = node[part]
        # Later overrides win, also over any earlier override inside the same subtree.
        for k in [k for k in sources if _is_under(k, path)]:
            del sources[k]
        sources[path] = where
    return out, sources


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply dotlist overrides to a nested dict (returns a new dict; `data` is not modified).

    Each override is ``a.b.c=value``; the value is parsed as YAML, so ``1e-4``, ``true``, ``null``, ``[1,2]`` and
    ``{name: x}`` work, and an empty value means null. List items are addressed as ``a.b.1.c`` or ``a.b[1].c`` when
    the list is already in `data`. Keys are not checked here: `from_dict` rejects unknown ones and names the
    override (``load_config`` wires this up).

    Raises:
        ConfigError: an override without ``=``, a malformed key, a value that is not YAML, or a key that walks
            into a non-section value.
    """
    return _apply_overrides(data, overrides)[0]


# ----------------------------------------------------------------------------------------------------------------
# load_config: the one call the CLI and tests use
# ----------------------------------------------------------------------------------------------------------------


def load_config(
    cls: type[T],
    path_or_name: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    preset_dirs: Iterable[str | os.PathLike] = (),
) -> T:
    """YAML file or preset (if any) + dotlist overrides -> validated dataclass `cls`.

    Args:
        cls: the root config dataclass.
        path_or_name: a YAML path, or a bare preset name looked up as ``<dir>/<name>.yaml`` in `preset_dirs`;
            None means "dataclass defaults".
        overrides: ``key=value`` strings applied after the file (see `apply_overrides`).
        preset_dirs: directories of named presets, searched in order.

    Example::

        cfg = load_config(TrainCfg, "tiny", ["sampler.noise_level=0.5"], preset_dirs=["configs"])

    Raises:
        ConfigError: see `load_yaml`, `apply_overrides` and `from_dict`; an unknown preset lists the available
            ones with a suggestion.
    """
    preset_dirs = list(preset_dirs)
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path_or_name is not None:
        if _looks_like_path(path_or_name) or Path(path_or_name).is_file():
            path = Path(path_or_name)
            if not path.is_file():
                raise ConfigError(
                    f"config file '{os.fspath(path_or_name)}' not found; give an existing .yaml path"
                    + (f" or a preset name ({', '.join(list_presets(preset_dirs))})" if preset_dirs else ""),
                    source=os.fspath(path_or_name),
                )
        else:
            name = os.fspath(path_or_name)
            found = _preset_files(preset_dirs).get(name)
            if found is None:
                raise _unknown_preset(name, preset_dirs)
            path = found
        data, sources = load_yaml(path, preset_dirs=preset_dirs)

    data, override_sources = _apply_overrides(data, overrides)
    for key in override_sources:  # an override replaces the whole subtree the file had set
        for k in [k for k in sources if k and _is_under(k, key)]:
            del sources[k]
    sources.update(override_sources)
    return from_dict(cls, data, source=sources)


# ----------------------------------------------------------------------------------------------------------------
# Writing the resolved config back, and the help listing
# ----------------------------------------------------------------------------------------------------------------


def to_dict(obj: Any) -> Any:
    """Plain YAML-ready data of a config: dataclasses -> dicts, tuples -> lists, Paths -> str.

    Fields with ``init=False`` (derived values) are left out, so ``from_dict(type(obj), to_dict(obj)) == obj``.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in _init_fields(type(obj))}
    if isinstance(obj, Mapping):
        return {to_dict(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return copy.deepcopy(obj)


def dump_yaml(obj: Any, path: str | os.PathLike | None = None) -> str:
    """The fully resolved config as YAML; also written to `path` if given (e.g. next to a checkpoint).

    The text loads back to an equal object with ``load_config(type(obj), path)``.
    """
    name = type(obj).__name__
    header = f"# Fully resolved {name} written by flowcredit.config.dump_yaml; load with load_config({name}, path)\n"
    text = header + yaml.safe_dump(to_dict(obj), sort_keys=False, allow_unicode=True, width=119)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def _format_default(value: Any) -> str:
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, sort_keys=False, width=10**6).strip()
    text = text.removesuffix("...").strip()
    return text if len(text) <= 70 else text[:67] + "..."


def _item_dataclass(tp: Any) -> type | None:
    """The dataclass inside list[D] / tuple[D, ...] / dict[str, D] / Optional[...] annotations, if any."""
    if _is_union(tp):
        for a in typing.get_args(tp):
            found = _item_dataclass(a)
            if found is not None:
                return found
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple, Sequence) and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    if origin in (dict, Mapping) and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1]
    return None


def _walk_fields(cls: type, path: str) -> Iterable[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) for every field, sections before their contents."""
    hints = _type_hints(cls)
    for f in _init_fields(cls):
        sub = _join(path, f.name)
        tp = hints[f.name]
        yield sub, f, tp
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            yield from _walk_fields(tp, sub)
        else:
            item = _item_dataclass(tp)
            if item is not None:
                origin = typing.get_origin(tp)
                yield from _walk_fields(item, sub + (".<name>" if origin in (dict, Mapping) else "[]"))


def describe(cls: type) -> str:
    """Help listing of every dotted key of a config class: type, default, declared range and help text.

    Items of lists of sections are shown as ``key[].field``; values of dicts of sections as ``key.<name>.field``.
    """
    out = [f"{cls.__name__}: set keys in a YAML file or as key=value overrides (e.g. sampler.noise_level=0.5)", ""]
    for key, f, tp in _walk_fields(cls, ""):
        help_text = f.metadata.get("help", "(no help text)")
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out.append(f"{key}:  [section {tp.__name__}]")
        else:
            default = f"= {_format_default(_default(f))}" if _has_default(f) else "(required)"
            rng = range_text(f.metadata)
            out.append(f"{key}: {_type_name(tp)} {default}" + (f", range {rng}" if rng else ""))
        out.append(f"    {help_text}")
    return "\n".join(out) + "\n"


def fields_without_help(cls: type) -> list[str]:
    """Dotted keys whose field has no ``metadata={"help": ...}`` (for a schema test: every knob is explained)."""
    return [key for key, f, _ in _walk_fields(cls, "") if not str(f.metadata.get("help", "")).strip()]
