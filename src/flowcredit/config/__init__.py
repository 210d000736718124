"""Typed configs: nested dataclasses, validated by pydantic, loaded strictly from YAML presets plus ``key=value``
overrides. See ``load.py`` for the rules. Typical use::

    from flowcredit.config import load_config
    cfg = load_config(TrainCfg, "tiny", ["sampler.noise_level=0.5"], preset_dirs=["configs"])
"""

from flowcredit.config.load import (
    ConfigError,
    apply_overrides,
    check_ranges,
    describe,
    dump_yaml,
    fields_without_help,
    from_dict,
    list_presets,
    load_config,
    load_yaml,
    range_text,
    to_dict,
)

__all__ = ["ConfigError", "apply_overrides", "check_ranges", "describe", "dump_yaml", "fields_without_help",
           "from_dict", "list_presets", "load_config", "load_yaml", "range_text", "to_dict"]
