"""Device memory levers of the trainer: CPU-offloaded AdamW, an offloaded KL reference, gradient checkpointing.

``optim.offload_optimizer``, ``optim.offload_reference`` and ``model.gradient_checkpointing`` (docs/SCALING.md). Same
arithmetic as without them; each trades host↔device copies or recomputation for accelerator memory.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Sequence
from typing import cast

import torch

from ..types import FlowModel


class OffloadedAdamW:
    """AdamW whose fp32 master weights and moments live in CPU memory (ZeRO-Offload style, without DeepSpeed).

    ``step()`` copies the device gradients to the CPU masters, steps AdamW there and copies the weights back, so the
    accelerator holds only the (possibly bf16) weights and their gradients. Same math as ``torch.optim.AdamW``; the
    state dict has the same layout, so checkpoints move between offloaded and plain runs.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], **kw):
        self.params = list(params)
        self.master = [p.detach().to("cpu", torch.float32, copy=True).requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.master, **kw)
        self.param_groups = self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32)
        self.inner.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m.to(p.device, p.dtype))

    @torch.no_grad()
    def resync(self) -> None:
        """Re-read the master weights from the model (after a checkpoint load replaced them)."""
        for p, m in zip(self.params, self.master):
            m.copy_(p.detach().to("cpu", torch.float32))

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.resync()


def build_optimizer(params: Sequence[torch.nn.Parameter], offload: bool, **kw):
    return OffloadedAdamW(params, **kw) if offload else torch.optim.AdamW(params, **kw)


class KLReferences:
    """The KL references of a run (GRPO's β·KL, AWM's two terms), as contexts yielding a model.

    π_ref (`reference()`): a frozen copy of the initial weights, or, for LoRA models, the model itself with its
    adapter disabled (`model.reference()`, Flow-GRPO's `disable_adapter()`, no copy). optim.kl_reference=ema: always a
    copy (LoRA included), whose trainable weights then follow the policy as a slow EMA (`harness.MovingReference`).
    optim.kl_base_beta > 0 (`base()`): a second KL term to the initial weights beside the EMA reference (AWM): for LoRA
    the adapter-disabled model, else a second frozen copy.
    """

    def __init__(self, model, kl_beta: float, moving: bool, kl_base_beta: float):
        lora = hasattr(model, "reference")
        self.model = model
        self.ref_model = None
        if kl_beta > 0 and (moving or not lora):
            self.ref_model = copy.deepcopy(model).requires_grad_(False).eval()
        self.base_model = None
        if kl_base_beta > 0 and not lora:
            self.base_model = copy.deepcopy(model).requires_grad_(False).eval()

    def reference(self):
        """Context yielding π_ref."""
        if self.ref_model is not None:
            return contextlib.nullcontext(self.ref_model)
        return self.model.reference()

    def base(self):
        """Context yielding the initial weights of the second KL term (optim.kl_base_beta)."""
        if self.base_model is not None:
            return contextlib.nullcontext(self.base_model)
        return self.model.reference()


class ReferenceOffload:
    """``optim.offload_reference``: the frozen reference copy (KL with kl_beta > 0, non-LoRA) lives in CPU memory and
    visits the device once per update, for one no-grad pass that computes the reference step means of every pair to
    be trained (``step_means``); the rollout, the rewards and the policy's forward/backward never share the device
    with it. Costs one host↔device copy of the reference weights per iteration."""

    def __init__(self, ref_model: torch.nn.Module | None, device: torch.device | str, enabled: bool):
        self.ref, self.device, self.enabled = ref_model, torch.device(device), enabled and ref_model is not None
        self.park()

    def load(self) -> None:
        """Reference weights onto the device (start of the update phase)."""
        if self.enabled and self.ref is not None:
            self.ref.to(self.device)

    def park(self) -> None:
        """Reference weights back to CPU memory (end of the update phase)."""
        if self.enabled and self.ref is not None:
            self.ref.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @torch.no_grad()
    def step_means(self, traj, pairs, cond, uncond, params, guidance: float, chunk: int) -> tuple[torch.Tensor, int]:
        """The reference policy's step means of every pair the update will train, computed in ONE pass with the
        reference on the device, which is then parked again: the policy's forward/backward passes run without it.
        pairs: this rank's (row, step) pairs of the update (any order, repeats allowed).
        Returns ((B, T, *latent) means, filled where trained; the reference NFE spent)."""
        from ..samplers.policy import nfe_per_sample, policy_velocity
        from ..samplers.sde import sampler_step
        from ..types import cond_index

        ref = cast(FlowModel, self.ref)  # step_means is called only when enabled, i.e. with a reference model
        pairs = sorted(set(pairs))
        means = torch.zeros_like(traj.latents[:, :-1])
        self.load()
        try:
            for s in range(0, len(pairs), chunk):
                bi = torch.tensor([p[0] for p in pairs[s : s + chunk]])
                ji = torch.tensor([p[1] for p in pairs[s : s + chunk]])
                x_t, t = traj.latents[bi, ji], traj.timesteps[ji]
                u = cond_index(uncond, bi) if uncond is not None else None
                v = policy_velocity(ref, x_t, t, cond_index(cond, bi), u, guidance)
                means[bi, ji] = sampler_step(
                    params, x_t, v, t, traj.timesteps[ji + 1], x_next=traj.latents[bi, ji + 1]
                ).mean
        finally:
            self.park()
        return means, len(pairs) * nfe_per_sample(uncond, guidance)


def enable_gradient_checkpointing(model) -> bool:
    """``model.gradient_checkpointing``: the model's own switch when it has one (diffusers adapters), else each of
    the tiny model's transformer blocks recomputes its activations in the backward pass (``torch.utils.checkpoint``;
    parameter names unchanged). Apply it to the policy only, after any reference copy was made. Returns whether on."""
    own = getattr(model, "enable_gradient_checkpointing", None)
    if callable(own):
        own()
        return True
    blocks = getattr(getattr(model, "net", None), "blocks", None)
    if blocks is None:
        warnings.warn(f"model.gradient_checkpointing: {type(model).__name__} has no switch; ignored", stacklevel=2)
        return False
    for blk in blocks:
        if not getattr(blk, "_fc_checkpointed", False):
            blk.forward = _checkpointed(blk.forward)
            blk._fc_checkpointed = True
    return True


def _checkpointed(forward):
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30


def keep_freed_host_memory() -> bool:
    """glibc only: serve allocations up to 32 MB from the heap and keep freed heap memory (up to 1 GB at its top)
    instead of returning it to the OS, so the large temporaries of every forward/backward (e.g. the tiny DiT's
    (64, 80, 768) MLP activations, 16 MB in fp32) reuse pages instead of page-faulting fresh ones on every call.

    By default glibc maps such blocks with mmap and unmaps them when freed (its threshold adapts only up to the
    largest block freed so far); on 2 cores the page faults cost 6–7% of a training iteration of the default job
    (README "Where the time goes"). `run.keep_freed_memory`. Process-wide and idempotent; the RSS stays at the peak.

    Returns:
        True if both parameters were set (Linux with glibc), False elsewhere (nothing changed).
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
