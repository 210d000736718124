"""Registries: name → implementation + its own options dataclass + what it requires, declared once per component.

A component package owns one registry and registers each built-in with one line::

    CREDIT = Registry("credit", "credit method")                             # flowcredit/credit/registry.py
    CREDIT.register("stepwise", stepwise_advantages, StepwiseOptions, requires=("step_rewards",), help="...")

and the schema's `{name, options}` sections point at it from the field metadata of `options`
(``options_of="credit"``). The loader (config/build.py) then checks the name against the registry and the options
against the named implementation's dataclass with the rules and messages of every other key. `flowcredit train
--help-config` lists every registered implementation with its options (`describe_registries`).

The class lives in `config` so that config can check options while importing no component: components import
config, never the reverse. A registry is known to the loader once its package has been imported (the trainer and the
CLI import all of them); a config loaded before that is checked when the component is built (`Registry.options`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .annotations import _default, _has_default, _init_fields, _type_hints
from .build import build_options
from .keys import ConfigError


@dataclass(frozen=True)
class NoOptions:
    """The options of an implementation that has none (any key given is an error)."""


@dataclass(frozen=True)
class Spec:
    """One registered implementation: its config name, the function / builder / class the component calls, its
    options dataclass (every field with a default, a help text and, for numbers, a range), what the trainer must
    compute for it (credit: "step_rewards", "instant_rewards"; objective: "log_probs"), one sentence for
    --help-config and registry-specific facts (e.g. a sampler's default noise level)."""

    name: str
    fn: Any
    options: type = NoOptions
    requires: tuple[str, ...] = ()
    help: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)


REGISTRIES: dict[str, Registry] = {}  # registry key → registry, filled as component packages are imported


