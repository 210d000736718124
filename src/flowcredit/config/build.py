"""`from_dict`: nested mappings -> dataclasses, strictly (unknown keys, types, Literals, ranges, links)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

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
from .ranges import _out_of_range, _range_error

T = TypeVar("T")


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
        self.labels: dict[str, str] = {}  # dotted path of a section → what it is, for "valid keys in ..." messages

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
        optionally ``unless=(values that set nothing,)``: a shorthand (``method`` for ``credit.name``).

        When the other key is not in `data` it takes the field's value. When both are set to different values the
        explicit key wins (``credit.name=my.mod:fn`` needs no second key), unless only the shorthand came from the
        command line and the key from a file (``method=vgpo`` on a preset that names its credit); the shorthand then
        takes the key's value if it is one of its own, else its first ``unless`` value (``custom``), so the
        resolved config never contradicts itself. Returns `data`, or a copy with the linked keys filled in.
        """
        hints = _type_hints(cls)
        for f in _init_fields(cls):
            target = f.metadata.get("sets")
            if target is None:
                continue
            sub = _join(path, f.name)
            value = self.convert(data[f.name], hints[f.name], sub) if f.name in data else _default(f)
            unless = tuple(f.metadata.get("unless", ()))
            found, given = _lookup(data, target)
            if value in unless and found:
                continue
            if not found:
                if value not in unless:
                    data = _with_value(data, target, value) or data
                continue
            if type(given) is not type(value) or given == value:
                continue  # equal, or a wrong type that the type check reports
            by_override = (_source_of(self.sources, _join(path, target)) or "").startswith("override")
            shorthand_by_override = f.name in data and (_source_of(self.sources, sub) or "").startswith("override")
            if shorthand_by_override and not by_override:  # the command line's shorthand over a file's key
                data = _with_value(data, target, value) or data
                continue
            try:  # the key wins; the shorthand follows it
                own = self.convert(given, hints[f.name], sub)
            except ConfigError:
                own = unless[0] if unless else None
            if own is None:
                raise ConfigError(f"{_join(path, target)} = {given!r} contradicts {sub} = {value!r}; remove one",
                                  key=_join(path, target), source=_source_of(self.sources, _join(path, target)))
            data = {**data, f.name: own}
        return data

    def moved_key(self, path: str, key: str, new: str | tuple[str, ...], value: Any) -> ConfigError:
        """An old key (class attribute ``MOVED_KEYS = {old: new or (new, ...)}``, keys relative to the section):
        one line naming the new key(s) and how to write the value there."""
        targets = [_join(path, n) for n in ((new,) if isinstance(new, str) else new)]
        shown = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        fix = " or ".join(f"{t}={shown}" for t in targets)
        return self.error(_join(path, key), lambda k, at: (
            f"'{k}'{at} is an old key: it is now {' or '.join(targets)} (options belong to the implementation that "
            f"reads them; flowcredit train --help-config lists them); write {fix}"
        ))

    def check_options(self, registry_key: str, name_field: str, options_field: str, fields: dict, kwargs: dict,
                      path: str) -> None:
        """A `{name, options}` section: the name must be registered and the options must build the named
        implementation's options dataclass (config/registry.py). Skipped while the registry's package is not
        imported (the component checks its options when it is built)."""
        from .registry import REGISTRIES

        reg = REGISTRIES.get(registry_key)
        if reg is None:
            return
        name = kwargs[name_field] if name_field in kwargs else _default(fields[name_field])
        spec = reg.get(name)
        if spec is None:
            if reg.allow_paths and ":" in str(name):
                return  # a 'package.module:function' plugin: resolved (and its options checked) when built
            what, choices = reg.what, reg.choices(name)
            raise self.error(
                _join(path, name_field), lambda key, at: f"'{key}'{at} is {name!r}, not a registered {what}; {choices}"
            )
        sub = _join(path, options_field)
        self.labels[sub] = f"the options of {reg.what} {name!r}"
        self.build(spec.options, kwargs.get(options_field) or {}, sub)

    def build(self, cls: type[T], data: Mapping, path: str) -> T:
        """Build dataclass `cls` from mapping `data` found at dotted `path`."""
        hints = _type_hints(cls)
        fields = {f.name: f for f in _init_fields(cls)}
        section = f"'{path}'" if path else "the top level"
        if path in self.labels:
            section += f" ({self.labels[path]})"

        moved: Mapping[str, str | tuple[str, ...]] = getattr(cls, "MOVED_KEYS", {})
        for key in data:
            if key not in fields and key in moved:
                raise self.moved_key(path, str(key), moved[key], data[key])
            if key not in fields:
                close = difflib.get_close_matches(str(key), list(fields), n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                tail = "" if close else "; remove it or move it to the section it belongs to"
                valid = f"valid keys in {section}: {', '.join(fields) or '(none)'}{tail}"
                fix = f"{hint}{valid}"

                def unknown(k: str, at: str, fix: str = fix) -> str:
                    return f"unknown key '{k}'{at}; {fix}"

                raise self.error(_join(path, key), unknown)

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
                    f"missing required key '{sub}' (type {_type_name(hints[name])}) in {section}{_at(source)}; set it "
                    f"in the YAML or with the override {sub}=VALUE",
                    key=sub,
                    source=source,
                )

        for name, f in fields.items():
            if "options_of" in f.metadata:
                self.check_options(f.metadata["options_of"], f.metadata.get("name_field", "name"), name, fields,
                                   kwargs, path)
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


def build_options(cls: type[T], data: Mapping[str, Any] | None, path: str, *, source: str | None = None,
                  label: str | None = None) -> T:
    """An options dataclass found at dotted `path` (e.g. "credit.options"), built as strictly as `from_dict` builds a
    config; every message names ``path.KEY`` (and `source` when given; `label` says whose options they are)."""
    builder = _Builder({"": source} if source else {})
    if label:
        builder.labels[path] = label
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise builder.wrong_type(path, data, cls)
    return builder.build(cls, data, path)
