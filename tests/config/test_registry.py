"""Registries (config/registry.py) and the `{name, options}` sections: one declaration per implementation, options
checked by the loader like every other key, --help-config generated from
the registries; and the import graph that lets config check options without importing any component."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import flowcredit.models.factory  # noqa: F401  (registers the model families)
import flowcredit.trainer.loop  # noqa: F401  (imports every registry, as the CLI does)
from flowcredit.cli.main import PRESET_DIR, main
from flowcredit.config import ConfigError, load_config
from flowcredit.config.registry import NoOptions, Registry
from flowcredit.config.schema import TrainConfig

SRC = Path(flowcredit.models.factory.__file__).resolve().parents[1]  # src/flowcredit


def _error(preset, *overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, preset, list(overrides), preset_dirs=[PRESET_DIR])
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------------------------------------------------------
# A key of no section (e.g. an option written flat): the closest key and the valid keys of its section, nothing else
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, section, hint",
    [
        ("credit.std_scope=group", "credit", None),
        ("sampler.ddim_sigma=eta_s", "sampler", None),
        ("model.resolutio=512", "model", None),
        ("sampler.num_step=12", "sampler", "num_steps"),
    ],
)
def test_a_flat_option_is_an_unknown_key_of_its_section(override, section, hint):
    key = override.split("=")[0]
    msg = _error("tiny_flow_grpo", override)
    assert msg.startswith(f"unknown key '{key}' at override '{override}'; ")
    assert f"valid keys in '{section}': " in msg
    assert (f"did you mean '{hint}'?" in msg) if hint else ("did you mean" not in msg)


def test_an_unknown_key_in_a_yaml_file_names_file_and_line(tmp_path):
    f = tmp_path / "flat.yaml"
    f.write_text("base: tiny_flow_grpo\ncredit:\n  std_scope: group\n")
    msg = _error(str(f))
    assert msg.startswith("unknown key 'credit.std_scope' at ") and "flat.yaml:3; " in msg


# ---------------------------------------------------------------------------------------------------------------
# {name, options}: the options of the named implementation, checked at load time with the source
# ---------------------------------------------------------------------------------------------------------------


def test_options_are_checked_against_the_named_implementation():
    msg = _error("tiny_flow_grpo", "credit.options.norm=per_step")
    assert msg.startswith("unknown key 'credit.options.norm' at override 'credit.options.norm=per_step'")
    assert "(the options of credit method 'flow_grpo'): std_scope" in msg
    # a preset's options belong to its method: switching the method is an error naming the option and its file
    msg = _error("tiny_stepwise", "method=vgpo")
    assert "unknown key 'credit.options.norm' at " in msg and "tiny_stepwise.yaml:" in msg
    assert "the options of credit method 'vgpo'" in msg
    assert "did you mean 'stepwise'?" in _error("tiny_flow_grpo", "method=custom", "credit.name=stepwize")
    assert "not a registered sampler; use one of ode, flow_sde, cps, ddim_sde" in _error(
        "tiny_flow_grpo", "sampler.name=euler"
    )
    assert "the options of sampler 'flow_sde'" in _error("tiny_flow_grpo", "sampler.options.sigma=eta_s")
    assert "the options of model family 'sd3'" in _error("sd35m_flow_grpo", "model.options.embedded_guidance=2")
    assert "not a registered credit anchor" in _error("tiny_flow_grpo", "credit.anchor=adea")


def test_an_explicit_credit_name_wins_over_the_method_shorthand():
    cfg = load_config(TrainConfig, "tiny_flow_grpo", ["method=stepwise", "credit.name=vgpo"], preset_dirs=[PRESET_DIR])
    assert cfg.credit.name == "vgpo" and cfg.method == "vgpo"


@pytest.mark.parametrize("preset", ["tiny_nft", "tiny_awm", "tiny_flow_grpo", "tiny_vgpo"])
@pytest.mark.parametrize("method", ["flow_grpo", "stepwise", "vgpo"])
def test_method_switch_on_presets_that_leave_credit_options_to_the_method(preset, method):
    cfg = load_config(TrainConfig, preset, [f"method={method}"], preset_dirs=[PRESET_DIR])
    assert cfg.credit.name == method and cfg.credit.options == {}


def test_help_config_lists_every_registry_with_its_options(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out.splitlines()
    for line in (
        "credit.name choices (credit methods) and their credit.options:",
        "    credit.options.std_scope: 'global' | 'group' = global",
        "    credit.options.norm: 'joint' | 'per_step' | 'global' | 'per_step_mean' = joint",
        "    credit.anchor_options.adae_k: float = 0.1, range >= 0",
        "    objective.options.beta: float = 1.0, range > 0",
        "    sampler.options.sigma: 'eta_s_sqrt' | 'eta_s' = eta_s_sqrt",
        "    model.options.resolution: int | null = null, range >= 1",
        "    model.options.embedded_guidance: float = 3.5, range >= 0",
    ):
        assert line in out, line


# ---------------------------------------------------------------------------------------------------------------
# The Registry class
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Opts:
    k: float = field(default=1.0, metadata={"help": "a knob", "ge": 0})


@dataclass
class _NoDefault:
    k: float


def test_registry_declares_once_and_builds_options_strictly():
    reg = Registry("test_things", "test thing")
    reg.register("a", len, _Opts, requires=("x",), help="an a")
    assert "a" in reg and reg.names() == ["a"] and reg.spec("a").requires == ("x",)
    assert reg.options("a", {"k": 2}) == _Opts(k=2.0)  # int → float, as everywhere in the config
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", len)
    with pytest.raises(TypeError, match="every option needs a default"):
        reg.register("b", len, _NoDefault)
    with pytest.raises(TypeError, match="must be a dataclass"):
        reg.register("c", len, dict)
    with pytest.raises(ValueError, match=r"test_things.name='b' is not a registered test thing; use one of a"):
        reg.spec("b")
    with pytest.raises(ConfigError, match=r"^test_things.options.k = -1.0 must be >= 0$"):
        reg.options("a", {"k": -1})
    with pytest.raises(ConfigError, match="unknown key 'test_things.options.j'.*the options of test thing 'a'"):
        reg.options("a", {"j": 1})
    assert reg.options(reg.register("n", len), None) == NoOptions()
    assert "test_things.options.k: float = 1.0, range >= 0" in reg.describe()


# ---------------------------------------------------------------------------------------------------------------
# The import graph
# ---------------------------------------------------------------------------------------------------------------

COMPONENTS = {"credit", "samplers", "models", "objectives", "rewards", "shapes", "trainer", "eval", "compare", "cli"}


def _imported_packages(path: Path) -> set[str]:
    """The flowcredit subpackages a module imports (absolute or relative, at any depth of the file)."""
    pkg = path.relative_to(SRC).parts[:-1]  # e.g. ("config",)
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg[: len(pkg) - node.level + 1])
                names = [".".join(base + ([node.module] if node.module else []))]
                if not node.module:
                    names = [".".join(base + [a.name]) for a in node.names]
            elif node.module and node.module.startswith("flowcredit."):
                names = [node.module.removeprefix("flowcredit.")]
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("flowcredit.") for a in node.names if a.name.startswith("flowcredit.")]
        out |= {n.split(".")[0] for n in names if n}
    return out


def _modules(package: str | None = None):
    return sorted((SRC / package).rglob("*.py") if package else SRC.rglob("*.py"))


def test_config_imports_no_component():
    for path in _modules("config"):
        assert not (_imported_packages(path) & COMPONENTS), path


def test_components_never_import_trainer_or_cli():
    for path in _modules():
        top = path.relative_to(SRC).parts[0]
        imported = _imported_packages(path)
        if top not in ("cli",):
            assert "cli" not in imported, path  # nothing outside cli imports cli
        if top not in ("trainer", "cli", "compare"):
            assert "trainer" not in imported, path  # components never import the trainer


def test_options_written_or_defaulted_are_the_same_run_for_compare_reuse():
    from flowcredit.compare.study import _identity

    def load(*overrides):
        return load_config(TrainConfig, "tiny_stepwise", list(overrides), preset_dirs=[PRESET_DIR])

    assert _identity(load()) == _identity(load("credit.options.use_gae=false", "sampler.options={}"))
    assert _identity(load()) != _identity(load("credit.options.use_gae=true"))
    assert _identity(load())["credit"]["options"]["norm"] == "joint"


@pytest.mark.parametrize(
    "args, preset, objective, method",
    [
        (["objective=awm"], "tiny_awm", "awm", "flow_grpo"),  # objective=X alone: its recipe preset
        (["objective=nft", "method=stepwise"], "tiny_nft", "nft", "stepwise"),  # = `tiny_nft method=stepwise`
        (["objective=awm", "method=vgpo"], "tiny_awm", "awm", "vgpo"),
        (["objective=grpo"], "tiny_flow_grpo", "grpo", "flow_grpo"),
        (["objective=grpo", "method=stepwise"], "tiny_stepwise", "grpo", "stepwise"),  # GRPO presets: by method
        (["method=stepwise"], "tiny_stepwise", "grpo", "stepwise"),
        (["objective.name=awm"], "tiny_nft", "awm", "flow_grpo"),  # the dotted key keeps the default preset
        ([], "tiny_nft", "nft", "flow_grpo"),
    ],
)
def test_objective_and_method_shorthands_pick_the_preset(args, preset, objective, method):
    from flowcredit.config.resolve import resolve_train_config

    cfg, name = resolve_train_config(args)
    assert (name, cfg.objective.name, cfg.method, cfg.credit.name) == (preset, objective, method, method)


def test_section_equals_name_is_section_dot_name():
    # SECTION=NAME is SECTION.name=NAME for the sections with a `name` field: same config, options dropped alike
    short = load_config(TrainConfig, "tiny_nft", ["objective=awm", "sampler=ddim_sde"], preset_dirs=[PRESET_DIR])
    dotted = load_config(TrainConfig, "tiny_nft", ["objective.name=awm", "sampler.name=ddim_sde"],
                         preset_dirs=[PRESET_DIR])
    assert short == dotted and short.objective.name == "awm" and short.sampler.name == "ddim_sde"
    # a mapping value is still a mapping, and a non-name value still gets the one-line type error
    full = load_config(TrainConfig, "tiny_nft", ["objective={name: awm}"], preset_dirs=[PRESET_DIR])
    assert full.objective.name == "awm"
    with pytest.raises(ConfigError, match="objective"):
        load_config(TrainConfig, "tiny_nft", ["objective=3"], preset_dirs=[PRESET_DIR])
    with pytest.raises(ConfigError, match="'nope', not a registered objective; use one of grpo, awm, nft"):
        load_config(TrainConfig, "tiny_nft", ["objective=nope"], preset_dirs=[PRESET_DIR])
