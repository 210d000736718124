"""`model.precision: auto`: bf16 autocast only where the hardware runs bf16 matmuls fast.

bf16 autocast is a speed lever, not a quality one (step math is fp32 either way). It pays on GPUs with bf16 and on
CPUs whose oneDNN has a bf16 path (AVX-512 — with AVX-512 BF16 or AMX natively — where it measured 2-3× fp32 on the
tiny model), but on a CPU with AVX2 only oneDNN has no bf16 kernels and PyTorch emulates them: measured there
(2-core AMD EPYC, AVX2, `python benchmarks/bench_model.py`), the tiny model's forward ran at 47 images/s in bf16
against 211 in fp32, 4.4× slower. `auto` asks oneDNN (`torch.ops.mkldnn._is_mkldnn_bf16_supported`, the check
PyTorch's own CPU bf16 tests use) and CUDA, and falls back to fp32 when it cannot tell.
"""

from __future__ import annotations

from typing import Literal

import torch

PRECISIONS = ("auto", "fp32", "bf16")


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """True if bf16 autocast on `device` is expected to be faster than fp32 (see the module docstring)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if dev.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a build without oneDNN or without the op: be safe
            return False
    return False


def resolve_precision(precision: str, device: str | torch.device = "cpu") -> Literal["fp32", "bf16"]:
    """'auto' → 'bf16' if `fast_bf16(device)` else 'fp32'; 'fp32' / 'bf16' are returned as given.

    Raises ValueError (one line naming model.precision and the valid values) for anything else.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"model.precision={precision!r}; valid: {', '.join(PRECISIONS)}")
    if precision != "auto":
        return "bf16" if precision == "bf16" else "fp32"
    return "bf16" if fast_bf16(device) else "fp32"
