"""`from_dict`: nested mappings -> dataclasses, validated by pydantic v2; our code only words its errors.

Each config dataclass is mirrored (once, cached) by a pydantic ``TypedDict`` with ``strict=True, extra="forbid"``:
the same fields, required where the dataclass has no default, and the field metadata's range (``ge``, ``gt``,
``le``, ``lt``) as pydantic constraints on the number, each item of a list or each value of a mapping. pydantic
checks the whole tree (unknown keys, missing keys, types, ``Literal`` choices, ranges); the first error becomes one
``ConfigError`` line with the dotted key, where it was set, the allowed values or range and a suggestion. Then the
dataclasses are built bottom-up: a ``{name, options}`` section's options are checked against the named component's
options dataclass (config/registry.py), and a ``ValueError`` of a ``__post_init__`` is re-raised naming the section.

Type rules (pydantic strict mode, plus two YAML-friendly conversions): ``int`` -> ``float`` is accepted, and so is a
string a float parses (YAML 1.1 reads ``1e-4`` as a string); ``bool`` accepts only ``true``/``false`` (also quoted);
``int`` never accepts floats, bools or strings; ``str`` never accepts numbers (quote them); ``None`` only where the
type is ``Optional``, except that an empty section header (``sampler:``) means "all defaults".
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import operator
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import Required, TypedDict

from .annotations import (
    _default,
    _describe_value,
    _has_default,
    _how_to_write,
    _init_fields,
    _is_union,
    _type_hints,
    _type_name,
)
from .keys import ConfigError, SourceMap, _at, _item, _join, _source_of, _sources_inside

T = TypeVar("T")
_A: Any = Annotated  # the types below are built at run time: a type checker sees none of them
_TypedDict: Any = TypedDict
_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _yaml_float(v: Any) -> Any:
    try:
        return float(v) if isinstance(v, str) else v
    except ValueError:
        return v


_BEFORE = {  # conversions before pydantic's strict check: YAML 1.1 reads 1e-4 as a string; a quoted "true" is a bool
    float: _yaml_float, bool: lambda v: v.lower() == "true" if isinstance(v, str) and v.lower() in ("true", "false")
    else v, Path: lambda v: Path(v) if isinstance(v, str) else v,
    list: lambda v: list(v) if isinstance(v, tuple) else v, tuple: lambda v: tuple(v) if isinstance(v, list) else v}


def _section(v: Any) -> Any:
    """An empty section header means all defaults; a dataclass instance is read as its fields."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: getattr(v, f.name) for f in _init_fields(type(v))}
    return {} if v is None else v


