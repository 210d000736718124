"""Every value validated at load (issue 24 item 3, issue 22): declared ranges, where a bad value came from, and
method / credit.name contradictions.

Ranges live in the field metadata (`_h(..., ge=0)` in config/schema.py, `metadata={"gt": 0}` in a plugin's options)
and are checked by pydantic in one place (`flowcredit.config.build`), with each value's type, before any cross-field
check.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Optional

import pytest
import yaml

import flowcredit.trainer.loop  # noqa: F401  (every registry, imported as `flowcredit train` does before loading)
from flowcredit.cli.main import PRESET_DIR
from flowcredit.config import ConfigError, check_ranges, describe, from_dict, load_config, load_yaml, range_text, to_dict
from flowcredit.config.load import _walk_fields
from flowcredit.config.registry import REGISTRIES, describe_registries
from flowcredit.config.schema import TrainConfig
from flowcredit.credit.base import CreditCfg

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _load(name="tiny_flow_grpo", *overrides):
    return load_config(TrainConfig, name, list(overrides), preset_dirs=[PRESET_DIR])


def _error(*args, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        _load(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# (override, the key and value as the message shows them, the range as the message states it)
BAD_VALUES = [
    ("run.iterations=-5", "run.iterations = -5", "must be >= 0"),
    ("run.seed=-1", "run.seed = -1", "must be >= 0"),
    ("run.max_minutes=-1", "run.max_minutes = -1.0", "must be >= 0"),
    ("run.budget_minutes=-0.5", "run.budget_minutes = -0.5", "must be >= 0"),
    ("run.threads=-1", "run.threads = -1", "must be >= 0"),
    ("run.log_every=0", "run.log_every = 0", "must be >= 1"),
    ("run.grid_every=-1", "run.grid_every = -1", "must be >= 0"),
    ("run.checkpoint_every=-1", "run.checkpoint_every = -1", "must be >= 0"),
    ("run.eval_every=-2", "run.eval_every = -2", "must be >= 0"),
    ("run.eval_steps=0", "run.eval_steps = 0", "must be >= 1"),
    ("run.eval_guidance=-1", "run.eval_guidance = -1.0", "must be >= 0"),
    ("run.eval_subset=0", "run.eval_subset = 0", "must be >= 1"),
    ("run.gold_every=-1", "run.gold_every = -1", "must be >= 0"),
    ("run.gold_limit=0", "run.gold_limit = 0", "must be >= 1"),
    ("run.alarm_window=1", "run.alarm_window = 1", "must be >= 2"),
    ("run.alarm_gold_drop=-0.1", "run.alarm_gold_drop = -0.1", "must be >= 0"),
    ("run.alarm_noise_z=-1", "run.alarm_noise_z = -1.0", "must be >= 0"),
    ("run.alarm_alpha=1", "run.alarm_alpha = 1.0", "must be in [0, 1)"),
    ("run.alarm_alpha=-0.05", "run.alarm_alpha = -0.05", "must be in [0, 1)"),
    ("data.group_size=1", "data.group_size = 1", "must be >= 2"),
    ("data.prompts_per_iter=0", "data.prompts_per_iter = 0", "must be >= 1"),
    ("data.batch_size=0", "data.batch_size = 0", "must be >= 1"),
    ("optim.lr=0", "optim.lr = 0.0", "must be > 0"),
    ("optim.lr=-1e-4", "optim.lr = -0.0001", "must be > 0"),
    ("optim.lr=.nan", "optim.lr = nan", "must be > 0"),
    ("optim.betas=[0.9, 1.0]", "optim.betas[1] = 1.0", "must be in [0, 1)"),
    ("optim.weight_decay=-1", "optim.weight_decay = -1.0", "must be >= 0"),
    ("optim.eps=0", "optim.eps = 0.0", "must be > 0"),
    ("optim.grad_clip=0", "optim.grad_clip = 0.0", "must be > 0"),
    ("optim.clip_range=-0.1", "optim.clip_range = -0.1", "must be > 0"),
    ("optim.kl_beta=-0.01", "optim.kl_beta = -0.01", "must be >= 0"),
    ("optim.ema_decay=1", "optim.ema_decay = 1.0", "must be in [0, 1)"),
    ("optim.ema_decay=-0.1", "optim.ema_decay = -0.1", "must be in [0, 1)"),
    ("optim.micro_batch=0", "optim.micro_batch = 0", "must be >= 1"),
    ("optim.inner_epochs=0", "optim.inner_epochs = 0", "must be >= 1"),
    ("optim.updates_per_epoch=0", "optim.updates_per_epoch = 0", "must be >= 1"),
    ("sampler.num_steps=0", "sampler.num_steps = 0", "must be >= 1"),
    ("sampler.timestep_fraction=0", "sampler.timestep_fraction = 0.0", "must be in (0, 1]"),
    ("sampler.timestep_fraction=1.5", "sampler.timestep_fraction = 1.5", "must be in (0, 1]"),
    ("sampler.guidance_scale=-1", "sampler.guidance_scale = -1.0", "must be >= 0"),
    ("sampler.noise_level=-0.7", "sampler.noise_level = -0.7", "must be >= 0"),
    ("sampler.shift=0", "sampler.shift = 0.0", "must be > 0"),
    ("sampler.train_steps_per_sample=-1", "sampler.train_steps_per_sample = -1", "must be >= 0"),
    ("estimate.substeps=0", "estimate.substeps = 0", "must be >= 1"),
    ("estimate.chunk_size=0", "estimate.chunk_size = 0", "must be >= 1"),
    ("estimate.instant_substeps=0", "estimate.instant_substeps = 0", "must be >= 1"),
    ("model.lora_rank=0", "model.lora_rank = 0", "must be >= 1"),
    ("model.lora_alpha=0", "model.lora_alpha = 0.0", "must be > 0"),
    ("faults.max_nonfinite=-1", "faults.max_nonfinite = -1", "must be >= 0"),
    ("faults.reward_retries=-1", "faults.reward_retries = -1", "must be >= 0"),
    ("faults.reward_backoff=-1", "faults.reward_backoff = -1.0", "must be >= 0"),
    ("faults.reward_timeout=-1", "faults.reward_timeout = -1.0", "must be >= 0"),
    ("credit.eps=0", "credit.eps = 0.0", "must be > 0"),
    ("credit.adv_clip=0", "credit.adv_clip = 0.0", "must be > 0"),
]

# A credit method's own options (credit.options), checked against its registered options dataclass.
BAD_OPTIONS = [
    ("tiny_stepwise", "credit.options.ema_decay=1.5", "credit.options.ema_decay = 1.5", "must be in [0, 1]"),
    ("tiny_stepwise", "credit.options.gae_gamma=-0.1", "credit.options.gae_gamma = -0.1", "must be in [0, 1]"),
    ("tiny_stepwise", "credit.options.gae_lambda=2", "credit.options.gae_lambda = 2.0", "must be in [0, 1]"),
    ("tiny_vgpo", "credit.options.gamma=1.1", "credit.options.gamma = 1.1", "must be in [0, 1]"),
    ("tiny_vgpo", "credit.options.adae_k=-1", "credit.options.adae_k = -1.0", "must be >= 0"),
    ("tiny_vgpo", "credit.options.adae_steps=-2", "credit.options.adae_steps = -2", "must be >= -1"),
    ("tiny_stepwise_adae", "credit.anchor_options.adae_k=-1", "credit.anchor_options.adae_k = -1.0", "must be >= 0"),
    ("sd35m_flow_grpo", "model.options.resolution=0", "model.options.resolution = 0", "must be >= 1"),
    ("sd35m_flow_grpo", "model.options.max_sequence_length=0", "model.options.max_sequence_length = 0", "must be >= 1"),
    ("flux1dev_flow_grpo", "model.options.embedded_guidance=-1", "model.options.embedded_guidance = -1.0",
     "must be >= 0"),
]


@pytest.mark.parametrize("override, shown, must", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_value_is_one_line_naming_key_value_source_and_range(override, shown, must):
    msg = _error("tiny_flow_grpo", override)
    assert msg == f"{shown} (override '{override}') {must}"


@pytest.mark.parametrize("preset, override, shown, must", BAD_OPTIONS, ids=[b[1] for b in BAD_OPTIONS])
def test_bad_registered_option_is_one_line_naming_key_value_source_and_range(preset, override, shown, must):
    assert _error(preset, override) == f"{shown} (override '{override}') {must}"


def test_table_covers_many_fields():
    assert len({b[0].split("=")[0] for b in BAD_VALUES}) >= 25


@pytest.mark.parametrize(
    "override",
    ["sampler.noise_level=null", "data.batch_size=null", "credit.adv_clip=null",
     "sampler.timestep_fraction=1", "optim.ema_decay=0", "optim.betas=[0, 0.5]",
     "run.iterations=0", "data.group_size=2", "optim.kl_beta=0"],
)
def test_values_on_the_boundary_or_null_are_accepted(override):
    _load("tiny_flow_grpo", override)


def test_registered_option_on_its_boundary_is_accepted():
    assert _load("tiny_vgpo", "credit.options.adae_steps=-1").credit.options == {"adae_steps": -1}
    assert _load("sd35m_flow_grpo", "model.options.resolution=null").model.options == {"resolution": None}


def test_range_is_checked_before_cross_field_checks():
    # the cross-field check int(num_steps · timestep_fraction) >= 1 may assume num_steps >= 1
    assert _error("tiny_flow_grpo", "sampler.num_steps=-3").startswith("sampler.num_steps = -3 (")
    # a value inside its range still meets the cross-field check, which states the arithmetic
    assert "0 trainable steps" in _error("tiny_flow_grpo", "sampler.num_steps=1")


# ---------------------------------------------------------------------------------------------------------------
# Where the value came from
# ---------------------------------------------------------------------------------------------------------------


def test_yaml_value_names_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(textwrap.dedent("""\
        base: tiny_flow_grpo
        optim:
          lr: 1.0e-5
          kl_beta: -0.04
        """))
    assert _error("bad.yaml") == "optim.kl_beta = -0.04 (bad.yaml:4) must be >= 0"


def test_value_of_a_base_file_names_the_base_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "parent.yaml").write_text("base: tiny_flow_grpo\nrun:\n  seed: 1\n  iterations: -1\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nrun:\n  seed: 2\n")
    assert _error("child.yaml") == "run.iterations = -1 (parent.yaml:4) must be >= 0"


def test_override_wins_over_the_file_and_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.yaml").write_text("base: tiny_flow_grpo\noptim:\n  lr: 1.0e-5\n")
    assert _error("ok.yaml", "optim.lr=-1") == "optim.lr = -1.0 (override 'optim.lr=-1') must be > 0"
    # an override of the whole section is named too
    msg = _error("ok.yaml", "optim={lr: 0}")
    assert msg == "optim.lr = 0.0 (override 'optim={lr: 0}') must be > 0"


def test_from_dict_without_sources_still_names_key_and_range():
    with pytest.raises(ConfigError, match=r"^data.group_size = 0 must be >= 2$"):
        from_dict(TrainConfig, {"data": {"group_size": 0}})


# ---------------------------------------------------------------------------------------------------------------
# method vs credit.name
# ---------------------------------------------------------------------------------------------------------------


def test_an_explicit_credit_name_wins_over_the_preset_method():
    # method is a shorthand: credit.name=vgpo on the tiny_flow_grpo preset (method: flow_grpo) needs no second key
    cfg = _load("tiny_flow_grpo", "credit.name=vgpo")
    assert cfg.credit.name == "vgpo" and cfg.method == "vgpo"


def test_in_one_yaml_file_credit_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("base: tiny_flow_grpo\nmethod: stepwise\ncredit:\n  name: vgpo\n")
    cfg = load_config(TrainConfig, "c.yaml", preset_dirs=[PRESET_DIR])
    assert cfg.credit.name == "vgpo" and cfg.method == "vgpo"


def test_a_credit_name_without_a_method(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.yaml").write_text("credit:\n  name: stepwise\n")
    cfg = load_config(TrainConfig, "d.yaml", preset_dirs=[PRESET_DIR])
    assert cfg.credit.name == "stepwise" and cfg.method == "stepwise"


def test_a_plugin_credit_name_makes_the_method_custom(monkeypatch):
    from flowcredit.credit.group import flow_grpo_advantages
    from flowcredit.credit.registry import CREDIT

    monkeypatch.setattr(CREDIT, "_specs", dict(CREDIT._specs))  # registered for this test only
    CREDIT.register("my_credit", flow_grpo_advantages)
    cfg = _load("tiny_flow_grpo", "credit.name=my_credit")
    assert cfg.credit.name == "my_credit" and cfg.method == "custom"


def test_the_command_line_method_wins_over_a_preset_credit_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "e.yaml").write_text("base: tiny_flow_grpo\ncredit:\n  name: stepwise\n")
    cfg = load_config(TrainConfig, "e.yaml", ["method=vgpo"], preset_dirs=[PRESET_DIR])
    assert cfg.credit.name == "vgpo" and cfg.method == "vgpo"
    both = load_config(TrainConfig, "e.yaml", ["method=vgpo", "credit.name=flow_grpo"], preset_dirs=[PRESET_DIR])
    assert both.credit.name == "flow_grpo" and both.method == "flow_grpo"  # an explicit credit.* always wins


@pytest.mark.parametrize(
    "preset, overrides, credit",
    [
        ("tiny_flow_grpo", ["method=vgpo"], "vgpo"),  # method alone: credit.name follows it
        ("tiny_vgpo", [], "vgpo"),
        ("tiny_vgpo", ["method=stepwise"], "stepwise"),  # the preset does not set credit.name itself
        ("tiny_flow_grpo", ["method=vgpo", "credit.name=vgpo"], "vgpo"),  # both, agreeing
        ("tiny_flow_grpo", ["method=custom", "credit.name=vgpo"], "vgpo"),
        ("tiny_flow_grpo", ["method=custom"], "flow_grpo"),  # custom keeps CreditCfg's default
        ("tiny_flow_grpo", ["credit.name=flow_grpo"], "flow_grpo"),
    ],
)
def test_consistent_method_and_credit_name(preset, overrides, credit):
    assert _load(preset, *overrides).credit.name == credit


def test_the_resolved_config_shows_what_ran_and_loads_back(tmp_path):
    from flowcredit.config import dump_yaml

    cfg = _load("tiny_nft")
    text = dump_yaml(cfg, tmp_path / "config.yaml")
    assert "\nmethod:" not in text  # the shorthand is not written; credit.name and objective.name say what ran
    data = yaml.safe_load(text)
    assert data["credit"]["name"] == "flow_grpo" and data["objective"]["name"] == "nft"
    assert load_config(TrainConfig, tmp_path / "config.yaml") == cfg
    again = load_config(TrainConfig, tmp_path / "config.yaml", ["method=vgpo"])  # the command line's shorthand
    assert again.credit.name == "vgpo"


# ---------------------------------------------------------------------------------------------------------------
# Presets, defaults, the schema itself
# ---------------------------------------------------------------------------------------------------------------


def _leaves(data, path=""):
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(data, list) and data and all(isinstance(v, dict) for v in data):
        for i, v in enumerate(data):
            yield from _leaves(v, f"{path}.{i}")
    else:
        yield path, data


def _get(obj, dotted):
    for part in dotted.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


@pytest.mark.parametrize("name", PRESETS)
def test_every_shipped_preset_loads_unchanged(name):
    """Every value a preset file sets arrives as written; credit.name is the method's; defaults are in range."""
    cfg = _load(name)
    data, _ = load_yaml(PRESET_DIR / f"{name}.yaml", preset_dirs=[PRESET_DIR])
    resolved = to_dict(cfg)
    for key, value in _leaves(data):
        got = _get(resolved, key)
        if isinstance(got, float) and isinstance(value, (int, float, str)):
            assert got == float(value), key
        else:
            assert got == value, key
    assert cfg.credit.name == (cfg.method if cfg.method != "custom" else cfg.credit.name)
    check_ranges(cfg)


