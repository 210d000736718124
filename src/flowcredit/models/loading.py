"""Loading a tiny model for evaluation, sampling, export and reports from any artefact a run leaves behind.

Owned by `models` so that `cli`, `compare` and `eval` load weights the same way without importing the CLI.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .precision import resolve_precision
from .tiny import TinyDiTConfig, TinyFlowModel


def load_any_model(path: str | None, precision: str = "fp32") -> TinyFlowModel:
    """A tiny model from: None (shipped), a .safetensors file, a trainer checkpoint .pt, or a run folder.

    A run folder means its newest `checkpoints/iter*.pt`. A checkpoint's EMA weights are used when the run kept them,
    and a LoRA run's adapter is folded into plain weights.

    Args:
        path: None, a `.safetensors` file (with its JSON), a `.pt` trainer checkpoint, or a run folder.
        precision: "auto" | "fp32" | "bf16": the model's autocast dtype (`models/precision.py`).

    Raises:
        FileNotFoundError: the checkpoint, or any checkpoint in the run folder, does not exist.
    """
    if path is None:
        model = TinyFlowModel.load(None)
    else:
        p = Path(path)
        if p.is_dir() and (p / "checkpoints").is_dir():
            cks = sorted((p / "checkpoints").glob("iter*.pt"))
            if not cks:
                raise FileNotFoundError(f"run folder '{p}' has no checkpoints/iter*.pt yet")
            p = cks[-1]
        if p.suffix == ".pt":
            if not p.exists():
                raise FileNotFoundError(f"checkpoint '{p}' not found")
            st = torch.load(p, weights_only=False, map_location="cpu")
            model = TinyFlowModel(TinyDiTConfig(**st["model_config"]))
            if st.get("lora"):  # a LoRA run: rebuild its adapter to load the state, then evaluate the merged weights
                model.add_lora(**st["lora"])
            state = dict(st["model"])
            if st.get("ema"):
                state.update(st["ema"])  # evaluate the EMA weights when the run kept them
            model.net.load_state_dict(state)
            if model.has_lora:
                merged = TinyFlowModel(model.cfg)
                merged.net.load_state_dict(model.merged_state_dict())
                model = merged
            model.eval()
        else:
            model = TinyFlowModel.load(p)
    model.compute_dtype = torch.bfloat16 if resolve_precision(precision) == "bf16" else torch.float32
    return model
