"""YAML presets + dotlist overrides -> typed, nested dataclasses (STYLE.md R3); the front door of this package.

The schema is plain ``@dataclass``es whose fields carry ``metadata={"help": "...", "ge": 0, ...}`` (schema.py);
pydantic v2 validates them (build.py). Our own code is only what pydantic lacks:

* ``load_yaml(path)`` (files.py) reads a YAML file with the line of every key, so errors say ``file.yaml:LINE``; a
  file may start from another with ``base: other.yaml`` (deep merge, lists are replaced).
* ``apply_overrides(data, ["sampler.noise_level=0.5", ...])`` (overrides.py) applies ``key=value`` overrides;
  ``load_config`` reads ``SECTION=NAME`` as ``SECTION.name=NAME`` for a section with a ``name`` field.
* ``from_dict(cls, data)`` (build.py) validates and builds: an unknown key, a wrong type, a value outside a
  ``Literal`` or its range is one ``ConfigError`` line naming the key, where it was set and the fix, with a "did you
  mean" for typos. This is what prevents the flow_grpo "dead key" bug (STYLE.md §4.2)::

    ConfigError: unknown key 'sampler.noise_levle' at override 'sampler.noise_levle=0.5'; did you mean
    'noise_level'? valid keys in 'sampler': noise_level, num_steps

* ``load_config(cls, "tiny", overrides)`` does all three; ``to_dict``/``dump_yaml`` write the resolved config back
  (it loads again to an equal object); ``describe(cls)`` is the ``--help-config`` listing.

Field metadata besides ``help``: ranges ``ge``, ``gt``, ``le``, ``lt`` bound a number, each item of a list or each
value of a mapping (checked before any ``__post_init__`` runs, so cross-field checks may assume them; ``check_ranges``
checks an object built in code); ``sets="section.key"`` with ``unless=(...)`` makes a field a shorthand for another
key (``method`` for ``credit.name``; build.py ``apply_links``); ``options_of="registry"`` (registry.py).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from . import files
from .annotations import _default, _has_default, _init_fields, _is_union, _type_hints, _type_name
from .build import check_ranges, from_dict, range_text
from .files import list_presets, load_yaml
from .keys import ConfigError, _is_under, _join
from .overrides import _apply_overrides, apply_overrides

__all__ = ["ConfigError", "apply_overrides", "check_ranges", "describe", "dump_yaml", "fields_without_help",
           "from_dict", "list_presets", "load_config", "load_yaml", "range_text", "to_dict"]

T = TypeVar("T")



def load_config(cls: type[T], path_or_name: str | os.PathLike | None = None, overrides: Iterable[str] = (),
                preset_dirs: Iterable[str | os.PathLike] = ()) -> T:
    """YAML file or preset (if any) + ``key=value`` overrides -> validated dataclass `cls`.

    `path_or_name` is a YAML path, or a preset name looked up as ``<dir>/<name>.yaml`` in `preset_dirs` (None: the
    defaults).
    ConfigError: see `load_yaml`, `apply_overrides` and `from_dict`; an unknown preset lists the available ones.
    """
    preset_dirs = list(preset_dirs)
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path_or_name is not None:
        path = Path(path_or_name)
        if not (files._looks_like_path(path_or_name) or path.is_file()):
            found = files._preset_files(preset_dirs).get(os.fspath(path_or_name))
            if found is None:
                raise files._unknown_preset(os.fspath(path_or_name), preset_dirs)
            path = found
        elif not path.is_file():
            raise ConfigError(f"config file '{os.fspath(path_or_name)}' not found; give an existing .yaml path"
                              + (f" or a preset name ({', '.join(list_presets(preset_dirs))})" if preset_dirs else ""),
                              source=os.fspath(path_or_name))
        data, sources = load_yaml(path, preset_dirs=preset_dirs)
    data, overrides = _section_names(cls, data, list(overrides))
    data, override_sources = _apply_overrides(data, overrides)
    for key in override_sources:  # an override replaces the whole subtree the file had set
        for k in [k for k in sources if k and _is_under(k, key)]:
            del sources[k]
    sources.update(override_sources)
    run = data.get("run")
    if isinstance(run, Mapping) and run.get("plugins"):  # run.plugins register before the names are checked
        from .registry import import_plugins

        import_plugins(run["plugins"], sources.get("run.plugins") or sources.get("run"))
    return from_dict(cls, data, source=sources)


def _section_names(cls: type, data: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`SECTION=NAME` for a top-level section whose dataclass has a `name` field means `SECTION.name=NAME`
    (`objective=awm`, `sampler=ddim_sde`; a mapping value is left as it is). A `SECTION.name=X` naming another
    implementation than the file's drops the file's SECTION.options: they are the old implementation's (e.g.
    `model.name=sd3` on a tiny preset); `SECTION.options.*` overrides then apply to the new one."""
    out, hints = [], _type_hints(cls)
    for o in overrides:
        key, sep, raw = o.partition("=") if isinstance(o, str) else ("", "", "")
        key = key.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except (yaml.YAMLError, *files.YAML_VALUE_ERRORS):
            out.append(o)  # apply_overrides reports it
            continue
        tp = hints.get(key) if sep and "." not in key else None
        if tp is not None and dataclasses.is_dataclass(tp) and "name" in {f.name for f in dataclasses.fields(tp)}:
            key, o = (f"{key}.name", f"{key}.name={raw}") if isinstance(value, str) else (key, o)
        section, _, leaf = key.partition(".")
        node = data.get(section)
        options = node.get("options") if isinstance(node, dict) else None
        if sep and leaf == "name" and isinstance(node, dict) and isinstance(options, dict) and options \
                and value != node.get("name"):
            data = {**data, section: {k: v for k, v in node.items() if k != "options"}}
        out.append(o)
    return data, out


