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
        self.key, self.source = key, source


def _join(path: str, key: Any) -> str:
    """Dotted key of a mapping entry: _join("a", "b") -> "a.b"."""
    return f"{path}.{key}" if path else str(key)


def _item(path: str, index: int) -> str:
    """Dotted key of a list item: _item("a.b", 3) -> "a.b[3]"."""
    return f"{path}[{index}]"


def _is_under(path: str, prefix: str) -> bool:
    """True if `path` is `prefix` or lies inside it."""
    return not prefix or path == prefix or path.startswith((prefix + ".", prefix + "["))


def _source_of(sources: SourceMap, path: str) -> str | None:
    """Where the value at `path` came from: its own entry, else one inside it, else the enclosing section's."""
    if path in sources:
        return sources[path]
    inside = next((v for k, v in sources.items() if k and _is_under(k, path)), None)
    while inside is None and path:
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
        inside = sources.get(path)
    return inside if inside is not None else sources.get("")


def _sources_inside(sources: SourceMap, path: str) -> list[str]:
    """Every distinct source of values inside a section (for errors about the section as a whole)."""
    found = [v for k, v in sources.items() if k and _is_under(k, path)]
    own = _source_of(sources, path)
    return list(dict.fromkeys(found)) if found else [own] if own else []


def _at(source: str | None) -> str:
    return f" at {source}" if source else ""


def _display_path(path: Path) -> str:
    """A path for messages: relative to the working directory when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