def test_defaults_satisfy_their_ranges():
    check_ranges(TrainConfig())
    check_ranges(CreditCfg())


# Numeric fields that deliberately declare no range: a mix weight may be negative (a penalty); tag weights are
# checked per tag by DataCfg (>= 0, with the tag names in the message).
UNRANGED = {"reward.components[].weight", "data.tag_weights"}


def _numeric(tp) -> bool:
    if tp in (int, float):
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_numeric(a) for a in args if a is not type(None))
    if origin in (list, tuple):
        return bool(args) and _numeric(args[0])
    if origin is dict:
        return len(args) == 2 and _numeric(args[1])
    return False


def test_every_numeric_field_declares_a_range():
    keys = [(key, f) for key, f, tp in _walk_fields(TrainConfig, "") if _numeric(tp)]
    for reg in REGISTRIES.values():  # and every option of every built-in credit method, sampler, model, objective
        for name in reg:
            options, prefix = reg.spec(name).options, f"{reg.options_key}[{name}]"
            if options.__module__.startswith("flowcredit."):  # not the toys other test files register
                keys += [(key, f) for key, f, tp in _walk_fields(options, prefix) if _numeric(tp)]
    assert len(keys) > 50
    missing = [key for key, f in keys if range_text(f.metadata) is None and key not in UNRANGED]
    assert missing == []


