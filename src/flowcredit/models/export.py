"""Export a model trained by flowcredit in diffusers' format, so the stock pipeline deploys it.

    from flowcredit.models.export import export, export_checkpoint
    export(model, "out/lora")                         # a live SD3FlowModel / FluxFlowModel
    export_checkpoint("runs/my-run", "out/lora")      # a checkpoint folder or run folder; EMA weights if kept

LoRA (model.trainable=lora): `out_dir/pytorch_lora_weights.safetensors`, written by
`StableDiffusion3Pipeline.save_lora_weights` / `FluxPipeline.save_lora_weights` from
`peft.get_peft_model_state_dict(transformer)` (the diffusers LoRA training scripts' recipe). Load it with

    pipe = StableDiffusion3Pipeline.from_pretrained(base); pipe.load_lora_weights("out/lora")

Two traps avoided (ENVIRONMENT.md §2): the state dict is NOT passed through `convert_state_dict_to_diffusers` (that
renames to_q/k/v/out to the old lora.down/up keys, which `load_lora_weights` silently drops); and the LoRA scale α/r
is folded into lora_B (B ← (α/r)·B, saved alpha = r) because loaders that ignore alpha metadata (older diffusers,
other UIs) would otherwise run the adapter at scale 1. Folding is exact when α/r is a power of two (the recipes'
r32/α64 → 2); otherwise the loaded model matches to fp32 rounding.

Full fine-tunes (trainable=all|blocks): `Pipeline.save_pretrained(out_dir)` of the adapter's pipeline (its transformer
is the trained one), loadable with `Pipeline.from_pretrained(out_dir)`; `transformer_only=True` writes only
`out_dir/transformer/` (then `SD3Transformer2DModel.from_pretrained(out_dir, subfolder="transformer")`).

Every export also writes `out_dir/flowcredit_export.json` (family, base model, LoRA settings, sampling hints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

EXPORT_INFO = "flowcredit_export.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"


def _pipeline_class(model):
    if model.family == "sd3":
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline
    if model.family == "flux":
        from diffusers import FluxPipeline

        return FluxPipeline
    from .diffusers_common import DiffusersFlowModel

    if isinstance(model, DiffusersFlowModel):  # hook: any other diffusers adapter saves with the pipeline it names
        import diffusers

        return getattr(diffusers, model.pipeline_name)
    raise ValueError(
        f"export: {type(model).__name__} is not a diffusers adapter (sd3/flux); the tiny model saves with model.save()"
    )


def lora_state_dict(net: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The adapter's peft state dict with each layer's scale α/r folded into its lora_B weight.

    Returns:
        (state dict with keys like "transformer_blocks.0.attn.to_q.lora_A.weight", {layer name: folded scale}).
    """
    from peft import get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    state = {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(net).items()}
    scales: dict[str, float] = {}
    for name, module in net.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.scaling:
            s = float(module.scaling["default"])
            key = f"{name}.lora_B.weight"
            if key not in state:
                raise KeyError(f"export: peft state dict has no '{key}'; cannot fold the LoRA scale")
            state[key] = state[key] * s
            scales[name] = s
    if not scales:
        raise ValueError("export: the model has no LoRA layers")
    return state, scales


def export(model, out_dir: str | Path, *, transformer_only: bool = False, extra: dict[str, Any] | None = None) -> Path:
    """Write `model` (SD3FlowModel / FluxFlowModel) to `out_dir` in diffusers' format (see the module docstring).

    Args:
        model: a diffusers adapter with its trained weights in place (swap EMA weights in first if wanted).
        out_dir: output folder (created).
        transformer_only: full fine-tunes only: write `out_dir/transformer/` instead of the whole pipeline.
        extra: more entries for flowcredit_export.json (e.g. the run's sampler settings).

    Returns:
        out_dir as a Path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe_cls = _pipeline_class(model)
    info: dict[str, Any] = {**model.describe(), "format": None}
    if model.has_lora:
        state, scales = lora_state_dict(model.net)
        pipe_cls.save_lora_weights(str(out), transformer_lora_layers=state)
        info["format"] = "diffusers-lora"
        info["weights"] = LORA_WEIGHTS
        info["lora"]["saved_alpha"] = "= rank (scale α/r folded into lora_B)"
        info["lora"]["folded_scales"] = sorted(set(scales.values()))
    elif transformer_only:
        model.net.save_pretrained(str(out / "transformer"))
        info["format"] = "diffusers-transformer"
    else:
        model.pipeline.save_pretrained(str(out))
        info["format"] = "diffusers-pipeline"
    info.update(extra or {})
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=2))
    return out


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    use_ema: bool = True,
    model_path: str | None = None,
    device: str = "cpu",
    transformer_only: bool = False,
) -> Path:
    """Rebuild the model of a trainer checkpoint, load its weights (EMA if kept and `use_ema`) and `export` it.

    Args:
        checkpoint: a trainer checkpoint folder `checkpoints/iterNNNNNN` or a run folder (its newest intact
            checkpoint).
            Old pickle `.pt` checkpoints are refused (convert a trusted one: `flowcredit convert --trust OLD.pt`).
        out_dir: output folder.
        use_ema: export the EMA weights when the run kept them (what the run's evaluation used).
        model_path: base model folder, if it moved since training (default: the checkpoint's model.path).
        device: where to rebuild the model.
        transformer_only: see `export`.
    """
    from .. import checkpoints as ckpt
    from .factory import MODELS, build_model
    from .loading import load_trained_weights, model_cfg_from_checkpoint

    ck = ckpt.resolve(checkpoint)
    st = ckpt.load(ck)  # safetensors + JSON, verified; never unpickles
    name = dict(st["model_config"]).get("name")
    if name == "tiny" or name not in MODELS:  # every registered diffusers family (sd3, flux, zimage, ...)
        families = ", ".join(n for n in MODELS.names() if n != "tiny")
        raise ValueError(f"checkpoint '{ck}' is of model.name={name!r}; export handles the diffusers families "
                         f"{families}")
    cfg = model_cfg_from_checkpoint(st)
    if model_path is not None:
        cfg.path = model_path
    cfg.precision = "fp32"  # export the trained fp32 weights as they are
    model = build_model(cfg, device)
    load_trained_weights(model, st, ck, cfg.name, use_ema)
    return export(
        model,
        out_dir,
        transformer_only=transformer_only,
        extra={"checkpoint": ck.name, "iteration": st.get("iteration"), "ema": bool(use_ema and st.get("ema"))},
    )
