"""LoRA helpers shared by the tiny model (`tiny.py`) and the diffusers adapters (`diffusers_common.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def adapters_disabled(net: nn.Module, disable, enable) -> Iterator[None]:
    """Run `disable()` on entry and `enable()` on exit, and give every parameter of `net` back its requires_grad flag.

    peft's `BaseTunerLayer.enable_adapters(False/True)` (also behind diffusers' `disable_adapters()` /
    `enable_adapters()`, loaders/peft.py) flips requires_grad of the adapter weights; the reference-policy context
    must leave the optimizer's view of the model exactly as it found it.
    """
    flags = [(p, p.requires_grad) for p in net.parameters()]
    disable()
    try:
        yield
    finally:
        enable()
        for p, g in flags:
            p.requires_grad_(g)
