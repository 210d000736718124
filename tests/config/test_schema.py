"""TrainConfig schema: shipped presets load, help texts, method → credit, cross-field checks, dump → load."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from flowcredit.cli.main import PRESET_DIR
from flowcredit.config import ConfigError, dump_yaml, fields_without_help, list_presets, load_config, to_dict
from flowcredit.config.schema import TrainConfig

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
SECTIONS = {n for n, tp in typing.get_type_hints(TrainConfig).items() if dataclasses.is_dataclass(tp)}


def _load(name="tiny_flow_grpo", *overrides):
    return load_config(TrainConfig, name, list(overrides), preset_dirs=[PRESET_DIR])


def test_presets_found():
    assert "tiny_flow_grpo" in PRESETS
    assert sorted(list_presets([PRESET_DIR])) == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_shipped_preset_loads(name):
    cfg = _load(name)
    assert isinstance(cfg, TrainConfig)
    if cfg.method != "custom":
        assert cfg.credit.name == cfg.method
    assert cfg.data.group_size >= 2 and cfg.sampler.num_steps >= 1


def test_every_leaf_field_has_help():
    assert SECTIONS >= {"model", "sampler", "data", "reward", "credit", "estimate", "optim", "run"}
    assert [k for k in fields_without_help(TrainConfig) if k not in SECTIONS] == []


def test_every_field_has_help():
    assert fields_without_help(TrainConfig) == []


@pytest.mark.parametrize("method", ["stepwise", "vgpo", "flow_grpo"])
def test_method_sets_credit_name(method):
    cfg = _load("tiny_flow_grpo", f"method={method}")
    assert cfg.credit.name == method
    assert cfg.shared_noise == (method != "flow_grpo")


def test_custom_method_keeps_credit_name():
    cfg = _load("tiny_flow_grpo", "method=custom", "credit.name=stepwise")
    assert cfg.credit.name == "stepwise"


def test_batch_size_sets_prompts_per_iter():
    cfg = _load("tiny_flow_grpo", "data.batch_size=12", "data.group_size=4")
    assert cfg.data.prompts_per_iter == 3
    with pytest.raises(ConfigError, match="not divisible"):
        _load("tiny_flow_grpo", "data.batch_size=10", "data.group_size=4")
    with pytest.raises(ConfigError, match="group_size"):
        _load("tiny_flow_grpo", "data.group_size=1")


def test_unknown_key_suggests():
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        _load("tiny_flow_grpo", "optim.lrr=1")


@pytest.mark.parametrize("name", PRESETS)
def test_dump_load_round_trip(tmp_path, name):
    cfg = _load(name, "optim.lr=1e-4", "run.iterations=3", "reward.name=mix", "reward.components=[{name: shapes, weight: 0.5}]")
    path = tmp_path / "config.yaml"
    text = dump_yaml(cfg, path)
    assert path.read_text() == text
    back = load_config(TrainConfig, path)
    assert back == cfg and to_dict(back) == to_dict(cfg)
    assert back.reward.components[0].weight == 0.5


def test_defaults_round_trip(tmp_path):
    cfg = TrainConfig()
    path = tmp_path / "d.yaml"
    dump_yaml(cfg, path)
    assert load_config(TrainConfig, path) == cfg


# ---------------------------------------------------------------------------------------------------------------
# The official recipes' options (DiffusionNFT's soft old policy, time draw and adv_mode; AWM's weighting, advantage
# rescale and EMA-reference ramp): accepted where they mean something, refused in one line where they do not
# ---------------------------------------------------------------------------------------------------------------


def test_official_recipe_options_are_accepted():
    import flowcredit.objectives  # noqa: F401  (registers the objectives, so their options are checked on load)

    cfg = _load("tiny_nft", "objective.options.old_policy=soft", "objective.options.adv_mode=one_only",
                "objective.options.old_decay_rate=0.0075", "objective.options.old_decay_max=0.999",
                "objective.options.old_decay_flat=75", "sampler.train_step_draw=nft",
                "sampler.train_steps_per_sample=0")
    assert cfg.objective.options["old_policy"] == "soft" and cfg.sampler.train_step_draw == "nft"
    cfg = _load("tiny_awm", "objective.options.weighting=ghuber", "objective.options.ghuber_power=0.25",
                "objective.options.adv_clip_max=5", "objective.options.advantage_max=1", "optim.kl_reference=ema",
                "optim.kl_reference_decay=0.3", "optim.kl_reference_decay_rate=0.001")
    assert cfg.optim.kl_reference_decay_rate == 0.001
    _load("tiny_awm", "sampler.train_step_draw=nft", "sampler.train_steps_per_sample=0")  # awm: a forward objective


@pytest.mark.parametrize("preset, overrides, match", [
    ("tiny_nft", ["objective.options.old_policy=ema"], "objective.options.old_policy"),
    ("tiny_nft", ["objective.options.old_decay_max=1.0"], "old_decay_max"),
    ("tiny_nft", ["objective.options.old_decay_flat=-1"], "old_decay_flat"),
    ("tiny_nft", ["objective.options.adv_mode=ones_only"], "adv_mode"),
    ("tiny_nft", ["sampler.train_step_draw=nft"], "train_step_draw=nft.*train_steps_per_sample=3"),
    ("tiny_flow_grpo", ["sampler.train_step_draw=nft", "sampler.train_steps_per_sample=0"],
     "train_step_draw=nft.*objective.name=grpo"),
    ("tiny_awm", ["objective.options.weighting=gauss"], "weighting"),
    ("tiny_awm", ["objective.options.ghuber_power=0"], "ghuber_power"),
    ("tiny_awm", ["objective.options.advantage_max=1"], "advantage_max=1.*adv_clip_max=0"),
    ("tiny_awm", ["optim.kl_reference_decay_rate=0.001"], "kl_reference_decay_rate=0.001.*kl_reference=initial"),
    ("tiny_awm", ["optim.kl_reference=ema", "optim.kl_reference_decay_rate=-1"], "kl_reference_decay_rate"),
])
def test_official_recipe_options_are_refused_in_one_line(preset, overrides, match):
    import flowcredit.objectives  # noqa: F401  (registers the objectives, so their options are checked on load)

    with pytest.raises(ConfigError, match=match) as ei:
        _load(preset, *overrides)
    assert "\n" not in str(ei.value)
