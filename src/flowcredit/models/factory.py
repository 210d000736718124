"""Build a FlowModel from a ModelCfg (the trainer's and the CLI's single entry point to models)."""

from __future__ import annotations

import torch

from ..config.schema import ModelCfg


def build_model(cfg: ModelCfg, device: str = "cpu"):
    """Return a FlowModel for `cfg` on `device`.

    Only the tiny built-in model is wired in this version; the diffusers adapters (SD3/FLUX, issue F) are not
    implemented yet and say so.
    """
    if cfg.name == "tiny":
        from .tiny import TinyFlowModel

        model = TinyFlowModel.load(cfg.path).to(device)
        model.compute_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        return model
    raise NotImplementedError(
        f"model.name={cfg.name!r}: the diffusers adapters (SD3/FLUX) are not implemented in this version; use model.name=tiny"
    )


def set_trainable(model, trainable: str) -> list[torch.nn.Parameter]:
    """Choose what RL trains on the tiny model: 'all' weights or 'blocks' (transformer blocks + output head).

    Returns the trainable parameters.
    """
    net = model.net
    if trainable == "all":
        net.requires_grad_(True)
    elif trainable == "blocks":
        net.requires_grad_(False)
        for mod in (net.blocks, net.ada_out, net.patch_out):
            mod.requires_grad_(True)
    elif trainable == "lora":
        raise NotImplementedError("model.trainable=lora is not implemented for the tiny model yet; use all or blocks")
    else:
        raise ValueError(f"model.trainable={trainable!r}; valid: all, blocks, lora")
    return [p for p in net.parameters() if p.requires_grad]
