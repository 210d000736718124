"""Reading dataclass fields and type annotations, and naming types and values in messages."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    """Resolved field types (string annotations from `from __future__ import annotations` included)."""
    return _HINTS.get(cls) or _HINTS.setdefault(cls, typing.get_type_hints(cls))


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc,operator]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    """Readable name of a type annotation: "float | null", "list[RewardComponent]", "'sde' | 'ode'"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None) or tp is Any:
        return "null" if tp is type(None) else "any"
    if origin is Literal or _is_union(tp):
        return " | ".join(repr(a) if origin is Literal else _type_name(a) for a in args)
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
    return f"{names.get(type(value), type(value).__name__)} {text if len(text) <= 60 else text[:57] + '...'}"


def _how_to_write(tp: Any) -> str:
    """The 'fix' part of a wrong-type message."""
    origin = typing.get_origin(tp)
    if tp in (bool, int, float, str, Path):
        return {bool: "write true or false", int: "write a whole number such as 10",
                float: "write a number such as 0.5 or 1e-4"}.get(
            tp, "write text, quoted if YAML would read it as something else (e.g. '1.0', 'yes', 'null')")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        return "write a YAML list such as [a, b] (override: key=[a,b])"
    if origin in (dict, Mapping) or tp is dict:
        return "write a mapping such as {key: value}"
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return f"write a mapping with keys among: {', '.join(f.name for f in _init_fields(tp))}"
    return f"write a value of type {_type_name(tp)}"
