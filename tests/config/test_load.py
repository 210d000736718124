"""Tests of the generic config machinery (flowcredit.config.load) on a toy schema defined here.

The project's real schema lives in flowcredit/config/schema.py and is tested elsewhere; this file only needs a
schema that exercises every supported annotation.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pytest

from flowcredit.config import (
    ConfigError,
    apply_overrides,
    describe,
    dump_yaml,
    fields_without_help,
    from_dict,
    load_config,
    load_yaml,
    to_dict,
)

# ---------------------------------------------------------------------------------------------------------------
# Toy schema
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RewardComponent:
    name: str = field(metadata={"help": "Registry name of the reward."})
    weight: float = field(default=1.0, metadata={"help": "Weight of this reward in the sum."})
    kwargs: dict[str, float] = field(default_factory=dict, metadata={"help": "Extra numeric arguments."})


@dataclass
class SamplerCfg:
    num_steps: int = field(default=10, metadata={"help": "Number of SDE steps per rollout."})
    noise_level: float = field(default=0.7, metadata={"help": "SDE noise scale a (Flow-GRPO eq. 9)."})
    kind: Literal["sde", "ode"] = field(default="sde", metadata={"help": "Sampler family."})
    shift: Optional[float] = field(default=None, metadata={"help": "Timestep shift; null keeps the model's."})

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")


@dataclass
class RewardCfg:
    components: list[RewardComponent] = field(
        default_factory=lambda: [RewardComponent("toy")], metadata={"help": "Rewards summed into one score."}
    )
    clip: bool = field(default=False, metadata={"help": "Clip the summed reward to [-1, 1]."})


@dataclass
class OptimCfg:
    lr: float = field(default=1e-4, metadata={"help": "Adam learning rate."})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"help": "Adam betas."})


@dataclass
class ToyCfg:
    name: str = field(default="toy", metadata={"help": "Run name."})
    seed: int = field(default=0, metadata={"help": "Global random seed."})
    batch_size: int = field(default=8, metadata={"help": "Samples per step."})
    group_size: int = field(default=4, metadata={"help": "Samples per prompt (GRPO group)."})
    prompts: list[str] = field(default_factory=lambda: ["a cat"], metadata={"help": "Training prompts."})
    output_dir: Optional[str] = field(default=None, metadata={"help": "Where to write; null = ./runs/<name>."})
    sampler: SamplerCfg = field(default_factory=SamplerCfg, metadata={"help": "SDE sampler settings."})
    reward: RewardCfg = field(default_factory=RewardCfg, metadata={"help": "Reward settings."})
    optim: OptimCfg = field(default_factory=OptimCfg, metadata={"help": "Optimizer settings."})

    def __post_init__(self):
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by group_size {self.group_size}\n"
                f"({self.batch_size} % {self.group_size} = {self.batch_size % self.group_size})"
            )


def write(dir_: Path, name: str, text: str) -> Path:
    path = dir_ / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def config_error(fn, *args, **kwargs) -> str:
    """Run fn, expect a ConfigError, check it is one line and return its message."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg == msg.strip(), msg
    return msg


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    # Messages show paths relative to the working directory: run each test inside its tmp dir.
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Happy paths
# ---------------------------------------------------------------------------------------------------------------


def test_defaults_and_coercions(tmp_path):
    assert load_config(ToyCfg) == ToyCfg()
    path = write(
        tmp_path,
        "x.yaml",
        """
        sampler:
          noise_level: 1        # int -> float
          shift: 3.0
        optim:
          lr: 1e-4              # YAML 1.1 reads this as the string "1e-4"
          betas: [0, 0.99]
        reward:
          clip: "true"          # a quoted bool is still a bool
        """,
    )
    cfg = load_config(ToyCfg, path)
    assert cfg.sampler.noise_level == 1.0 and isinstance(cfg.sampler.noise_level, float)
    assert cfg.sampler.shift == 3.0
    assert cfg.optim.lr == 1e-4 and cfg.optim.betas == [0.0, 0.99]
    assert cfg.reward.clip is True
    assert cfg.sampler.num_steps == 10  # untouched keys keep their defaults