def test_help_config_shows_ranges_next_to_defaults():
    lines = describe(TrainConfig).splitlines()
    for expected in (
        "run.iterations: int = 100, range >= 0",
        "optim.lr: float = 3.0e-05, range > 0",
        "sampler.timestep_fraction: float = 0.99, range (0, 1]",
        "optim.ema_decay: float = 0.0, range [0, 1)",
        "sampler.noise_level: float | null = null, range >= 0",
    ):
        assert expected in lines
    registered = describe_registries().splitlines()  # --help-config: generated from the registries
    assert "    credit.options.gamma: float = 0.9, range [0, 1]" in registered
    assert "    credit.options.std_scope: 'global' | 'group' = global" in registered
    assert any(line.startswith("run.device: str = cpu") and "range" not in line for line in lines)


def test_check_ranges_on_an_object_built_in_code():
    cfg = TrainConfig()
    cfg.optim.lr = -1.0
    with pytest.raises(ConfigError, match=r"^optim.lr = -1.0 must be > 0$"):
        check_ranges(cfg)


# ---------------------------------------------------------------------------------------------------------------
# The generic checker on a toy schema
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Toy:
    frac: float = field(default=0.5, metadata={"help": "h", "gt": 0, "le": 1})
    steps: Optional[int] = field(default=None, metadata={"help": "h", "ge": 1})
    weights: dict[str, float] = field(default_factory=dict, metadata={"help": "h", "ge": 0})
    big: float = field(default=10.0, metadata={"help": "h", "gt": 1})


def test_generic_checker_on_toy_schema():
    assert from_dict(_Toy, {"frac": 1, "steps": None, "weights": {"a": 0}}).frac == 1.0
    for data, msg in [
        ({"frac": 0}, "frac = 0.0 (x.yaml:1) must be in (0, 1]"),
        ({"steps": 0}, "steps = 0 (x.yaml:1) must be >= 1"),
        ({"weights": {"a": 1, "b": -2}}, "weights.b = -2.0 (x.yaml:1) must be >= 0"),
        ({"big": float("inf") * 0}, "big = nan (x.yaml:1) must be > 1"),
    ]:
        with pytest.raises(ConfigError) as e:
            from_dict(_Toy, data, source="x.yaml:1")
        assert str(e.value) == msg
    assert math.isinf(from_dict(_Toy, {"big": float("inf")}).big)


def test_two_bounds_on_one_side_is_a_schema_error():
    with pytest.raises(TypeError, match="two bounds on one side"):
        range_text({"ge": 0, "gt": 0})


def test_ranges_are_plain_metadata():
    f = {f.name: f for f in dataclasses.fields(TrainConfig().optim)}["lr"]
    assert f.metadata["gt"] == 0 and yaml.safe_dump(dict(f.metadata))  # serializable, no custom objects
