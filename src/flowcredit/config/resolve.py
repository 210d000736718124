"""Training-config resolution: `flowcredit train` arguments → (TrainConfig, preset name).

    resolve_train_config(["tiny_stepwise", "run.iterations=50"])  # a preset + key=value overrides
    resolve_train_config(["method=vgpo"])                         # method=X alone picks the preset tiny_X
    resolve_train_config(["objective=awm", "method=vgpo"])        # objective=X picks tiny_X first; method on top
    resolve_train_config(["resume=runs/x", "run.iterations=80"])  # a run's own config.yaml, then overrides

Owned by `config` so that `cli`, `compare` and scripts resolve a run the same way without importing the CLI.
"""

from __future__ import annotations

from pathlib import Path

from .keys import ConfigError
from .load import load_config
from .schema import TrainConfig

PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PRESET = "tiny_nft"  # the embedded default job: DiffusionNFT on the shipped tiny model (README)


def resolve_train_config(args: list[str]) -> tuple[TrainConfig, str]:
    """Split `train` arguments into preset/file and overrides; return (TrainConfig, preset name).

    Args:
        args: at most one preset name or YAML path, everything else `key=value` (`resume=RUN_DIR` included).

    Raises:
        ValueError: two presets, or a preset given with `resume=`.
        FileNotFoundError: `resume=` names a folder without config.yaml.
        ConfigError: a bad key or value (from `load_config`).
    """
    presets = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if len(presets) > 1:
        raise ValueError(f"give at most one preset or YAML file, got {presets}; everything else must be key=value")
    resume = [o.split("=", 1)[1] for o in overrides if o.startswith("resume=")]
    if resume:  # resume=RUN_DIR: the run's own config.yaml, its folder, then any further overrides
        run_dir = Path(resume[-1])
        if presets:
            raise ValueError(f"resume={run_dir} uses that run's config.yaml; drop {presets[0]}")
        if not (run_dir / "config.yaml").is_file():
            raise FileNotFoundError(
                f"resume={run_dir}: no config.yaml there; give a run folder written by `flowcredit train`"
            )
        lines = (run_dir / "config.yaml").read_bytes().splitlines()
        if not any(ln.strip() and not ln.lstrip().startswith(b"#") for ln in lines):  # empty, or cut in its header
            raise ConfigError(
                f"resume={run_dir}: {run_dir / 'config.yaml'} has no keys (empty or cut short); restore it, or use a "
                "new run folder to start from scratch",
                source=str(run_dir / "config.yaml"),
            )
        overrides = [o for o in overrides if not o.startswith("resume=")] + [f"run.out_dir={run_dir}"]
        cfg = load_config(TrainConfig, str(run_dir / "config.yaml"), overrides, preset_dirs=[PRESET_DIR])
        return cfg, run_dir.name
    if presets:
        preset = presets[0]
    else:
        # without a preset, objective=X (its recipe: tiny_nft, tiny_awm) and method=X (tiny_stepwise) pick one, the
        # objective first: `objective=nft method=stepwise` is `tiny_nft method=stepwise`. The presets of the GRPO
        # objective are named by their method, so `objective=grpo` defers to method=X, else it is tiny_flow_grpo.
        value = {k: o.split("=", 1)[1].strip() for k in ("objective", "method") for o in overrides
                 if o.startswith(f"{k}=")}
        objective, method = value.get("objective"), value.get("method")
        picks = [f"tiny_{method}"] if method else []
        if objective == "grpo":
            picks.append("tiny_flow_grpo")
        elif objective:
            picks.insert(0, f"tiny_{objective}")
        preset = next((p for p in picks if (PRESET_DIR / f"{p}.yaml").exists()), DEFAULT_PRESET)
    cfg = load_config(TrainConfig, preset, overrides, preset_dirs=[PRESET_DIR])
    return cfg, Path(preset).stem
