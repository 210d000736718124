"""Loading a tiny model for evaluation, sampling, export and reports from any artefact a run leaves behind.

Owned by `models` so that `cli`, `compare` and `eval` load weights the same way without importing the CLI.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .precision import resolve_precision
from .tiny import TinyDiTConfig, TinyFlowModel


def load_any_model(path: str | None, precision: str = "fp32") -> TinyFlowModel:
    """A tiny model from: None (shipped), a .safetensors file, a trainer checkpoint folder, or a run folder.

    A run folder means its newest intact `checkpoints/iterNNNNNN/` (a damaged newer one is skipped with a warning). A
    checkpoint's EMA weights are used when the run kept them, and a LoRA run's adapter is folded into plain weights.
    Nothing is unpickled: old `.pt` checkpoints are refused with the `flowcredit convert --trust` command.

    Args:
        path: None, a `.safetensors` file (with its JSON), a checkpoint folder, or a run folder.
        precision: "auto" | "fp32" | "bf16": the model's autocast dtype (`models/precision.py`).

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
                if st.get("ema"):
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
