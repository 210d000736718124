"""YAML presets + dotlist overrides -> typed, nested dataclasses (STYLE.md R3).

The schema is plain ``@dataclass``es whose fields carry ``metadata={"help": "..."}``. This package is the generic
machinery around it and knows nothing about the project's schema; this module is its front door:

* ``load_yaml(path)`` (files.py) reads a YAML file and records the line of every key, so errors can say
  ``file.yaml:LINE``. A file may start from another one with ``base: other.yaml`` (deep merge, lists are replaced).
* ``apply_overrides(data, ["sampler.noise_level=0.5", ...])`` (overrides.py) applies command-line dotlist overrides;
  ``load_config`` reads ``SECTION=NAME`` as ``SECTION.name=NAME`` for a top-level section with a ``name`` field
  (``objective=awm``).
* ``from_dict(cls, data)`` (build.py) builds the dataclasses strictly: unknown keys, wrong types and values outside a
  ``Literal`` are errors that name the key, where it came from and how to fix it. This is what prevents the
  flow_grpo "dead key" bug (STYLE.md §4.2): a key the code never reads can't be set.
* ``load_config(cls, "tiny", overrides)`` does all three; ``to_dict``/``dump_yaml`` write the fully resolved config
  back (it loads again to an equal object); ``describe(cls)`` is the ``--help-config`` listing.

Helpers: keys.py (dotted keys, source maps, ``ConfigError``), annotations.py (field types and their names in
messages), ranges.py (declared numeric ranges). Libraries weighed for build.py and not used (each
would wrap, not replace, this code): dacite reports an unknown key without its section and keeps an int in a float
field; pydantic reads the metadata ranges and locates errors, but its lax mode turns "3" into 3 and "yes" into true
(rules below reject both), its strict mode refuses mappings for dataclass fields, and it would be a new dependency.

Field metadata the loader reads besides ``help``:

* ranges: ``ge``, ``gt``, ``le``, ``lt`` (>=, >, <=, <) bound a number, each item of a list of numbers, or each
  value of a mapping of numbers; null passes (an ``Optional`` field is checked when set). Every value read is
  checked right after its type, before any ``__post_init__`` runs, so cross-field checks may assume ranges hold::

      ConfigError: run.iterations = -5 (override 'run.iterations=-5') must be >= 0

  ``check_ranges(obj)`` runs the same check on an object built in code.
* links: ``sets="section.key"`` (relative to the field's dataclass) makes the field a shorthand: its value is the
  default of that key, except for the values in ``unless=(...)``; when both are set, the explicit key wins and the
  shorthand follows it (unless only the shorthand came from the command line; build.py ``apply_links``). This is
  how ``method`` picks ``credit.name``.

Every problem is raised as a one-line ``ConfigError``. Example::

    >>> cfg = load_config(TrainCfg, "tiny", ["sampler.noise_levle=0.5"], preset_dirs=[configs_dir])
    ConfigError: unknown key 'sampler.noise_levle' at override 'sampler.noise_levle=0.5'; did you mean
    'noise_level'? valid keys in 'sampler': noise_level, num_steps

Type rules: ``int`` -> ``float`` is accepted, and so is a string a float parses (YAML 1.1 reads ``1e-4`` as a
string); ``bool`` accepts only ``true``/``false`` (not 0/1 or ``yes``-strings); ``int`` never accepts floats or
strings; ``str`` never accepts numbers (quote them); ``None`` only where the type is ``Optional``. Supported types:
``bool, int, float, str, pathlib.Path, Any, Literal[...], Optional/Union, list[T], tuple[T, ...], tuple[A, B],
dict[K, V]`` and nested dataclasses (also inside lists and dicts).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .annotations import _default, _has_default, _init_fields, _is_union, _type_hints, _type_name
from .build import check_ranges, from_dict, range_text
from .files import (
    END_LINE,
    END_NOTE,
    YAML_VALUE_ERRORS,
    _looks_like_path,
    _preset_files,
    _unknown_preset,
    list_presets,
    load_yaml,
)
from .keys import ConfigError, _is_under, _join
from .keys import _display_path as _display
from .overrides import _apply_overrides, apply_overrides

__all__ = [
    "ConfigError",
    "apply_overrides",
    "check_ranges",
    "describe",
    "dump_yaml",
    "fields_without_help",
    "from_dict",
    "list_presets",
    "load_config",
    "load_yaml",
    "range_text",
    "to_dict",
]

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------------------------
# load_config: the one call the CLI and tests use
# ----------------------------------------------------------------------------------------------------------------


def load_config(
    cls: type[T],
    path_or_name: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    preset_dirs: Iterable[str | os.PathLike] = (),
    migrate: bool = False,
) -> T:
    """YAML file or preset (if any) + dotlist overrides -> validated dataclass `cls`.

    Args:
        cls: the root config dataclass.
        path_or_name: a YAML path, or a bare preset name looked up as ``<dir>/<name>.yaml`` in `preset_dirs`;
            None means "dataclass defaults".
        overrides: ``key=value`` strings applied after the file (see `apply_overrides`).
        preset_dirs: directories of named presets, searched in order.
        migrate: the file is a resolved config written by an older version (a run's config.yaml): move its old
            flat keys to their new places first (`registry.migrate_moved_keys`; one stderr note per key).

    Example::

        cfg = load_config(TrainCfg, "tiny", ["sampler.noise_level=0.5"], preset_dirs=["configs"])

    Raises:
        ConfigError: see `load_yaml`, `apply_overrides` and `from_dict`; an unknown preset lists the available
            ones with a suggestion.
    """
    preset_dirs = list(preset_dirs)
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path_or_name is not None:
        if _looks_like_path(path_or_name) or Path(path_or_name).is_file():
            path = Path(path_or_name)
            if not path.is_file():
                raise ConfigError(
                    f"config file '{os.fspath(path_or_name)}' not found; give an existing .yaml path"
                    + (f" or a preset name ({', '.join(list_presets(preset_dirs))})" if preset_dirs else ""),
                    source=os.fspath(path_or_name),
                )
        else:
            name = os.fspath(path_or_name)
            found = _preset_files(preset_dirs).get(name)
            if found is None:
                raise _unknown_preset(name, preset_dirs)
            path = found
        data, sources = load_yaml(path, preset_dirs=preset_dirs)
        if migrate:
            from .registry import migrate_moved_keys

            data, notes = migrate_moved_keys(cls, data)
            if notes:
                print(f"note: {_display(path)} was written by an older flowcredit; read with {'; '.join(notes)}",
                      file=sys.stderr)

    overrides = _name_shorthand(cls, list(overrides))
    data = _drop_replaced_options(data, overrides)
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


def _name_shorthand(cls: type, overrides: list[str]) -> list[str]:
    """`SECTION=NAME` for a top-level section whose dataclass has a `name` field means `SECTION.name=NAME`
    (`objective=awm`, `sampler=ddim_sde`, `reward=clip`: the registry-backed sections), so the short form picks an
    implementation the way `SECTION.name=` does, dropping the file's options of the old one. A mapping value
    (`objective={name: awm, options: {...}}`) is left as it is."""
    hints = _type_hints(cls)
    out = []
    for o in overrides:
        key, sep, raw = o.partition("=") if isinstance(o, str) else ("", "", "")
        tp = hints.get(key.strip()) if sep and "." not in key else None
        if tp is not None and dataclasses.is_dataclass(tp) and "name" in {f.name for f in dataclasses.fields(tp)}:
            try:
                value = yaml.safe_load(raw) if raw.strip() else None
            except (yaml.YAMLError, *YAML_VALUE_ERRORS):
                value = None  # apply_overrides reports it
            if isinstance(value, str):
                o = f"{key.strip()}.name={raw}"
        out.append(o)
    return out


def _drop_replaced_options(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A `SECTION.name=X` override naming another implementation than the file's drops the file's SECTION.options:
    they are the options of the file's implementation (e.g. `model.name=sd3` on a tiny preset, `objective.name=awm`
    on tiny_nft; the run's config.yaml shows what was used); `SECTION.options.*` overrides then apply to the new
    one."""
    pairs = [(t.split("=", 1)[0].strip(), t.split("=", 1)[1]) for t in overrides if isinstance(t, str) and "=" in t]
    out = data
    for key, raw in pairs:
        section, _, leaf = key.partition(".")
        node = data.get(section)
        if leaf != "name" or not isinstance(node, dict) or not isinstance(node.get("options"), dict):
            continue
        try:
            new = yaml.safe_load(raw) if raw.strip() else None
        except (yaml.YAMLError, *YAML_VALUE_ERRORS):
            continue  # apply_overrides reports it
        if not node["options"] or new == node.get("name"):
            continue
        if out is data:
            out = copy.deepcopy(data)
        del out[section]["options"]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Writing the resolved config back, and the help listing
# ----------------------------------------------------------------------------------------------------------------


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
    if isinstance(obj, Path):
        return str(obj)
    return copy.deepcopy(obj)


def dump_yaml(obj: Any, path: str | os.PathLike | None = None) -> str:
    """The fully resolved config as YAML; also written to `path` if given (e.g. next to a checkpoint).

    The text loads back to an equal object with ``load_config(type(obj), path)``. A shorthand field (metadata
    ``sets=``, e.g. ``method``) is left out: the key it sets (``credit.name``) says what ran, and sets it back.
    """
    name = type(obj).__name__
    header = (f"# Fully resolved {name} written by flowcredit.config.dump_yaml; load with load_config({name}, path); "
              f"{END_NOTE}\n")
    data = to_dict(obj)
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.metadata.get("sets") and isinstance(data, dict):
                data.pop(f.name, None)
    text = header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=119) + END_LINE + "\n"
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def _format_default(value: Any) -> str:
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, sort_keys=False, width=10**6).strip()
    text = text.removesuffix("...").strip()
    return text if len(text) <= 70 else text[:67] + "..."


