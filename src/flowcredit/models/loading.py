"""Loading a model for evaluation, sampling, export and reports from any artefact a run leaves behind.

    load_any_model("runs/tiny-run")                        # the tiny model of any tiny artefact (EMA if kept)
    src = resolve_model_source("runs/sd3-run", ["model.path=models/sd3.5-m"])   # any family: config first ...
    model = src.load("cuda")                               # ... then build + the trained weights (EMA if kept)

`resolve_model_source` is what `flowcredit sample` and `flowcredit eval` load: an sd3/flux run is rebuilt from its
config.yaml's `model` section (parsed by the config loader, so `model.*` overrides get the same one-line errors as
`flowcredit train`) and its checkpoint's LoRA or full weights; `flowcredit export` shares `model_cfg_from_checkpoint`
and `load_trained_weights`.

Owned by `models` so that `cli`, `compare` and `eval` load weights the same way without importing the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .precision import resolve_precision
from .tiny import TinyDiTConfig, TinyFlowModel

if TYPE_CHECKING:
    from ..config.schema import ModelCfg


def load_any_model(path: str | None, precision: str = "fp32", use_ema: bool = True) -> TinyFlowModel:
    """A tiny model from: None (shipped), a .safetensors file, a trainer checkpoint folder, or a run folder.

    A run folder means its newest intact `checkpoints/iterNNNNNN/` (a damaged newer one is skipped with a warning). A
    checkpoint's EMA weights are used when the run kept them, and a LoRA run's adapter is folded into plain weights.
    Nothing is unpickled: old `.pt` checkpoints are refused with the `flowcredit convert --trust` command.

    Args:
        path: None, a `.safetensors` file (with its JSON), a checkpoint folder, or a run folder.
        precision: "auto" | "fp32" | "bf16": the model's autocast dtype (`models/precision.py`).
        use_ema: a checkpoint's EMA weights when the run kept them (False: its raw weights).

    Raises:
        FileNotFoundError: the checkpoint, or any checkpoint in the run folder, does not exist.
        ValueError: (one line naming the file) a pickle .pt, a damaged checkpoint, or a file that is not what it
            claims.
    """
    from .. import checkpoints as checkpoint

    if path is None:
        model = TinyFlowModel.load(None)
    else:
        p = Path(path)
        if p.suffix == ".pt" or (p.is_dir() and ((p / "checkpoints").is_dir() or checkpoint.is_checkpoint_dir(p))):
            ck = checkpoint.resolve(p)
            st = checkpoint.load(ck)
            try:
                model = TinyFlowModel(TinyDiTConfig(**st["model_config"]))
                # a LoRA run: rebuild its adapter to load the state, then evaluate the merged weights
                if st.get("lora"):
                    model.add_lora(**st["lora"])
                state = dict(st["model"])
                if use_ema and st.get("ema"):
                    state.update(st["ema"])  # evaluate the EMA weights when the run kept them
                model.net.load_state_dict(state)
            except (KeyError, TypeError, RuntimeError) as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ValueError(
                    f"checkpoint '{ck}' is not a tiny-model checkpoint ({first}); real models: flowcredit export"
                ) from None
            if model.has_lora:
                merged = TinyFlowModel(model.cfg)
                merged.net.load_state_dict(model.merged_state_dict())
                model = merged
            model.eval()
        else:
            try:
                model = TinyFlowModel.load(p)
            except FileNotFoundError:
                raise
            except Exception as e:  # noqa: BLE001 - a file that is not what it claims: one line naming it
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ValueError(
                    f"'{p}' is not a tiny-model .safetensors + .json pair ({type(e).__name__}: {first}); pass weights "
                    "written by `flowcredit pretrain`/`export`, a checkpoint folder or a run folder"
                ) from None
    model.compute_dtype = torch.bfloat16 if resolve_precision(precision) == "bf16" else torch.float32
    return model


# ---------------------------------------------------------------------------------------------------------------
# Every registered family: what `flowcredit sample` / `flowcredit eval` load (tiny, sd3, flux)
# ---------------------------------------------------------------------------------------------------------------


def model_cfg_from_checkpoint(st: dict[str, Any]) -> ModelCfg:
    """The ModelCfg an sd3/flux trainer checkpoint recorded (`model_config`: the fields of ModelCfg)."""
    from ..config.schema import ModelCfg

    mc = dict(st["model_config"])
    return ModelCfg(**{k: v for k, v in mc.items() if k in ModelCfg.__dataclass_fields__})


def load_trained_weights(model, st: dict[str, Any], ck: Path, name: str, use_ema: bool = True) -> bool:
    """Load a trainer checkpoint's weights into the rebuilt sd3/flux `model` (strict); the EMA weights over them when
    the run kept an EMA and `use_ema`. Returns whether the EMA weights were loaded.

    Raises:
        ValueError: (one line) the checkpoint's tensors do not fit the rebuilt model.
    """
    state = dict(st["model"])
    ema = bool(use_ema and st.get("ema"))
    if ema:
        state.update(st["ema"])
    try:
        model.net.load_state_dict(state, strict=True)
    except RuntimeError as e:  # torch: "Error(s) in loading state_dict for X:" then one line per problem
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        what = lines[0] if len(lines) < 2 else f"{lines[0]} {lines[1]}"
        what = what if len(what) <= 300 else what[:297] + "..."
        raise ValueError(
            f"checkpoint '{ck}' does not match the rebuilt {name} model ({what}); the model settings that shape the "
            "weights (model.trainable, lora_rank, lora_targets) must be the run's"
        ) from None
    return ema


def run_family(config_yaml: Path) -> str:
    """`model.name` of a run's config.yaml ("tiny" when it names none), read without building the config.

    Raises:
        ValueError: the file is not a readable YAML config.
    """
    import yaml

    try:
        doc = yaml.safe_load(config_yaml.read_text())
        model = (doc.get("model") or {}) if isinstance(doc, dict) else {}
        return str(model.get("name", "tiny"))
    except (yaml.YAMLError, AttributeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"'{config_yaml}' is not a readable run config ({type(e).__name__}); fix or remove it"
        ) from None


def _section(override: str) -> str:
    return override.split("=", 1)[0].strip().split(".", 1)[0]


@dataclass
class ModelSource:
    """What `resolve_model_source` found: which model to build and from what; `load()` builds it.

    Attributes:
        family: model.name (tiny, sd3, flux).
        config: the TrainConfig it comes from: an sd3/flux run's config.yaml with the overrides applied, else the
            defaults with the overrides (its `reward` section is what `flowcredit eval` scores with).
        from_run: `config` is a run's own config.yaml (its run.eval_* settings and reward are the run's).
        run: the run folder, if any.
        checkpoint: the checkpoint folder whose weights `load` puts in (sd3/flux); for tiny, the user's path.
        use_ema: load the EMA weights when the run kept them.
        legacy_tiny: load through `load_any_model` (every tiny-model artefact, as before), with this precision.
    """

    family: str
    config: Any
    from_run: bool = False
    run: Path | None = None
    checkpoint: Path | None = None
    use_ema: bool = True
    legacy_tiny: str | None = None
    path_from_run: bool = False
    ema_loaded: bool = False
    _state: dict[str, Any] | None = field(default=None, repr=False)

    def describe(self) -> str:
        """One line: the family, base model and weights, e.g. "sd3 (base models/sd3.5-m) + runs/x/checkpoints/
        iter000100 (EMA weights)"."""
        if self.family == "tiny" and self.legacy_tiny is not None:
            return f"tiny model {self.checkpoint or '(shipped)'}"
        base = f"{self.family} (base {self.config.model.path})"
        if self.checkpoint is None:
            return base
        return f"{base} + {self.checkpoint} ({'EMA' if self.ema_loaded else 'raw'} weights)"

    def load(self, device: str | None = None):
        """Build the model in eval mode: the tiny model as `load_any_model` does; sd3/flux with `build_model` from
        `config.model`, then the checkpoint's weights (EMA if kept and `use_ema`).

        Args:
            device: where to build it; None = cpu for tiny, the GPU (when there is one) for sd3/flux.

        Raises:
            FileNotFoundError / ValueError: one line (a missing base model names model.path and --model-path).
        """
        from .. import checkpoints as ckpt
        from .diffusers_common import ModelLayoutError
        from .factory import build_model

        if self.legacy_tiny is not None:
            tiny = load_any_model(None if self.checkpoint is None else str(self.checkpoint), self.legacy_tiny,
                                  self.use_ema)
            return tiny.to(device) if device else tiny
        if device is None:
            device = "cuda" if self.family != "tiny" and torch.cuda.is_available() else "cpu"
        mc = self.config.model
        try:
            model = build_model(mc, device)
        except ModelLayoutError as e:
            if self.path_from_run:
                trained = f"run '{self.run}'" if self.run is not None else f"checkpoint '{self.checkpoint}'"
                raise ModelLayoutError(
                    f"the base model of {trained} is not there: {e}; if it moved since training, pass "
                    "--model-path DIR (or model.path=DIR)"
                ) from None
            raise
        except OSError as e:  # a hub id or a folder diffusers cannot read
            if self.family == "tiny":  # model.path=FILE.safetensors: its own one-line FileNotFoundError
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(
                f"cannot load model.path='{mc.path}' ({type(e).__name__}: {first}); give a local diffusers folder "
                "with --model-path DIR or model.path=DIR"
            ) from None
        if self.checkpoint is not None:
            st = self._state if self._state is not None else ckpt.load(self.checkpoint)
            self._state = None  # the model holds the weights now
            self.ema_loaded = load_trained_weights(model, st, self.checkpoint, mc.name, self.use_ema)
        return model.eval()