class Registry:
    """name → Spec for one kind of component (credit methods, objectives, samplers, model families, ...).

    `key` is the registry's name in the schema's ``options_of`` metadata ("credit", "sampler", ...), `what` what one
    entry is ("credit method"), `name_key` / `options_key` the config keys of the name and the options (default
    ``<key>.name`` / ``<key>.options``); with `allow_paths` a ``"package.module:function"`` name is accepted too.
    """

    def __init__(self, key: str, what: str, *, name_key: str | None = None, options_key: str | None = None,
                 allow_paths: bool = False):
        self.key, self.what, self.allow_paths = key, what, allow_paths
        self.name_key = name_key or f"{key}.name"
        self.options_key = options_key or f"{key}.options"
        self._specs: dict[str, Spec] = {}
        REGISTRIES[key] = self

    def register(self, name: str, fn: Any, options: type = NoOptions, *, requires: tuple[str, ...] = (),
                 help: str = "", replace: bool = False, **extra: Any) -> Spec:
        """Declare implementation `name`; `options` is a dataclass whose fields all have defaults (else TypeError);
        ValueError if `name` is taken (pass replace=True to override on purpose)."""
        if not (dataclasses.is_dataclass(options) and isinstance(options, type)):
            raise TypeError(f"{self.what} {name!r}: options must be a dataclass, got {options!r}")
        missing = [f.name for f in _init_fields(options) if not _has_default(f)]
        if missing:
            raise TypeError(f"{self.what} {name!r}: every option needs a default; {', '.join(missing)} has none")
        if name in self._specs and not replace:
            raise ValueError(f"{self.what} {name!r} is already registered; register under another name")
        self._specs[name] = Spec(name, fn, options, tuple(requires), help, dict(extra))
        return self._specs[name]

    def names(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def get(self, name: str) -> Spec | None:
        return self._specs.get(name)

    def choices(self, name: str) -> str:
        """"use one of a, b, c; did you mean 'b'?" for a name that is not registered."""
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        paths = " (or a 'package.module:function' path)" if self.allow_paths else ""
        return f"use one of {', '.join(self.names())}{paths}" + (f"; did you mean {close[0]!r}?" if close else "")

    def unknown(self, name: str) -> str:
        """The message for a name that is not registered: the valid names and the closest one."""
        return f"{self.name_key}={name!r} is not a registered {self.what}; {self.choices(name)}"

    def spec(self, name: str) -> Spec:
        """The Spec of a registered name. Raises ValueError (one line: the valid names, the closest one)."""
        spec = self._specs.get(name)
        if spec is None:
            raise ValueError(self.unknown(name))
        return spec

    def spec_of_fn(self, fn: Any) -> Spec | None:
        """The Spec registered for function `fn` (a plugin path may name a registered function)."""
        return next((s for s in self._specs.values() if s.fn is fn), None)

    def options(self, name_or_spec: str | Spec, data: Mapping[str, Any] | None, *, source: str | None = None) -> Any:
        """The options dataclass of an implementation built strictly from `data` (None = all defaults); ConfigError
        (an unknown option with a suggestion, a wrong type or choice, a value out of range) naming
        ``<options_key>.KEY``."""
        spec = self.spec(name_or_spec) if isinstance(name_or_spec, str) else name_or_spec
        if isinstance(data, spec.options):
            return data
        label = f"the options of {self.what} {spec.name!r}"
        return build_options(spec.options, data, self.options_key, source=source, label=label)

    def describe(self) -> str:
        """--help-config: every registered implementation and its options (type, default, range, help)."""
        from .load import _field_lines

        lines = [f"{self.name_key} choices ({self.what}s) and their {self.options_key}:"]
        for spec in self._specs.values():
            needs = f" [requires {', '.join(spec.requires)}]" if spec.requires else ""
            lines.append(f"  {self.name_key}={spec.name}: {spec.help}{needs}".rstrip())
            hints = _type_hints(spec.options)
            for f in _init_fields(spec.options):
                lines += _field_lines(f"{self.options_key}.{f.name}", f, hints[f.name], "    ")
            lines += [] if _init_fields(spec.options) else ["    (no options)"]
        return "\n".join(lines)


def describe_registries() -> str:
    """--help-config: every imported registry's implementations and their options."""
    return "\n\n".join(r.describe() for r in REGISTRIES.values())


def _spec_of(section: Mapping, f: dataclasses.Field | None, fields: Mapping[str, dataclasses.Field]) -> Spec | None:
    """The registered implementation a `{name, options}` section's data names (None: not one, or not imported)."""
    reg = REGISTRIES.get(f.metadata.get("options_of", "")) if f is not None else None
    name_field = f.metadata.get("name_field", "name") if f is not None else "name"
    name = section.get(name_field, _default(fields[name_field]) if name_field in fields else None)
    return reg.get(name) if reg is not None and isinstance(name, str) else None


def with_full_options(data: Any, cls: type) -> Any:
    """`to_dict(obj)`-style data of config class `cls` in which every `{name, options}` mapping lists all the options
    of the named implementation (its dataclass defaults filled in), so two configs that differ only by writing a
    default explicitly compare equal (`flowcredit compare --reuse`). Sections whose registry is not imported, or
    whose name it does not know, are left as they are."""
    if not isinstance(data, Mapping) or not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        return data
    out, fields = dict(data), {f.name: f for f in _init_fields(cls)}
    for name, f in fields.items():
        spec = _spec_of(out, f, fields) if "options_of" in f.metadata else None
        if name in out and "options_of" not in f.metadata:
            out[name] = with_full_options(out[name], _type_hints(cls)[name])
        elif name in out and spec is not None and isinstance(out[name], Mapping):
            built = REGISTRIES[f.metadata["options_of"]].options(spec, out[name])
            out[name] = {g.name: getattr(built, g.name) for g in _init_fields(spec.options)}
    return out


def options_field(registry_key: str, help: str, *, name_field: str = "name") -> Any:
    """The `options` field of a `{name, options}` config section: a mapping checked against the options dataclass of
    the implementation named by the sibling field `name_field`, in registry `registry_key`."""
    return field(default_factory=dict, metadata={"help": help, "options_of": registry_key, "name_field": name_field})


def import_plugins(modules: Any, source: str | None) -> None:
    """Import the modules of ``run.plugins`` (each registers components when imported). ConfigError (one line naming
    the key, where it was set and the fix) for a value that is not a list of module names or a module that cannot be
    imported."""
    at = f" ({source})" if source else ""
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(f"run.plugins = {modules!r}{at} must be a list of module names, e.g. "
                          "run.plugins=[my_plugins]", key="run.plugins", source=source)
    for name in modules:
        try:
            import_user_module(name)
        except ImportError as e:
            raise ConfigError(
                f"run.plugins: cannot import {name!r}{at} ({type(e).__name__}: {e}); put {name.split('.')[0]}.py (or "
                "its package) in the folder you run from or on PYTHONPATH", key="run.plugins", source=source) from None


def import_user_module(name: str):
    """`importlib.import_module(name)` with the current folder on the import path (as ``python -m`` has it), for
    the modules a user names: ``run.plugins`` and ``package.module:object`` paths of credit methods and rewards."""
    import importlib
    import os
    import sys

    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(name)
