"""Numeric ranges declared in field metadata (`ge`, `gt`, `le`, `lt`) and their check; `check_values` adds the
`Literal` choices, for options objects built in code."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from .annotations import _init_fields, _is_union, _type_hints
from .keys import ConfigError, _item, _join


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


def _choices(tp: Any) -> tuple | None:
    """The allowed values of a `Literal[...]` annotation (also inside Optional), else None."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if _is_union(tp):
        lits = [a for a in typing.get_args(tp) if typing.get_origin(a) is Literal]
        if lits:
            return tuple(v for a in lits for v in typing.get_args(a)) + ((None,) if type(None) in typing.get_args(tp)
                                                                         else ())
    return None


def check_values(obj: Any, path: str = "") -> None:
    """`check_ranges` plus the `Literal` choices of every field of a dataclass built in code (e.g. the options
    dataclass of a credit method: ``StepwiseOptions(norm="joined")``); a loaded config was checked already.

    Raises:
        ConfigError: ``key = value must be one of ...`` or ``... must be in ...``, naming the dotted key.
    """
    hints = _type_hints(type(obj))
    for f in _init_fields(type(obj)):
        allowed = _choices(hints[f.name])
        value = getattr(obj, f.name)
        if allowed is not None and value not in allowed:
            key = _join(path, f.name)
            raise ConfigError(f"{key} = {value!r} must be one of {', '.join(map(repr, allowed))}", key=key)
    check_ranges(obj, path)
