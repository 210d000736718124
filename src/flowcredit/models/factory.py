"""Model families: the registry (name → builder + its own options dataclass) and `build_model`, the trainer's and the
CLI's single entry point to models.

    MODELS.register("tiny", build_tiny, TinyOptions)             # the built-in shapes model; model.options: gelu
    MODELS.register("sd3", build_sd3, DiffusersOptions)          # model.options: resolution, max_sequence_length
    MODELS.register("flux", build_flux, FluxOptions)             # ... + embedded_guidance

A builder is ``(cfg: ModelCfg, opts, device) -> FlowModel``; adding a family is one file with its adapter and
options plus one `MODELS.register` line. The adapters' heavy imports (diffusers, peft) stay inside them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config.registry import Registry
from ..config.schema import ModelCfg
from .diffusers_common import DiffusersOptions
from .flux import FluxOptions
from .flux2 import Flux2FlowModel, Flux2Options
from .qwen_image import QwenImageFlowModel, QwenImageOptions
from .tiny import TinyOptions
from .wan import WanFlowModel, WanOptions
from .zimage import ZImageFlowModel, ZImageOptions

if TYPE_CHECKING:  # the concrete families (each an nn.Module with `.net`, implementing types.FlowModel)
    from .flux import FluxFlowModel
    from .sd3 import SD3FlowModel
    from .tiny import TinyFlowModel

    PolicyModel = TinyFlowModel | SD3FlowModel | FluxFlowModel


def build_tiny(cfg: ModelCfg, opts: TinyOptions, device: str) -> TinyFlowModel:
    """The built-in tiny DiT (`model.path` or the shipped weights) with its `model.options` (TinyOptions); LoRA
    (peft-style, models/tiny.py) when cfg.trainable == "lora"."""
    from .tiny import TinyFlowModel

    model = TinyFlowModel.load(cfg.path)
    if opts.gelu is not None:  # else what the weights' config says (the shipped model: tanh)
        model.set_gelu(opts.gelu)
    if cfg.trainable == "lora":
        model.add_lora(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    model = model.to(device)
    model.compute_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    return model


def _need_path(cfg: ModelCfg) -> str:
    if not cfg.path:
        raise ValueError(f"model.name={cfg.name} needs model.path: a local diffusers folder (or a hub id)")
    return cfg.path


def build_sd3(cfg: ModelCfg, opts: DiffusersOptions, device: str) -> SD3FlowModel:
    """SD3/SD3.5 through diffusers (models/sd3.py); LoRA through peft when cfg.trainable == "lora"."""
    from .sd3 import SD3FlowModel

    return SD3FlowModel.from_pretrained(_need_path(cfg), cfg, **opts.kwargs()).to(device)


def build_flux(cfg: ModelCfg, opts: FluxOptions, device: str) -> FluxFlowModel:
    """FLUX.1 through diffusers (models/flux.py); LoRA through peft when cfg.trainable == "lora"."""
    from .flux import FluxFlowModel

    return FluxFlowModel.from_pretrained(_need_path(cfg), cfg, **opts.kwargs()).to(device)


def build_zimage(cfg: ModelCfg, opts: ZImageOptions, device: str) -> ZImageFlowModel:
    """Z-Image / Z-Image-Turbo through diffusers (models/zimage.py); LoRA through peft when cfg.trainable == "lora"."""
    return ZImageFlowModel.from_pretrained(_need_path(cfg), cfg, **opts.kwargs()).to(device)


def build_qwen_image(cfg: ModelCfg, opts: QwenImageOptions, device: str) -> QwenImageFlowModel:
    """Qwen-Image through diffusers (models/qwen_image.py), true CFG inside the model; LoRA through peft."""
    return QwenImageFlowModel.from_pretrained(_need_path(cfg), cfg, **opts.kwargs()).to(device)


def build_flux2(cfg: ModelCfg, opts: Flux2Options, device: str) -> Flux2FlowModel:
    """FLUX.2 [dev] (Flux2Pipeline) / [klein] (Flux2KleinPipeline) through diffusers (models/flux2.py)."""
    return Flux2FlowModel.from_pretrained(_need_path(cfg), cfg, **opts.kwargs()).to(device)


def build_wan(cfg: ModelCfg, opts: WanOptions, device: str) -> WanFlowModel:
    """Wan 2.1 / 2.2 TI2V-5B text-to-video through diffusers (models/wan.py): 5-D video latents, decode → frames."""
    return WanFlowModel.from_pretrained(_need_path(cfg), cfg, **opts.kwargs()).to(device)


MODELS = Registry("model", "model family")
MODELS.register("tiny", build_tiny, TinyOptions, help="the built-in 3.4 M-parameter DiT of the shapes world (CPU)")
MODELS.register("sd3", build_sd3, DiffusersOptions, help="Stable Diffusion 3 / 3.5 through diffusers")
MODELS.register("flux", build_flux, FluxOptions, help="FLUX.1 through diffusers")
MODELS.register("zimage", build_zimage, ZImageOptions, help="Z-Image / Z-Image-Turbo (Tongyi-MAI) through diffusers")
MODELS.register("qwen_image", build_qwen_image, QwenImageOptions, help="Qwen-Image (true CFG) through diffusers")
MODELS.register("flux2", build_flux2, Flux2Options, help="FLUX.2 [dev] / [klein] through diffusers (options.variant)")
MODELS.register("wan", build_wan, WanOptions, help="Wan 2.1 / 2.2 TI2V-5B text-to-video (5-D latents) via diffusers")


def build_model(cfg: ModelCfg, device: str = "cpu") -> PolicyModel:
    """Return the FlowModel of `cfg` on `device`: the registered family's builder with its options.

    `cfg.precision = "auto"` is resolved in place (to "bf16" or "fp32", models/precision.py), so a config saved
    after the build records what ran.
    """
    from .precision import resolve_precision

    spec = MODELS.spec(cfg.name)
    opts = MODELS.options(spec, cfg.options)
    cfg.precision = resolve_precision(cfg.precision, device)  # 'auto' → what this hardware runs fast
    return spec.fn(cfg, opts, device)


def set_trainable(model, trainable: str) -> list[torch.nn.Parameter]:
    """Choose what RL trains on the tiny model: 'all' weights, 'blocks' (transformer blocks + output head),
    'modulation' (the conditioning path: timestep and pooled-text MLPs, every block's adaLN modulation and the output
    modulation; attention, MLPs, text encoder and patch layers frozen) or 'lora' (the peft adapter that
    `build_model` injected; base weights frozen).

    Diffusers adapters (SD3/FLUX) choose themselves ('lora', 'all', 'blocks' or 'modulation'; text encoders and VAE
    stay frozen).

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
    elif trainable == "modulation":
        net.requires_grad_(False)
        for mod in (net.t_mlp, net.pool_mlp, net.ada_out, *(blk.ada for blk in net.blocks)):
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
        raise ValueError(f"model.trainable={trainable!r}; valid: all, blocks, modulation, lora")
    return [p for p in net.parameters() if p.requires_grad]