def _item_dataclass(tp: Any) -> type | None:
    """The dataclass inside list[D] / tuple[D, ...] / dict[str, D] / Optional[...] annotations, if any."""
    if _is_union(tp):
        for a in typing.get_args(tp):
            found = _item_dataclass(a)
            if found is not None:
                return found
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    item = args[0] if origin in (list, tuple, Sequence) and args else None
    if origin in (dict, Mapping) and len(args) == 2:
        item = args[1]
    if dataclasses.is_dataclass(item) and isinstance(item, type):
        return item
    return None


def _walk_fields(cls: type, path: str) -> Iterable[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) for every field, sections before their contents."""
    hints = _type_hints(cls)
    for f in _init_fields(cls):
        sub = _join(path, f.name)
        tp = hints[f.name]
        yield sub, f, tp
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            yield from _walk_fields(tp, sub)
        else:
            item = _item_dataclass(tp)
            if item is not None:
                origin = typing.get_origin(tp)
                yield from _walk_fields(item, sub + (".<name>" if origin in (dict, Mapping) else "[]"))


def describe(cls: type) -> str:
    """Help listing of every dotted key of a config class: type, default, declared range and help text.

    Items of lists of sections are shown as ``key[].field``; values of dicts of sections as ``key.<name>.field``.
    """
    out = [f"{cls.__name__}: set keys in a YAML file or as key=value overrides (e.g. sampler.noise_level=0.5)", ""]
    for key, f, tp in _walk_fields(cls, ""):
        help_text = f.metadata.get("help", "(no help text)")
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            out.append(f"{key}:  [section {tp.__name__}]")
        else:
            default = f"= {_format_default(_default(f))}" if _has_default(f) else "(required)"
            rng = range_text(f.metadata)
            out.append(f"{key}: {_type_name(tp)} {default}" + (f", range {rng}" if rng else ""))
        out.append(f"    {help_text}")
    return "\n".join(out) + "\n"


def fields_without_help(cls: type) -> list[str]:
    """Dotted keys whose field has no ``metadata={"help": ...}`` (for a schema test: every knob is explained)."""
    return [key for key, f, _ in _walk_fields(cls, "") if not str(f.metadata.get("help", "")).strip()]
