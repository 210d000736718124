"""Command-line `key=value` overrides (dotlists) applied to nested mappings."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .annotations import _describe_value
from .files import load_yaml_value
from .keys import ConfigError, _is_under, _item, _join

_SEGMENT = re.compile(r"([^.\[\]]+)((?:\[\d+\])*)")


def _parse_override_key(key: str, text: str) -> list[str | int]:
    """ "a.b[1].c" or "a.b.1.c" -> ["a", "b", 1, "c"] (numbers index lists where a list is found)."""
    parts: list[str | int] = []
    for seg in key.split("."):
        m = _SEGMENT.fullmatch(seg)
        if m is None:
            raise ConfigError(f"override '{text}' has a malformed key '{key}'; write dotted keys like "
                              "sampler.noise_level=0.5", source=f"override '{text}'")
        parts.append(int(m.group(1)) if m.group(1).isdigit() else m.group(1))
        parts.extend(int(i) for i in re.findall(r"\d+", m.group(2)))
    return parts


def _apply_overrides(data: Mapping, overrides: Iterable[str]) -> tuple[dict, dict[str, str]]:
    """apply_overrides, also returning the source map (dotted key -> "override '...'")."""
    out = copy.deepcopy(dict(data)) if data else {}
    sources: dict[str, str] = {}
    for text in overrides:
        if not isinstance(text, str) or "=" not in text:
            raise ConfigError(f"override {text!r} is not of the form key=value; write e.g. sampler.noise_level=0.5 "
                              "(dotted key, '=', a YAML value such as 1e-4, true, null or [1,2])",
                              source=f"override {text!r}")
        key, raw = text.split("=", 1)
        where = f"override '{text}'"
        parts = _parse_override_key(key.strip(), text)
        value = load_yaml_value(raw, where) if raw.strip() else None  # as strictly as a file
        node: Any = out
        path = ""
        for i, part in enumerate(parts):
            if isinstance(node, list) and not isinstance(part, int):
                raise ConfigError(f"{where}: '{path}' is a list, so the next key must be an item number, got "
                                  f"'{part}'", key=path, source=where)
            if isinstance(node, list) and not 0 <= part < len(node):  # type: ignore[operator]
                raise ConfigError(f"{where}: '{path}' has {len(node)} items, so item {part} does not exist; set the "
                                  f"whole list instead, e.g. {path.replace('[', '.').replace(']', '')}=[...]",
                                  key=path, source=where)
            if not isinstance(node, (list, dict)):
                raise ConfigError(f"{where}: '{path}' is {_describe_value(node)}, not a section, so it has no key "
                                  f"'{part}'; override '{path}' itself or fix the key", key=path, source=where)
            part = part if isinstance(node, list) else str(part)
            path = _item(path, part) if isinstance(part, int) else _join(path, part)
            if i == len(parts) - 1:
                node[part] = value  # type: ignore[index]  # an int for a list (checked above)
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}  # a section the file did not set, or an empty `section:` header
                node = node[part]
        for k in [k for k in sources if _is_under(k, path)]:  # later overrides win, also inside the same subtree
            del sources[k]
        sources[path] = where
    return out, sources


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply dotlist overrides to a nested dict (returns a new dict; `data` is not modified).

    Each override is ``a.b.c=value``; the value is parsed as YAML, so ``1e-4``, ``true``, ``null``, ``[1,2]`` and
    ``{name: x}`` work, and an empty value means null. List items are addressed as ``a.b.1.c`` or ``a.b[1].c`` when
    the list is already in `data`. Keys are not checked here: `from_dict` rejects unknown ones and names the
    override. ConfigError: an override without ``=``, a malformed key, a value that is not YAML, or a key that walks
    into a non-section value.
    """
    return _apply_overrides(data, overrides)[0]