def _pydantic_type(tp: Any, bounds: dict[str, Any], from_str: bool = True) -> Any:
    """The annotation pydantic validates `tp` with; `bounds` (the field's range) applies to every number in it;
    without `from_str` (a union with str) a string stays a string."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    num = (Field(**bounds),) if bounds else ()  # keys among ge/gt/le/lt
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _A[_mirror(tp), BeforeValidator(_section)]
    if _is_union(tp):
        return functools.reduce(operator.or_, [_pydantic_type(a, bounds, str not in args) for a in args])
    if origin in (list, Sequence) or tp in (list, Sequence):
        return _A[list[_pydantic_type(args[0], bounds) if args else Any], BeforeValidator(_BEFORE[list])]  # type: ignore[misc]
    if origin is tuple:
        items: Any = tuple(_pydantic_type(a, bounds) if a is not Ellipsis else a for a in args)
        return _A[tuple[items] if items else tuple, BeforeValidator(_BEFORE[tuple])]
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return dict[_pydantic_type(args[0], {}), _pydantic_type(args[1], bounds)] if args else dict  # type: ignore[misc]
    before = (BeforeValidator(_BEFORE[tp]),) if tp in _BEFORE and (from_str or tp not in (float, bool)) else ()
    extra = (num if tp in (int, float) else ()) + before
    return _A[(tp,) + extra] if extra else tp  # str, Literal, Any, other classes: pydantic's strict rules


_MIRRORS: dict[type, Any] = {}
_ADAPTERS: dict[type, TypeAdapter] = {}


def _mirror(cls: type) -> Any:
    """The pydantic TypedDict of dataclass `cls` (keys left out take the dataclass defaults when it is built)."""
    if cls not in _MIRRORS:
        fields = {}
        for f in _init_fields(cls):
            tp = _pydantic_type(_type_hints(cls)[f.name], {k: f.metadata[k] for k in _BOUNDS if k in f.metadata})
            fields[f.name] = tp if _has_default(f) else Required[tp]
        mirror = _TypedDict(cls.__name__, fields, total=False)
        mirror.__pydantic_config__ = ConfigDict(strict=True, extra="forbid", arbitrary_types_allowed=True)
        _MIRRORS[cls] = mirror
    return _MIRRORS[cls]


def _adapter(cls: type) -> TypeAdapter:
    return _ADAPTERS.get(cls) or _ADAPTERS.setdefault(cls, TypeAdapter(_A[_mirror(cls), BeforeValidator(_section)]))


def _num_text(x: Any) -> str:
    return repr(x) if isinstance(x, int) else f"{x:g}"


def range_text(metadata: Mapping[str, Any]) -> str | None:
    """The declared range of a field, e.g. ">= 0", "> 0" or "(0, 1]"; None when the field declares none.
    TypeError for a schema that declares both ``ge`` and ``gt`` (or both ``le`` and ``lt``)."""
    if "ge" in metadata and "gt" in metadata or "le" in metadata and "lt" in metadata:
        raise TypeError(f"a field declares two bounds on one side: {dict(metadata)}; keep one of ge/gt and of le/lt")
    lo = next((k for k in ("ge", "gt") if k in metadata), None)
    hi = next((k for k in ("le", "lt") if k in metadata), None)
    if lo and hi:
        return f"{'[(' [lo == 'gt']}{_num_text(metadata[lo])}, {_num_text(metadata[hi])}{'])'[hi == 'lt']}"
    one = lo or hi
    return f"{_BOUNDS[one]} {_num_text(metadata[one])}" if one else None


def _must(metadata: Mapping[str, Any]) -> str:
    text = range_text(metadata) or ""
    return f"must be {'in ' if text[:1] in '[(' else ''}{text}"


def _choices(tp: Any) -> tuple:
    """The allowed values of a `Literal[...]` annotation (None too inside Optional)."""
    arms = typing.get_args(tp) if _is_union(tp) else (tp,)
    return tuple(v for a in arms for v in (typing.get_args(a) if typing.get_origin(a) is Literal else
                                           (None,) if a is type(None) else ()))


def _check(obj: Any, path: str, types: set[str]) -> None:
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return
    try:
        _adapter(type(obj)).validate_python(obj)
    except ValidationError as e:
        errors = [d for d in e.errors() if d["type"] in types]
        if errors:
            key, tp, meta, _ = _Builder({}).locate(type(obj), path, errors[0]["loc"])
            value = _shown(errors[0]["input"], tp)
            if errors[0]["type"] == "literal_error":
                choices = ", ".join(map(repr, _choices(tp)))
                raise ConfigError(f"{key} = {value!r} must be one of {choices}", key=key) from None
            raise ConfigError(f"{key} = {value!r} {_must(meta)}", key=key) from None


def check_ranges(obj: Any, path: str = "") -> None:
    """Check every declared range of a config object built in code: ConfigError ``key = value must be ...``."""
    _check(obj, path, _RANGE_ERRORS)


def check_values(obj: Any, path: str = "") -> None:
    """`check_ranges` plus the `Literal` choices of every field of a dataclass built in code (e.g. the options
    dataclass of a credit method: ``StepwiseOptions(norm="joined")``); a loaded config was checked already."""
    _check(obj, path, _RANGE_ERRORS | {"literal_error"})


def _shown(value: Any, tp: Any) -> Any:
    """A value as the field holds it: an int given for a float is shown as the float."""
    floats = float in (typing.get_args(tp) if _is_union(tp) else (tp,))
    return float(value) if floats and isinstance(value, int) and not isinstance(value, bool) else value


def _lookup(data: Mapping, dotted: str) -> tuple[bool, Any]:
    head, _, rest = dotted.partition(".")
    if head not in data:
        return False, None
    return _lookup(data[head], rest) if rest and isinstance(data[head], Mapping) else (not rest, data[head])


def _with_value(data: Mapping, dotted: str, value: Any) -> dict:
    """A copy of `data` with `dotted` set to `value` (missing sections are created)."""
    head, _, rest = dotted.partition(".")
    return {**data, head: _with_value(data.get(head) or {}, rest, value) if rest else value}


class _Builder:
    """One conversion run: holds the source map so every error can say where the value came from."""

    def __init__(self, sources: SourceMap, labels: dict[str, str] | None = None):
        self.sources = sources
        self.labels = labels or {}  # dotted path of a section → what it is, for "valid keys in ..." messages

    def error(self, path: str, message: str) -> ConfigError:
        """ConfigError "'KEY' at SOURCE {message}" for the value at `path`."""
        source = _source_of(self.sources, path)
        return ConfigError(f"'{path or '<config>'}'{_at(source)} {message}", key=path, source=source)

    def wrong_type(self, path: str, value: Any, tp: Any) -> ConfigError:
        if value is None:
            return self.error(path, f"is null but must be {_type_name(tp)}; give a value or remove it")
        value = list(value) if isinstance(value, tuple) else value  # as YAML wrote it (a list given for a tuple)
        args = typing.get_args(tp) if typing.get_origin(tp) is tuple and isinstance(value, list) else (...,)
        n = f" ({len(value)} items instead of {len(args)})" if args[-1:] != (...,) else ""
        return self.error(path, f"must be {_type_name(tp)}, got {_describe_value(value)}{n}; {_how_to_write(tp)}")

    def section(self, path: str) -> str:
        return (f"'{path}'" if path else "the top level") + (f" ({self.labels[path]})" if path in self.labels else "")

    def locate(self, cls: type, path: str, loc: tuple) -> tuple[str, Any, Mapping, tuple[type, str] | None]:
        """(dotted key, annotation, field metadata, (dataclass, path) of the section holding it) of a pydantic
        error location; it stops at a union of several types (the error is about the union)."""
        tp, prev, parent = cls, cls, None
        meta: Mapping[str, Any] = {}
        for part in loc:
            arms = [a for a in typing.get_args(tp) if a is not type(None)] if _is_union(tp) else [tp]
            if len(arms) != 1:
                break
            tp, origin, args = arms[0], typing.get_origin(arms[0]), typing.get_args(arms[0])
            if dataclasses.is_dataclass(tp) and isinstance(tp, type):
                parent, path = (tp, path), _join(path, part)
                f = next((f for f in _init_fields(tp) if f.name == part), None)
                tp, meta = (_type_hints(tp)[part], f.metadata) if f else (Any, {})
            elif part == "[key]":
                path, tp = f"{path} (key)", typing.get_args(prev)[0] if typing.get_args(prev) else Any
            elif isinstance(part, int):
                path, tp = _item(path, part), (args[part] if origin is tuple and args[-1:] != (...,) else
                                               (args or (Any,))[0])
            elif origin in (dict, Mapping):
                path, tp = _join(path, part), args[1] if args else Any
            else:
                break
            prev = arms[0]
        return path, tp, meta, parent

    def message(self, e: ValidationError, cls: type, path: str) -> ConfigError:
        """The first of pydantic's errors (unknown keys first) as one ConfigError line."""
        d = sorted(e.errors(), key=lambda d: d["type"] != "extra_forbidden")[0]
        value, kind, loc = d.get("input"), d["type"], d["loc"]
        if kind == "missing" and loc and isinstance(loc[-1], int):  # a tuple with too few items
            kind, loc = "too_short", loc[:-1]
        key, tp, meta, parent = self.locate(cls, path, loc)
        if kind == "extra_forbidden" and parent is not None:
            return self.unknown_key(*parent, str(loc[-1]), value)
        if kind == "missing" and parent is not None:
            source = _source_of(self.sources, parent[1])
            return ConfigError(
                f"missing required key '{key}' (type {_type_name(tp)}) in {self.section(parent[1])}{_at(source)}; set "
                f"it in the YAML or with the override {key}=VALUE", key=key, source=source)
        if value is None and kind != "missing":
            return self.wrong_type(key, value, tp)
        if kind == "literal_error":
            close = difflib.get_close_matches(str(value), [str(a) for a in _choices(tp) if a is not None], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            allowed = ", ".join("null" if a is None else repr(a) for a in _choices(tp))
            return self.error(key, f"must be one of {allowed}, got {value!r}{hint}")
        if kind in _RANGE_ERRORS:
            source = _source_of(self.sources, key)
            frm = f" ({source})" if source else ""
            return ConfigError(f"{key} = {_shown(value, tp)!r}{frm} {_must(meta)}", key=key, source=source)
        return self.wrong_type(key, value, tp)

    def unknown_key(self, cls: type, path: str, key: str, value: Any) -> ConfigError:
        """An unknown key: the closest valid key and the valid keys of its section."""
        sub = _join(path, key)
        names = [f.name for f in _init_fields(cls)]
        close = difflib.get_close_matches(key, names, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        tail = "" if close else "; remove it or move it to the section it belongs to"
        valid = f"valid keys in {self.section(path)}: {', '.join(names) or '(none)'}{tail}"
        source = _source_of(self.sources, sub)
        return ConfigError(f"unknown key '{sub}'{_at(source)}; {hint}{valid}", key=sub, source=source)

    def load(self, cls: type[T], data: Any, path: str) -> T:
        """Validate mapping `data` found at dotted `path` against dataclass `cls`, then build it."""
        if data is not None and not isinstance(data, Mapping):
            if not path:
                at = _at(_source_of(self.sources, ""))
                raise ConfigError(f"the config{at} must be a mapping of keys, got {_describe_value(data)}", key="")
            raise self.wrong_type(path, data, cls)
        try:
            valid = _adapter(cls).validate_python(copy.deepcopy(dict(data or {})))
        except ValidationError as e:
            raise self.message(e, cls, path) from None
        return self.build(cls, self.apply_links(cls, valid, path), path)

    def apply_links(self, cls: type, data: dict, path: str) -> dict:
        """Fields whose value is the default of another key: metadata ``sets="section.key"`` (relative to `cls`),
        optionally ``unless=(values that set nothing,)``: a shorthand (``method`` for ``credit.name``).

        When the other key is not set it takes the field's value. When both are set to different values the
        explicit key wins (``credit.name=my.mod:fn`` needs no second key), unless only the shorthand came from the
        command line and the key from a file (``method=vgpo`` on a preset that names its credit); the shorthand then
        takes the key's value if it is one of its own, else its first ``unless`` value (``custom``), so the
        resolved config never contradicts itself.
        """
        for f in _init_fields(cls):
            target = f.metadata.get("sets")
            if target is None:
                continue
            sub, value = _join(path, f.name), data.get(f.name, _default(f))
            unless = tuple(f.metadata.get("unless", ()))
            found, given = _lookup(data, target)
            if not found:
                data = data if value in unless else _with_value(data, target, value)
            elif value not in unless and type(given) is type(value) and given != value:
                by_override = (_source_of(self.sources, _join(path, target)) or "").startswith("override")
                if f.name in data and (_source_of(self.sources, sub) or "").startswith("override") and not by_override:
                    data = _with_value(data, target, value)  # the command line's shorthand over a file's key
                    continue
                own = given if given in _choices(_type_hints(cls)[f.name]) else unless[0] if unless else None
                if own is None:
                    raise ConfigError(f"{_join(path, target)} = {given!r} contradicts {sub} = {value!r}; remove one",
                                      key=_join(path, target), source=_source_of(self.sources, _join(path, target)))
                data = {**data, f.name: own}  # the key wins; the shorthand follows it
        return data

    def value(self, v: Any, tp: Any, path: str) -> Any:
        """A validated value with its sections built as dataclasses."""
        arms = typing.get_args(tp) if _is_union(tp) else (tp,)
        for a in arms:
            origin, args = typing.get_origin(a), typing.get_args(a)
            if isinstance(v, dict) and dataclasses.is_dataclass(a) and isinstance(a, type):
                return self.build(a, v, path)
            if isinstance(v, list) and origin in (list, Sequence) and args:
                return [self.value(x, args[0], _item(path, i)) for i, x in enumerate(v)]
            if isinstance(v, dict) and origin in (dict, Mapping) and args:
                return {k: self.value(x, args[1], _join(path, k)) for k, x in v.items()}
        return v

    def build(self, cls: type[T], data: dict, path: str) -> T:
        hints = _type_hints(cls)
        kwargs = {name: self.value(v, hints[name], _join(path, name)) for name, v in data.items()}
        for f in _init_fields(cls):
            if "options_of" in f.metadata:
                self.check_options(cls, f, kwargs, path)
        try:
            return cls(**kwargs)
        except ValueError as e:  # a cross-field check in __post_init__ (ConfigError included)
            where = f"section '{path}'" if path else f"config {cls.__name__}"
            origins = _sources_inside(self.sources, path)
            frm = f" (values from {', '.join(origins[:4])}{', ...' if len(origins) > 4 else ''})" if origins else ""
            raise ConfigError(f"invalid {where}{frm}: {e}; fix these values", key=path,
                              source=", ".join(origins)) from e

    def check_options(self, cls: type, f: dataclasses.Field, kwargs: dict, path: str) -> None:
        """A `{name, options}` section: the name must be registered and the options must build the named
        implementation's options dataclass (config/registry.py). Skipped while the registry's package is not
        imported (the component checks its options when it is built)."""
        from .registry import REGISTRIES

        reg = REGISTRIES.get(f.metadata["options_of"])
        if reg is None:
            return
        name_field = f.metadata.get("name_field", "name")
        name = kwargs.get(name_field, _default(next(g for g in _init_fields(cls) if g.name == name_field)))
        spec = reg.get(name)
        if spec is None:
            if reg.allow_paths and ":" in str(name):
                return  # a 'package.module:function' plugin: resolved (and its options checked) when built
            raise self.error(_join(path, name_field), f"is {name!r}, not a registered {reg.what}; {reg.choices(name)}")
        sub = _join(path, f.name)
        self.labels[sub] = f"the options of {reg.what} {name!r}"
        self.load(spec.options, kwargs.get(f.name) or {}, sub)


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, source: SourceMap | str | None = None) -> T:
    """Build the nested dataclass `cls` from nested mappings (not modified; missing keys take the defaults).

    `source` says where the values came from: a map dotted key -> "file.yaml:LINE" / "override 'a.b=c'" (the line
    map of `load_yaml`), or one string for all values. ConfigError: an unknown key (with a suggestion), a wrong
    type, a value outside a Literal or its range, a missing required key, two linked keys that contradict each other,
    or a ``__post_init__`` ValueError (re-raised naming the section).
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    return _Builder({"": source} if isinstance(source, str) else (source or {})).load(cls, data, "")


def build_options(cls: type[T], data: Mapping[str, Any] | None, path: str, *, source: str | None = None,
                  label: str | None = None) -> T:
    """An options dataclass found at dotted `path` (e.g. "credit.options"), built as strictly as `from_dict` builds a
    config; every message names ``path.KEY`` (and `source` when given; `label` says whose options they are)."""
    return _Builder({"": source} if source else {}, {path: label} if label else None).load(cls, data, path)