def to_dict(obj: Any) -> Any:
    """Plain YAML-ready data of a config: dataclasses -> dicts, tuples -> lists, Paths -> str.

    Fields with ``init=False`` (derived values) are left out, so ``from_dict(type(obj), to_dict(obj)) == obj``.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in _init_fields(type(obj))}
    if isinstance(obj, Mapping):
        return {to_dict(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else copy.deepcopy(obj)


def dump_yaml(obj: Any, path: str | os.PathLike | None = None) -> str:
    """The fully resolved config as YAML; also written to `path` if given (e.g. next to a checkpoint).

    The text loads back to an equal object with ``load_config(type(obj), path)``. A shorthand field (metadata
    ``sets=``, e.g. ``method``) is left out: the key it sets (``credit.name``) says what ran, and sets it back.
    """
    name = type(obj).__name__
    data = to_dict(obj)
    for f in dataclasses.fields(obj) if isinstance(data, dict) else ():
        if f.metadata.get("sets"):
            data.pop(f.name, None)
    text = (f"# Fully resolved {name} written by flowcredit.config.dump_yaml; load with load_config({name}, path); "
            f"{files.END_NOTE}\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=119)
            + files.END_LINE + "\n")
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def _flow(value: Any) -> str:
    """`value` as one line of YAML."""
    return yaml.safe_dump(to_dict(value), default_flow_style=True, sort_keys=False, width=10**6).strip().removesuffix(
        "...").strip()


def _field_lines(key: str, f: dataclasses.Field, tp: Any, indent: str = "") -> list[str]:
    """--help-config: ``key: type = default, range R`` (or ``[section X]``), then the help sentence."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        line = f"{key}:  [section {tp.__name__}]"
    else:
        text = _flow(_default(f)) if _has_default(f) else ""
        default = f"= {text if len(text) <= 70 else text[:67] + '...'}" if _has_default(f) else "(required)"
        rng = range_text(f.metadata)
        line = f"{key}: {_type_name(tp)} {default}" + (f", range {rng}" if rng else "")
    return [indent + line, f"{indent}    {f.metadata.get('help', '(no help text)')}"]


def _walk_fields(cls: type, path: str) -> Iterable[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) for every field, sections before their contents; the fields of the sections in a
    list are shown as ``key[].field``, in a dict as ``key.<name>.field``."""
    for f in _init_fields(cls):
        sub, tp = _join(path, f.name), _type_hints(cls)[f.name]
        yield sub, f, tp
        for arm in typing.get_args(tp) if _is_union(tp) else (tp,):
            origin, args = typing.get_origin(arm), typing.get_args(arm)
            inner, suffix = (args[-1], ".<name>") if origin in (dict, Mapping) else (args[0] if args else None, "[]")
            if dataclasses.is_dataclass(arm) and isinstance(arm, type):
                yield from _walk_fields(arm, sub)
            elif origin is not None and dataclasses.is_dataclass(inner) and isinstance(inner, type):
                yield from _walk_fields(inner, sub + suffix)


def describe(cls: type) -> str:
    """Help listing of every dotted key of a config class: type, default, declared range and help text."""
    out = [f"{cls.__name__}: set keys in a YAML file or as key=value overrides (e.g. sampler.noise_level=0.5)", ""]
    for key, f, tp in _walk_fields(cls, ""):
        out += _field_lines(key, f, tp)
    return "\n".join(out) + "\n"


def fields_without_help(cls: type) -> list[str]:
    """Dotted keys whose field has no ``metadata={"help": ...}`` (for a schema test: every knob is explained)."""
    return [key for key, f, _ in _walk_fields(cls, "") if not str(f.metadata.get("help", "")).strip()]
