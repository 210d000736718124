"""`_h`: a config field with its help sentence and metadata, shared by the schema modules."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def _h(default: Any, text: str, **metadata: Any) -> Any:
    """A field with a help sentence; `default` may be a class (dict, list, a section), the default's factory.

    `metadata` holds the field's numeric range (``ge``, ``gt``, ``le``, ``lt``: >=, >, <=, <), checked for every
    value a file or an override sets (each item of a list, each value of a mapping) and shown by --help-config, or a
    link (``sets=``, ``unless=``; config/build.py).
    """
    return field(**{"default_factory" if isinstance(default, type) else "default": default},
                 metadata={"help": text, **metadata})