def test_optional_accepts_null_and_nonoptional_rejects_it():
    cfg = from_dict(ToyCfg, {"output_dir": None, "sampler": {"shift": None}})
    assert cfg.output_dir is None and cfg.sampler.shift is None
    msg = config_error(from_dict, ToyCfg, {"seed": None}, source="x.yaml")
    assert "'seed'" in msg and "null" in msg and "int" in msg


def test_empty_section_header_means_defaults(tmp_path):
    path = write(tmp_path, "x.yaml", "sampler:\nseed: 3\n")
    assert load_config(ToyCfg, path) == ToyCfg(seed=3)


def test_nested_list_of_dataclasses(tmp_path):
    path = write(
        tmp_path,
        "x.yaml",
        """
        reward:
          components:
            - name: pickscore
              weight: 2
            - name: ocr
              kwargs: {threshold: 0.5}
        """,
    )
    cfg = load_config(ToyCfg, path)
    assert cfg.reward.components == [
        RewardComponent("pickscore", 2.0),
        RewardComponent("ocr", 1.0, {"threshold": 0.5}),
    ]
    # An override can edit one item of a list the file set.
    cfg = load_config(ToyCfg, path, ["reward.components.1.weight=0.25"])
    assert cfg.reward.components[1].weight == 0.25

    bad = write(tmp_path, "bad.yaml", "reward:\n  components:\n    - name: a\n    - name: b\n      weight: heavy\n")
    msg = config_error(load_config, ToyCfg, bad)
    assert "'reward.components[1].weight' at bad.yaml:5" in msg and "must be float" in msg

    missing = write(tmp_path, "missing.yaml", "reward:\n  components:\n    - weight: 2\n")
    msg = config_error(load_config, ToyCfg, missing)
    assert "missing required key 'reward.components[0].name'" in msg and "missing.yaml:3" in msg


def test_overrides_parse_yaml_values():
    data = {"sampler": {"kind": "sde"}}
    out = apply_overrides(data, ["optim.lr=1e-4", "reward.clip=true", "prompts=[a, b]", "sampler.kind=ode"])
    expected = {"sampler": {"kind": "ode"}, "optim": {"lr": "1e-4"}, "reward": {"clip": True}, "prompts": ["a", "b"]}
    assert out == expected
    assert data == {"sampler": {"kind": "sde"}}  # the input is not modified
    cfg = load_config(ToyCfg, None, ["optim.lr=1e-4", "sampler.shift=null", "prompts=[a, b]", "seed=7"])
    assert cfg.optim.lr == 1e-4 and cfg.sampler.shift is None and cfg.prompts == ["a", "b"] and cfg.seed == 7


def test_override_without_equals_sign():
    msg = config_error(apply_overrides, {}, ["sampler.noise_level"])
    assert "'sampler.noise_level'" in msg and "key=value" in msg


def test_base_preset_merge(tmp_path):
    presets = tmp_path / "presets"
    presets.mkdir()
    write(
        presets,
        "base.yaml",
        """
        seed: 1
        prompts: [a, b, c]
        sampler:
          num_steps: 4
          noise_level: 0.5
        """,
    )
    # A bare name is looked up in preset_dirs; the child overrides one nested key and replaces the list.
    child = write(
        tmp_path,
        "child.yaml",
        """
        base: base
        prompts: [z]
        sampler:
          noise_level: 0.9
        """,
    )
    data, lines = load_yaml(child, preset_dirs=[presets])
    assert data == {"seed": 1, "prompts": ["z"], "sampler": {"num_steps": 4, "noise_level": 0.9}}
    assert lines["sampler.noise_level"] == "child.yaml:4"
    assert lines["sampler.num_steps"] == "presets/base.yaml:4"
    assert lines["prompts[0]"] == "child.yaml:2" and "prompts[2]" not in lines  # replaced list

    cfg = load_config(ToyCfg, child, preset_dirs=[presets])
    assert (cfg.seed, cfg.prompts, cfg.sampler.num_steps, cfg.sampler.noise_level) == (1, ["z"], 4, 0.9)

    # A relative path works too, and an error in an inherited key points into the base file.
    write(presets, "typo.yaml", "sampler:\n  noise_levle: 0.1\n")
    child2 = write(tmp_path, "child2.yaml", "base: presets/typo.yaml\nseed: 2\n")
    msg = config_error(load_config, ToyCfg, child2)
    assert "presets/typo.yaml:2" in msg


