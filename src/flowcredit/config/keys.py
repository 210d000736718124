"""Dotted keys, source maps and `ConfigError`: every config message names the key and where it was set."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