def _locate(p: Path) -> tuple[str, Path | None, Path | None, Path | None, dict | None]:
    """(family, run folder, its config.yaml, checkpoint folder, its loaded state) of a --checkpoint path: a run or
    its checkpoints/iterNNNNNN folder names its family in config.yaml; a checkpoint folder on its own, in the model
    config it recorded (then loaded here); anything else (a .safetensors file, a refused pickle) is the tiny model."""
    from .. import checkpoints as ckpt

    run = config_yaml = ck = None
    state = None
    if not (p.is_dir() and ((p / "checkpoints").is_dir() or ckpt.is_checkpoint_dir(p))):
        return "tiny", None, None, None, None
    if (p / "checkpoints").is_dir():
        run = p
    elif p.parent.name == "checkpoints":
        run = p.parent.parent
    if run is not None and (run / "config.yaml").is_file():
        config_yaml = run / "config.yaml"
        return run_family(config_yaml), run, config_yaml, None, None
    ck = ckpt.resolve(p)
    state = ckpt.load(ck)
    mc = state.get("model_config")
    return (str(mc.get("name", "tiny")) if isinstance(mc, dict) else "tiny"), run, None, ck, state


def resolve_model_source(
    checkpoint: str | None,
    overrides: Sequence[str] = (),
    *,
    precision: str | None = None,
    use_ema: bool = True,
    model_path: str | None = None,
) -> ModelSource:
    """Which model `flowcredit sample` / `flowcredit eval` load, with its config (cheap: nothing is built yet).

    * No checkpoint: the model of `model.*` overrides on the defaults (`model.name=sd3 model.path=DIR`: the base
      model); none at all: the shipped tiny model.
    * A tiny-model artefact (a .safetensors file, a tiny run or checkpoint folder): `load_any_model`, as before.
    * An sd3/flux run folder or its checkpoints/iterNNNNNN folder: the run's config.yaml (read with the config
      loader, `model.*`/`reward.*` overrides on top) rebuilds the model; the checkpoint's weights go in. A checkpoint
      folder outside a run uses the ModelCfg the checkpoint recorded (as `flowcredit export` does).

    Args:
        checkpoint: --checkpoint (None: no trained weights).
        overrides: `key=value` strings of the sections the caller accepts (model.*, reward.*), parsed by
            `config.load_config` (unknown keys: the same one-line ConfigError as `flowcredit train`).
        precision: --precision; None = the run's model.precision (sd3/flux), a model.precision override, else fp32.
        use_ema: the EMA weights when the run kept them.
        model_path: --model-path: the base model folder if it moved since training (= a model.path override).

    Raises:
        ConfigError, ValueError, FileNotFoundError: one line naming the field and the fix.
    """
    from .. import checkpoints as ckpt
    from ..config.load import load_config
    from ..config.resolve import PRESET_DIR
    from ..config.schema import TrainConfig
    from . import factory  # noqa: F401  (registers the model families: model.* keys are checked against them)

    overrides = list(overrides)
    model_keys = [o.split("=", 1)[0].strip() for o in overrides if _section(o) == "model"]
    if precision is not None:
        from .precision import PRECISIONS

        if precision not in PRECISIONS:
            raise ValueError(f"--precision {precision!r}; valid: {', '.join(PRECISIONS)}")

    def finish(src: ModelSource) -> ModelSource:
        mc = src.config.model
        if model_path is not None:
            mc.path = model_path
            src.path_from_run = False
        if precision is not None:
            mc.precision = precision
        elif not src.from_run and "model.precision" not in model_keys:
            mc.precision = "fp32"  # --precision's default outside a run
        return src

    if checkpoint is None:
        cfg = load_config(TrainConfig, None, overrides)
        if cfg.model.name == "tiny" and not model_keys and model_path is None:  # the shipped model
            return ModelSource("tiny", cfg, legacy_tiny=precision or "fp32", use_ema=use_ema)
        return finish(ModelSource(cfg.model.name, cfg, use_ema=use_ema))

    p = Path(checkpoint)
    family, run, config_yaml, ck, state = _locate(p)
    if family == "tiny":
        if model_keys or model_path is not None:
            given = ", ".join([*model_keys, *(["--model-path"] if model_path is not None else [])])
            raise ValueError(
                f"{given}: a tiny-model checkpoint carries its own model; model.* overrides and --model-path apply to "
                "sd3/flux runs and to the base model without --checkpoint (a tiny weights file: model.path=FILE)"
            )
        cfg = load_config(TrainConfig, None, overrides)
        return ModelSource("tiny", cfg, checkpoint=ck or p, use_ema=use_ema, legacy_tiny=precision or "fp32")
    if config_yaml is not None:
        cfg = load_config(TrainConfig, str(config_yaml), overrides, preset_dirs=[PRESET_DIR])
        src = ModelSource(family, cfg, from_run=True, run=run, checkpoint=ckpt.resolve(p), use_ema=use_ema,
                          path_from_run="model.path" not in model_keys)
        return finish(src)
    assert state is not None and ck is not None
    import json

    from ..config.load import to_dict

    recorded = json.dumps(to_dict(model_cfg_from_checkpoint(state)))  # JSON is YAML: `model={...}` sets the section
    cfg = load_config(TrainConfig, None, [f"model={recorded}", *overrides])
    src = ModelSource(
        family, cfg, run=run, checkpoint=ck, use_ema=use_ema, path_from_run="model.path" not in model_keys
    )
    src._state = state
    return finish(src)