def test_preset_by_name_and_unknown_preset(tmp_path):
    presets = tmp_path / "presets"
    presets.mkdir()
    write(presets, "tiny.yaml", "seed: 5\n")
    assert load_config(ToyCfg, "tiny", preset_dirs=[presets]).seed == 5
    msg = config_error(load_config, ToyCfg, "tinny", preset_dirs=[presets])
    assert "unknown preset 'tinny'" in msg and "did you mean 'tiny'?" in msg and "available presets: tiny" in msg


def test_round_trip_dump_load(tmp_path):
    cfg = ToyCfg(
        name="1.0",  # a string YAML would read as a number must come back a string
        seed=3,
        output_dir=None,
        prompts=["yes", "a: b"],
        sampler=SamplerCfg(num_steps=3, noise_level=1e-7, kind="ode", shift=3.0),
        reward=RewardCfg([RewardComponent("pickscore", 0.5, {"t": 1.0}), RewardComponent("ocr")], clip=True),
        optim=OptimCfg(lr=3e-5),
    )
    dump_yaml(cfg, tmp_path / "resolved.yaml")
    assert load_config(ToyCfg, tmp_path / "resolved.yaml") == cfg
    assert from_dict(ToyCfg, to_dict(cfg)) == cfg


def test_describe_lists_keys_types_defaults_and_help():
    text = describe(ToyCfg)
    assert "sampler.noise_level: float = 0.7" in text
    assert "SDE noise scale a (Flow-GRPO eq. 9)." in text
    assert "sampler.kind: 'sde' | 'ode' = sde" in text
    assert "sampler.shift: float | null = null" in text
    assert "reward.components[].name: str (required)" in text
    assert "Registry name of the reward." in text
    assert fields_without_help(ToyCfg) == []


# ---------------------------------------------------------------------------------------------------------------
# Errors: each names the key, the source and the fix, on one line
# ---------------------------------------------------------------------------------------------------------------


def test_unknown_key_in_yaml_suggests_and_points_to_line(tmp_path):
    path = write(
        tmp_path,
        "x.yaml",
        """
        seed: 1
        sampler:
          num_steps: 4
          noise_levle: 0.5
        """,
    )
    msg = config_error(load_config, ToyCfg, path)
    assert "unknown key 'sampler.noise_levle' at x.yaml:4" in msg
    assert "did you mean 'noise_level'?" in msg
    assert "valid keys in 'sampler': num_steps, noise_level, kind, shift" in msg


def test_unknown_key_via_override_names_the_override():
    msg = config_error(load_config, ToyCfg, None, ["sampler.noise_levle=0.5"])
    assert "unknown key 'sampler.noise_levle' at override 'sampler.noise_levle=0.5'" in msg
    assert "did you mean 'noise_level'?" in msg


def test_override_replaces_file_as_source(tmp_path):
    path = write(tmp_path, "x.yaml", "sampler:\n  num_steps: 4\n")
    msg = config_error(load_config, ToyCfg, path, ["sampler.num_steps=many"])
    assert "'sampler.num_steps' at override 'sampler.num_steps=many' must be int" in msg


def test_wrong_type_names_expected_type(tmp_path):
    path = write(tmp_path, "x.yaml", "seed: 1\nsampler:\n  num_steps: 2.5\n")
    msg = config_error(load_config, ToyCfg, path)
    assert "'sampler.num_steps' at x.yaml:3 must be int, got float 2.5" in msg and "whole number" in msg
    # bool only from true/false, not from 0/1
    msg = config_error(load_config, ToyCfg, None, ["reward.clip=1"])
    assert "'reward.clip' at override 'reward.clip=1' must be bool" in msg and "true or false" in msg
    # a list field given a scalar
    msg = config_error(from_dict, ToyCfg, {"optim": {"betas": 0.9}})
    assert "'optim.betas' must be list[float]" in msg


