"""Memory preflight: a batch too large for memory fails before training starts, in one line, with the estimate.

`check_memory(cfg, model, device)` is called by `Trainer.setup()` once the model is built (and gradient
checkpointing applied), before the optimizer exists and before anything is written. It estimates what one
iteration adds on `device` beyond the weights already loaded:

  * gradients of the trainable parameters (their dtype) and AdamW's two moments (fp32; on the host, not the
    device, with ``optim.offload_optimizer`` on an accelerator), the EMA copy (``optim.ema_decay > 0``), the
    initial-weights copy of the baseline evaluation and the KL reference copy (``kl_beta > 0`` without LoRA
    or with ``optim.kl_reference=ema``, unless ``optim.offload_reference``), nft's soft-updated π_old
    (``objective.options.old_policy=soft``: a copy of the trainable weights, one more while it is swapped in, and its
    velocities (B, T, *latent)); with ``dist.fsdp`` the parameter states are divided by the process count;
  * the rollout tensors kept until the update: latents (B, T+1, *latent) fp32, the velocities (B, T, *latent)
    when the credit needs them, the log-probs and the decoded images;
  * the activations autograd saves for one micro-batch of ``min(optim.micro_batch, pairs per step)`` pairs,
    forward + backward. These are measured, not guessed: a probe runs the policy velocity (CFG included) with
    gradients on 1 and on 2 pairs under ``torch.autograd.graph.saved_tensors_hooks`` and sums the bytes of the
    distinct storages autograd keeps (parameters excluded), which gives a per-pair cost and a fixed part (e.g.
    the bf16 copies of the weights under autocast), × BACKWARD_FACTOR for the backward's transient buffers; the
    probe is cached per model/precision/device.

The estimate × `margin` is compared with the available memory: on CPU ``psutil.virtual_memory().available``
(if psutil is installed) or MemAvailable of /proc/meminfo; on CUDA ``torch.cuda.mem_get_info``. Not counted:
the transient activations of the no-grad rollout forward (one layer at a time, small next to the saved
activations of a micro-batch) and allocator fragmentation, which the margin covers. Unknown available memory
(another platform, another device type) skips the check. ``FLOWCREDIT_NO_MEMORY_CHECK=1`` skips it too (for an
estimate that is wrong on some model: please report it).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

GB = 1e9
DEFAULT_MARGIN = 1.25
# backward allocates transient gradient buffers beside the saved activations: measured peak RSS of forward+backward
# of the tiny model over the saved bytes: 1.4x at 64 pairs (allocator granularity), 1.12x at 256
BACKWARD_FACTOR = 1.15
SKIP_ENV = "FLOWCREDIT_NO_MEMORY_CHECK"

_PROBE_CACHE: dict[tuple, tuple[float, float]] = {}


@dataclass
class MemoryEstimate:
    """Bytes one iteration needs on the device beyond the loaded weights, by part (see the module docstring)."""

    weights: float  # already resident; reported, not added to `needed`
    grads: float
    adam: float
    copies: float  # EMA, baseline initial weights, KL reference
    rollout: float
    activations: float
    micro_batch: int  # pairs in the largest micro-batch
    per_pair: float  # measured saved-activation bytes of one pair
    batch: int  # rollout rows B on this process
    states: int  # T + 1

    @property
    def needed(self) -> float:
        return self.grads + self.adam + self.copies + self.rollout + self.activations

    def breakdown(self) -> str:
        g = lambda b: f"{b / GB:.2f}"  # noqa: E731
        parts = [f"grads {g(self.grads)}", f"AdamW {g(self.adam)}"]
        if self.copies:
            parts.append(f"weight copies {g(self.copies)}")
        parts.append(f"rollout {g(self.rollout)} for {self.batch} samples x {self.states} states")
        parts.append(
            f"activations {g(self.activations)} for a micro-batch of {self.micro_batch} pairs at "
            f"{self.per_pair / 1e6:.1f} MB/pair"
        )
        return ", ".join(parts)


# -------------------------------------------------------------------------------------------- available memory


def available_bytes(device: str | torch.device) -> float | None:
    """Free memory on `device` in bytes, or None when it cannot be told."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(dev)
        return float(free)
    if dev.type != "cpu":
        return None
    try:
        import psutil  # type: ignore[import-untyped]

        return float(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024.0  # kB
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------------------- activation probe


def _saved_bytes(model, n: int, guidance: float) -> float:
    """Bytes of the distinct storages autograd saves for the policy velocity of `n` pairs (parameters excluded)."""
    from ..samplers.policy import policy_velocity

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr and ptr not in params:
                seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage (e.g. sparse): count its size
            seen[id(t)] = t.numel() * t.element_size()
        return t

    dev = next(model.parameters()).device
    cond = model.encode_prompts(["a photo"] * n)
    uncond = model.encode_prompts([""] * n) if guidance != 1.0 else None
    x_t = torch.zeros(n, *model.latent_shape, device=dev)
    t = torch.full((n,), 0.5, device=dev)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        v = policy_velocity(model, x_t, t, cond, uncond, guidance)
        # the step's Gaussian log-prob saves about one latent per pair; count the output and its float copy
        seen[-1] = 2 * v.numel() * 4
        del v
    return float(sum(seen.values()))


def probe_activations(model, guidance: float = 1.0) -> tuple[float, float]:
    """(fixed bytes, bytes per pair) autograd saves for a micro-batch of pairs, measured on 1 and 2 pairs."""
    net = getattr(model, "net", model)
    key = (
        type(model).__name__, repr(getattr(model, "cfg", None)), str(getattr(model, "compute_dtype", None)),
        str(next(model.parameters()).device), guidance != 1.0,
        sum(p.numel() for p in model.parameters() if p.requires_grad),
        any(getattr(b, "_fc_checkpointed", False) for b in getattr(net, "blocks", [])),
        bool(getattr(model, "gradient_checkpointing", False)),
    )
    if key not in _PROBE_CACHE:
        was_training = model.training
        b1 = _saved_bytes(model, 1, guidance)
        b2 = _saved_bytes(model, 2, guidance)
        model.train(was_training)
        per_pair = b2 - b1 if b2 > b1 else b1
        _PROBE_CACHE[key] = (max(0.0, b1 - per_pair), per_pair)
    return _PROBE_CACHE[key]


# ---------------------------------------------------------------------------------------------------- estimate


def estimate_memory(
    cfg, model, device: str | torch.device, world_size: int = 1, reference_loaded: bool = False
) -> MemoryEstimate:
    """The per-process memory of one iteration of `cfg` with `model` (built, trainable flags set) on `device`.
    `reference_loaded`: the KL reference copy exists already (it is then resident, not counted)."""
    from ..credit.registry import needs_instant_rewards, needs_step_rewards

    dev = torch.device(device)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weight_bytes = float(sum(p.numel() * p.element_size() for p in params))
    train_bytes = float(sum(p.numel() * p.element_size() for p in trainable))
    train_numel = float(sum(p.numel() for p in trainable))
    shard = world_size if (cfg.dist.fsdp and world_size > 1) else 1
    grads = train_bytes / shard
    on_host = cfg.optim.offload_optimizer and dev.type != "cpu"
    adam = 0.0 if on_host else 2 * 4 * train_numel / shard
    copies = 0.0
    if cfg.optim.ema_decay > 0:
        copies += train_bytes / shard
    if cfg.run.eval_baseline and cfg.run.eval_at_end:
        copies += weight_bytes
    ref_on_host = cfg.optim.offload_reference and dev.type != "cpu"
    ref_copy = cfg.optim.kl_reference == "ema" or not hasattr(model, "reference")  # LoRA + initial: no copy
    if cfg.optim.kl_beta > 0 and ref_copy and not ref_on_host and not reference_loaded:
        copies += weight_bytes / shard
    opts = cfg.objective.options or {}
    soft_old = cfg.objective.name == "nft" and (
        opts.get("old_policy") if isinstance(opts, dict) else getattr(opts, "old_policy", None)) == "soft"
    if soft_old:  # nft old_policy=soft: π_old's copy of the trainable weights + the backup while it is swapped in
        copies += 2 * train_bytes / shard

    B = math.ceil(cfg.data.prompts_per_iter * cfg.data.group_size / max(1, world_size))
    T = cfg.sampler.num_steps
    latent = float(math.prod(model.latent_shape))
    rollout = B * (T + 1) * latent * 4 + B * T * 4 * 3  # latents + log-probs/means bookkeeping
    if needs_step_rewards(cfg.credit) or needs_instant_rewards(cfg.credit):
        rollout += B * T * latent * 4  # kept velocities
    rollout += B * latent * 4  # decoded images
    if soft_old:
        rollout += B * T * latent * 4  # π_old's velocities v_old of the update (objectives/forward.py)

    trained_steps = cfg.sampler.train_steps_per_sample or max(1, int(T * cfg.sampler.timestep_fraction))
    pairs_per_step = max(1, math.ceil(B * min(trained_steps, T) / cfg.optim.updates_per_epoch))
    mb = min(cfg.optim.micro_batch, pairs_per_step)
    fixed, per_pair = probe_activations(model, cfg.sampler.guidance_scale)
    activations = (fixed + mb * per_pair) * BACKWARD_FACTOR
    return MemoryEstimate(
        weights=weight_bytes, grads=grads, adam=adam, copies=copies, rollout=rollout, activations=activations,
        micro_batch=mb, per_pair=per_pair, batch=B, states=T + 1,
    )


def check_memory(
    cfg,
    model,
    device: str | torch.device,
    world_size: int = 1,
    margin: float = DEFAULT_MARGIN,
    reference_loaded: bool = False,
) -> MemoryEstimate | None:
    """Raise ValueError (one line: the estimate by part in GB, what is available, the fix) when one iteration of
    `cfg` would not fit in the memory of `device`; return the estimate otherwise (None when skipped).

    Call it once the model is built and gradient checkpointing applied, before the optimizer is built and before
    anything is written; `reference_loaded=True` when the KL reference copy already exists (it is resident)."""
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return None
    avail = available_bytes(device)
    if avail is None:
        return None
    est = estimate_memory(cfg, model, device, world_size, reference_loaded)
    if est.needed * margin <= avail:
        return est
    dev = torch.device(device)
    raise ValueError(
        f"one iteration needs about {est.needed / GB:.2f} GB on {dev} beyond the {est.weights / GB:.2f} GB of "
        f"weights ({est.breakdown()}), x{margin:g} margin, but only {avail / GB:.2f} GB is available; lower "
        f"optim.micro_batch (now {cfg.optim.micro_batch}), data.group_size ({cfg.data.group_size}) or "
        f"data.prompts_per_iter ({cfg.data.prompts_per_iter}), or set model.gradient_checkpointing=true"
        f" (or {SKIP_ENV}=1 to skip this check)"
    )


def describe_estimate(est: Any) -> str:
    """One line for logs: the estimate in GB by part."""
    return f"memory estimate: {est.needed / GB:.2f} GB beyond {est.weights / GB:.2f} GB of weights ({est.breakdown()})"
