"""Build a FlowModel from a ModelCfg (the trainer's and the CLI's single entry point to models)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config.schema import ModelCfg

if TYPE_CHECKING:  # the concrete families (each an nn.Module with `.net`, implementing types.FlowModel)
    from .flux import FluxFlowModel
    from .sd3 import SD3FlowModel
    from .tiny import TinyFlowModel

    PolicyModel = TinyFlowModel | SD3FlowModel | FluxFlowModel


def build_model(cfg: ModelCfg, device: str = "cpu") -> PolicyModel:
    """Return a FlowModel for `cfg` on `device`.

    tiny: the built-in model. sd3 / flux: the diffusers adapters. LoRA (peft) is added at build time when
    cfg.trainable == "lora" (tiny: `TinyFlowModel.add_lora`; diffusers: models/diffusers_common.py).
    `cfg.precision = "auto"` is resolved in place (to "bf16" or "fp32", models/precision.py), so a config saved
    after the build records what ran.
    """
    from .precision import resolve_precision

    cfg.precision = resolve_precision(cfg.precision, device)  # 'auto' → what this hardware runs fast
    if cfg.name == "tiny":
        from .tiny import TinyFlowModel

        model = TinyFlowModel.load(cfg.path)
        if cfg.trainable == "lora":
            model.add_lora(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        model = model.to(device)
        model.compute_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        return model
    if cfg.name in ("sd3", "flux"):
        # The diffusers adapters (models/sd3.py, models/flux.py). Options ModelCfg may not have yet are read with
        # getattr so a config object that carries them (or a future schema field) sets them:
        #   resolution (px; default: the transformer's native size), max_sequence_length (T5 tokens; default: the
        #   pipeline's), embedded_guidance (FLUX.1-dev distilled guidance; default 3.5).
        if not cfg.path:
            raise ValueError(f"model.name={cfg.name} needs model.path: a local diffusers folder (or a hub id)")
        kw = {k: getattr(cfg, k) for k in ("resolution", "max_sequence_length") if getattr(cfg, k, None) is not None}
        if cfg.name == "sd3":
            from .sd3 import SD3FlowModel

            return SD3FlowModel.from_pretrained(cfg.path, cfg, **kw).to(device)
        else:
            from .flux import FluxFlowModel

            if getattr(cfg, "embedded_guidance", None) is not None:
                kw["embedded_guidance"] = cfg.embedded_guidance
            return FluxFlowModel.from_pretrained(cfg.path, cfg, **kw).to(device)
    raise ValueError(f"model.name={cfg.name!r}; valid: tiny, sd3, flux")


def set_trainable(model, trainable: str) -> list[torch.nn.Parameter]:
    """Choose what RL trains on the tiny model: 'all' weights, 'blocks' (transformer blocks + output head) or 'lora'
    (the peft adapter that `build_model` injected; base weights frozen).

    Diffusers adapters (SD3/FLUX) choose themselves ('lora', 'all' or 'blocks'; text encoders and VAE stay frozen).

    Returns the trainable parameters.
    """
    configure = getattr(model, "configure_trainable", None)
    if configure is not None:
        return configure(trainable)
    net = model.net
    if trainable == "all":
        net.requires_grad_(True)
    elif trainable == "blocks":
        net.requires_grad_(False)
        for mod in (net.blocks, net.ada_out, net.patch_out):
            mod.requires_grad_(True)
    elif trainable == "lora":
        if not getattr(model, "has_lora", False):
            raise ValueError("model.trainable=lora but the model was built without a LoRA adapter; build it with "
                             "build_model")
        net.requires_grad_(False)
        for name, p in net.named_parameters():
            if "lora_" in name:
                p.requires_grad_(True)
    else:
        raise ValueError(f"model.trainable={trainable!r}; valid: all, blocks, lora")
    return [p for p in net.parameters() if p.requires_grad]