def test_literal_violation_lists_allowed_values():
    msg = config_error(load_config, ToyCfg, None, ["sampler.kind=sdee"])
    assert "'sampler.kind' at override 'sampler.kind=sdee' must be one of 'sde', 'ode'" in msg
    assert "did you mean 'sde'?" in msg


def test_yaml_syntax_error_has_file_and_line(tmp_path):
    path = write(tmp_path, "broken.yaml", "seed: 1\nsampler:\n  num_steps: [1, 2\n  kind: sde\n")
    msg = config_error(load_yaml, path)
    assert msg.startswith("YAML syntax error at broken.yaml:")
    line = int(msg.split("broken.yaml:")[1].split(":")[0])
    assert 3 <= line <= 5


def test_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, "dup.yaml", "seed: 1\nsampler:\n  kind: sde\n  kind: ode\n")
    msg = config_error(load_yaml, path)
    assert "duplicate key 'sampler.kind' at dup.yaml:4 (first set at line 3)" in msg
    # ...but a key that overrides a `<<:` merge is not a duplicate.
    path = write(tmp_path, "merge.yaml", "defaults: &d {kind: sde}\nsampler:\n  <<: *d\n  kind: ode\n")
    data, lines = load_yaml(path)
    assert data["sampler"] == {"kind": "ode"} and lines["sampler.kind"] == "merge.yaml:4"


def test_post_init_error_is_reraised_naming_the_section(tmp_path):
    path = write(tmp_path, "x.yaml", "sampler:\n  num_steps: 0\n")
    msg = config_error(load_config, ToyCfg, path)
    assert "invalid section 'sampler'" in msg and "x.yaml:2" in msg and "num_steps must be >= 1, got 0" in msg
    # A root-level check; its multi-line message is folded into one line.
    msg = config_error(load_config, ToyCfg, None, ["batch_size=6"])
    assert "invalid config ToyCfg" in msg and "batch_size 6 is not divisible by group_size 4" in msg
    assert "override 'batch_size=6'" in msg


# ---------------------------------------------------------------------------------------------------------------
# Switching an implementation by name drops the file's options of the old one
# ---------------------------------------------------------------------------------------------------------------


def test_name_override_drops_the_replaced_implementations_options():
    """`objective.name=awm` on tiny_nft (whose objective.options are NFT's) and `model.name=sd3` on a tiny preset
    with model.options: the file's options of the replaced implementation go; options given by overrides are the new
    implementation's (checked against it), and re-naming the same implementation keeps the file's options."""
    import flowcredit.models.factory  # noqa: F401  (registers the model families: their options are checked)
    import flowcredit.objectives  # noqa: F401
    from flowcredit.cli.main import PRESET_DIR
    from flowcredit.config.schema import TrainConfig

    cfg = load_config(TrainConfig, "tiny_nft", ["objective.name=awm", "model.name=sd3"], preset_dirs=[PRESET_DIR])
    assert cfg.objective.name == "awm" and cfg.objective.options == {}
    assert cfg.model.name == "sd3" and cfg.model.options == {}
    kept = load_config(TrainConfig, "tiny_nft", ["objective.name=nft"], preset_dirs=[PRESET_DIR])
    assert kept.objective.options["beta"] == 1.0 and kept.model.options == {"gelu": "exact"}
    # options given with the new name are the new implementation's: kept, and checked against it
    awm = load_config(TrainConfig, "tiny_nft", ["objective.name=awm", "objective.options.weighting=t"],
                      preset_dirs=[PRESET_DIR])
    assert awm.objective.options == {"weighting": "t"}
    with pytest.raises(ConfigError, match=r"objective\.options\.beta"):
        load_config(TrainConfig, "tiny_nft", ["objective.name=awm", "objective.options.beta=1"],
                    preset_dirs=[PRESET_DIR])
