"""`_h`: a config field with its help sentence and numeric range, shared by the schema modules."""

from __future__ import annotations

from dataclasses import field


def _h(default, text: str, *, ge=None, gt=None, le=None, lt=None, **kw):
    """A field with a help sentence and, for numbers, its allowed range (>= ge, > gt, <= le, < lt; None = unbounded).

    The range is checked by the loader (config/load.py) for every value a YAML file or an override sets, shown by
    `flowcredit train --help-config`, and also holds for each item of a list or value of a mapping of numbers.
    """
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return field(default=default, metadata={"help": text, **bounds}, **kw)
