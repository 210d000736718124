"""Reading dataclass fields and type annotations, and naming types and values in messages."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

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
    return f.default_factory()  # type: ignore[misc,operator]  # MISSING ruled out by _has_default


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
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        keys = ", ".join(f.name for f in _init_fields(tp))
        return f"write a mapping with keys among: {keys}"
    return f"write a value of type {_type_name(tp)}"
