"""Stateless sampler steps (ODE and three SDEs) with Gaussian log-probabilities.

Notation: see ``flowcredit.types`` (B batch, T steps, *latent the latent shape without batch).

Every step function has ONE signature::

    fn(x_t, v, t, t_next, *, params, noise=None, generator=None, x_next=None) -> StepOutput

and is used twice with the same code: the rollout samples (``x_next=None``: x_next = mean + std·noise) and the
trainer scores a recorded transition (``x_next`` given: no sampling). Keeping one function for both is what makes
the on-policy ratio exactly 1 (STYLE.md R5.1).

Legend (ALGORITHMS.md §1–§2): t current time, t_next = s next time (t_next < t), dt = t_next − t < 0,
v = v_θ(x_t, t) the (CFG) velocity, x̂0 = x_t − t·v, x̂1 = x_t + (1 − t)·v (§1.2). Each step is the Gaussian
policy π(x_next | x_t) = N(mean, std²·I). All math runs in fp32 (inputs are upcast).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..config.build import check_values
from ..config.registry import NoOptions, Registry
from ..config.schema import SamplerParams as SamplerParams  # the config's sampler section IS the step parameters

REDUCTIONS = ("mean", "sum")

# Smallest value allowed for (1 − t*) in the Flow-GRPO std a·sqrt(t / (1 − t*)). Only reached on degenerate grids
# (t = t_next = 1); keeps the std finite instead of inf.
FLOW_SDE_MIN_ONE_MINUS_T = 1e-6


@dataclass
class DDIMOptions:
    """`sampler.options` of ddim_sde (ALGORITHMS.md §2.3, A1/A2)."""

    sigma: Literal["eta_s_sqrt", "eta_s"] = field(
        default="eta_s_sqrt",
        metadata={"help": "σ schedule: η(t−Δt)√(1−t) (Stepwise §5.5, default) or η(t−Δt) (= Flow-CPS)."},
    )
    coef: Literal["ddim", "mm"] = field(
        default="ddim", metadata={"help": "x̂1 coefficient: sqrt(s²−σ²) (exact variance) or the marginal-matching "
                                          "s − σ²/(2s) (§2.3 (c), A2)."}
    )

    def __post_init__(self) -> None:
        check_values(self, "sampler.options")


def expand_like(a: Tensor, x: Tensor) -> Tensor:
    """Reshape a per-sample tensor so it broadcasts against a batch of latents.

    Args:
        a: (B,) per-sample values.
        x: (B, *latent) reference tensor.

    Returns:
        ``a`` viewed as (B, 1, …, 1) with ``x.ndim`` dims (no copy).
    """
    if a.ndim != 1 or a.shape[0] != x.shape[0]:
        raise ValueError(f"expand_like expects a (B,) tensor with B={x.shape[0]}, got shape {tuple(a.shape)}.")
    return a.reshape(a.shape[0], *([1] * (x.ndim - 1)))


def noise_level(params: SamplerParams) -> float:
    """The noise level of `params`: its own, or (null) the sampler's default (a = 0.7 for flow_sde / cps, Flow-GRPO
    App. B.3; η = 0.9 for ddim_sde, §2.3, A1; 0 for ode), declared in the sampler's registry entry."""
    if params.noise_level is not None:
        return float(params.noise_level)
    return float(SAMPLERS.spec(params.name).extra["noise_level"])


def step_options(params: SamplerParams):
    """The sampler's own options dataclass built from `params.options` (ConfigError naming sampler.options.KEY)."""
    return SAMPLERS.options(params.name, params.options)


@dataclass
class StepOutput:
    """Result of one sampler step (all fp32).

    Attributes:
        x_next: (B, *latent) the next state (sampled, or the given one when scoring).
        mean: (B, *latent) Gaussian mean of the step.
        std: (B,) Gaussian std of the step; 0 where the step is deterministic.
        log_prob: (B,) log π(x_next | x_t) reduced over latent dims; 0 where std == 0.
        kl_std: (B,) the std the closed-form KL to the reference policy is scaled with (A16).
    """

    x_next: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor
    kl_std: Tensor


# --------------------------------------------------------------------------------------------- Gaussian helpers


def _reduce(values: Tensor, reduce: str) -> Tensor:
    """Reduce (B, *latent) -> (B,) by mean or sum over all latent dims."""
    dims = tuple(range(1, values.ndim))
    if reduce == "mean":
        return values.mean(dim=dims) if dims else values
    if reduce == "sum":
        return values.sum(dim=dims) if dims else values
    raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}.")


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor, reduce: str = "mean") -> Tensor:
    """Full Gaussian log-density log N(x; mean, std²·I), reduced over latent dims.

    Per dim: −(x − mean)² / (2·std²) − log std − ½·log 2π (ALGORITHMS.md §2.1, §2.3). Rows with std == 0 return 0
    (a deterministic step has no log-prob; it is masked out of the loss, A3), never NaN.

    Args:
        x: (B, *latent) the scored sample.
        mean: (B, *latent) Gaussian mean.
        std: (B,) per-sample std ≥ 0.
        reduce: "mean" or "sum" over latent dims.

    Returns:
        (B,) fp32 log-probabilities.
    """
    x, mean, std = x.float(), mean.float(), std.float()
    stochastic = std > 0
    safe_std = expand_like(torch.where(stochastic, std, torch.ones_like(std)), x)
    per_dim = -((x - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - 0.5 * math.log(2 * math.pi)
    return torch.where(stochastic, _reduce(per_dim, reduce), torch.zeros_like(std))


def gaussian_kl_same_std(mean: Tensor, mean_ref: Tensor, std: Tensor, reduce: str = "mean") -> Tensor:
    """Closed-form KL(N(mean, std²I) ‖ N(mean_ref, std²I)) = reduce_d (mean − mean_ref)² / (2·std²).

    ALGORITHMS.md §2.3 / §3.1; with ``std = kl_std`` of ``flow_sde`` and reduce="mean" this is the Flow-GRPO code
    scaling (§3.2, A16). Rows with std == 0 return 0, never NaN.

    Args:
        mean: (B, *latent) policy mean.
        mean_ref: (B, *latent) reference-policy mean.
        std: (B,) shared std ≥ 0.
        reduce: "mean" or "sum" over latent dims.

    Returns:
        (B,) fp32 KL values.
    """
    mean, mean_ref, std = mean.float(), mean_ref.float(), std.float()
    stochastic = std > 0
    safe_std = expand_like(torch.where(stochastic, std, torch.ones_like(std)), mean)
    per_dim = (mean - mean_ref) ** 2 / (2 * safe_std**2)
    return torch.where(stochastic, _reduce(per_dim, reduce), torch.zeros_like(std))


# ------------------------------------------------------------------------------------------------ shared plumbing


def _batch_time(t: Tensor | float, x: Tensor, name: str) -> Tensor:
    """Return t as a (B,) fp32 tensor on x's device (0-dim / float inputs are broadcast)."""
    t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        return t.expand(x.shape[0])
    if t.shape != (x.shape[0],):
        raise ValueError(f"{name} must be 0-dim or (B,)=({x.shape[0]},), got shape {tuple(t.shape)}.")
    return t


def _prepare(x_t: Tensor, v: Tensor, t: Tensor | float, t_next: Tensor | float):
    """Upcast x_t, v (B, *latent) to fp32 and return t, t_next as (B,) fp32."""
    if x_t.shape != v.shape:
        raise ValueError(
            f"x_t and v must have the same shape (B, *latent), got {tuple(x_t.shape)} and {tuple(v.shape)}."
        )
    x_t, v = x_t.float(), v.float()
    return x_t, v, _batch_time(t, x_t, "t"), _batch_time(t_next, x_t, "t_next")


def _draw_noise(x: Tensor, noise: Tensor | None, generator: torch.Generator | None) -> Tensor:
    if noise is not None:
        if noise.shape != x.shape:
            raise ValueError(f"noise must have the latents' shape {tuple(x.shape)}, got {tuple(noise.shape)}.")
        return noise.to(device=x.device, dtype=torch.float32)
    # Draw on the generator's device so a CPU generator reproduces the same noise whatever the model device is.
    device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=device, dtype=torch.float32).to(x.device)


def _sample_or_score(
    mean: Tensor,
    std: Tensor,
    kl_std: Tensor,
    params: SamplerParams,
    noise: Tensor | None,
    generator: torch.Generator | None,
    x_next: Tensor | None,
) -> StepOutput:
    """Sample x_next = mean + std·noise (x_next None) or score the given x_next; then its log-prob.

    Both paths compute the log-prob from x_next with the same code, so rollout and recomputation agree bit-for-bit.
    """
    if x_next is not None and noise is not None:
        raise ValueError(
            "Got both x_next and noise: pass x_next to SCORE a recorded transition (training), or noise/generator to "
            "SAMPLE a new one (rollout), not both."
        )
    if x_next is None:
        if bool((std > 0).any()):
            x_next = mean + expand_like(std, mean) * _draw_noise(mean, noise, generator)
        else:
            x_next = mean.clone()
    else:
        if x_next.shape != mean.shape:
            raise ValueError(f"x_next must have shape {tuple(mean.shape)}, got {tuple(x_next.shape)}.")
        x_next = x_next.float()
    log_prob = gaussian_log_prob(x_next, mean, std, params.reduce)
    return StepOutput(x_next=x_next, mean=mean, std=std, log_prob=log_prob, kl_std=kl_std)


# -------------------------------------------------------------------------------------------------- the samplers


def ode_step(x_t, v, t, t_next, *, params, noise=None, generator=None, x_next=None) -> StepOutput:
    """Deterministic Euler step of dx = v dt: x_next = x_t + (t_next − t)·v (ALGORITHMS.md §1.1). std = 0.

    Args:
        x_t: (B, *latent) current state.
        v: (B, *latent) velocity at (x_t, t).
        t: (B,) or 0-dim current time.
        t_next: (B,) or 0-dim next time (< t).
        params: SamplerParams (only ``reduce`` is read).
        noise: unused (accepted for the common signature; no noise is drawn).
        generator: unused.
        x_next: (B, *latent) optional state to score instead of stepping.

    Returns:
        StepOutput with std = log_prob = kl_std = 0.
    """
    x_t, v, t, t_next = _prepare(x_t, v, t, t_next)
    mean = x_t + expand_like(t_next - t, x_t) * v
    zeros = torch.zeros_like(t)
    return _sample_or_score(mean, zeros, zeros, params, noise, None, x_next)


def flow_grpo_std_dev(t: Tensor, t_next: Tensor, a: float) -> Tensor:
    """Flow-GRPO noise schedule std_dev_t = a·sqrt(t / (1 − t*)) (ALGORITHMS.md §2.1, code form).

    Guard (decisions table, "Flow-GRPO SDE at t=1"): at t == 1 the denominator 1 − t is 0, so t* = t_next there
    (flow_grpo's ``sigma_max = sigmas[1]`` trick, e.g. 0.96 on the 10-step grid); elsewhere t* = t. The numerator
    keeps t. (1 − t*) is further floored at FLOW_SDE_MIN_ONE_MINUS_T so a degenerate grid stays finite.

    Args:
        t: (B,) current time.
        t_next: (B,) next time.
        a: noise level.

    Returns:
        (B,) std_dev_t (the per-unit-time std of the SDE, not yet multiplied by sqrt|dt|).
    """
    return a * torch.sqrt(t.clamp_min(0.0) / _flow_sde_one_minus_t_star(t, t_next))


def _flow_sde_one_minus_t_star(t: Tensor, t_next: Tensor) -> Tensor:
    """(B,) 1 − t* with t* = t_next where t == 1 else t, floored at FLOW_SDE_MIN_ONE_MINUS_T (t = 1 guard)."""
    t_star = torch.where(t >= 1.0, t_next, t)
    return (1.0 - t_star).clamp_min(FLOW_SDE_MIN_ONE_MINUS_T)


def flow_sde_step(x_t, v, t, t_next, *, params, noise=None, generator=None, x_next=None) -> StepOutput:
    """Flow-GRPO Euler–Maruyama step (ALGORITHMS.md §2.1, official code form; Flow-GRPO Eqs. 7–9).

        std_dev_t = a·sqrt(t / (1 − t*))                       (see flow_grpo_std_dev for the t = 1 guard)
        mean      = x·(1 + std_dev_t²·dt/(2t)) + v·(1 + std_dev_t²·(1 − t)/(2t))·dt,     dt = t_next − t < 0
        std       = std_dev_t·sqrt(−dt),      kl_std = std_dev_t   (Flow-GRPO code KL scaling, A16)

    The ratio std_dev_t²/(2t) is evaluated as a²/(2(1 − t*)) (same value, [R]), so t = 0 never divides by zero
    (not reached on normal grids; there std_dev_t = 0 and dt ≥ 0 gives std = 0).

    Args:
        x_t: (B, *latent) current state.
        v: (B, *latent) velocity at (x_t, t).
        t: (B,) or 0-dim current time.
        t_next: (B,) or 0-dim next time (< t).
        params: SamplerParams; ``noise_level`` is a.
        noise: (B, *latent) optional standard-normal noise for sampling.
        generator: optional torch.Generator used when noise is None.
        x_next: (B, *latent) optional recorded next state to score (no sampling).

    Returns:
        StepOutput.
    """
    x_t, v, t, t_next = _prepare(x_t, v, t, t_next)
    a = noise_level(params)
    dt = t_next - t  # (B,) < 0
    std_dev_t = flow_grpo_std_dev(t, t_next, a)  # (B,)
    half_ratio = a**2 / (2 * _flow_sde_one_minus_t_star(t, t_next))  # (B,) = std_dev_t² / (2t)
    x_coef = 1 + half_ratio * dt  # (B,)
    v_coef = (1 + half_ratio * (1 - t)) * dt  # (B,)
    mean = expand_like(x_coef, x_t) * x_t + expand_like(v_coef, x_t) * v
    std = std_dev_t * torch.sqrt((-dt).clamp_min(0.0))
    return _sample_or_score(mean, std, std_dev_t, params, noise, generator, x_next)


def cps_step(x_t, v, t, t_next, *, params, noise=None, generator=None, x_next=None) -> StepOutput:
    """Flow-CPS step (ALGORITHMS.md §2.2, flow_grpo ``sde_type='cps'``).

        std  = t_next·sin(a·π/2)
        mean = x̂0·(1 − t_next) + x̂1·sqrt(t_next² − std²),   x̂0 = x − t·v,  x̂1 = x + (1 − t)·v   (§1.2)

    The log-prob is the FULL Gaussian log-density (reduced by ``params.reduce``). The official code drops the
    constants and the 1/(2·std²) factor (log_prob = −mean_d (x' − mean)²), which rescales the PPO ratio like a
    temperature and makes ``clip_range`` mean something different per step; we keep the true density so that every
    sampler's ratio and clip range mean the same thing (A8). kl_std = std.

    Args:
        x_t: (B, *latent) current state.
        v: (B, *latent) velocity at (x_t, t).
        t: (B,) or 0-dim current time.
        t_next: (B,) or 0-dim next time (< t).
        params: SamplerParams; ``noise_level`` is a.
        noise: (B, *latent) optional standard-normal noise for sampling.
        generator: optional torch.Generator used when noise is None.
        x_next: (B, *latent) optional recorded next state to score (no sampling).

    Returns:
        StepOutput.
    """
    x_t, v, t, t_next = _prepare(x_t, v, t, t_next)
    a = noise_level(params)
    std = t_next * math.sin(a * math.pi / 2)  # (B,)
    x0_hat = x_t - expand_like(t, x_t) * v
    x1_hat = x_t + expand_like(1 - t, x_t) * v
    coef = torch.sqrt((t_next**2 - std**2).clamp_min(0.0))  # (B,)
    mean = expand_like(1 - t_next, x_t) * x0_hat + expand_like(coef, x_t) * x1_hat
    return _sample_or_score(mean, std, std, params, noise, generator, x_next)


def _ddim_sigma_factor(t: Tensor, t_next: Tensor, kind: str) -> Tensor:
    """g in the Stepwise DDIM-SDE noise σ = η·s·g, s = t_next (ALGORITHMS.md §2.3, A1, A3).

    kind "eta_s_sqrt": g = sqrt(1 − t), evaluated at t_next when t == 1 so step 0 still explores (decisions table,
    "steps whose σ is 0"); "eta_s": g = 1 (the Flow-CPS form).

    Args:
        t: (B,) current time.
        t_next: (B,) next time s.
        kind: the ddim_sde option ``sigma``.

    Returns:
        (B,) g.
    """
    if kind == "eta_s":
        return torch.ones_like(t)
    if kind == "eta_s_sqrt":
        t_eff = torch.where(t >= 1.0, t_next, t)
        return torch.sqrt((1.0 - t_eff).clamp_min(0.0))
    raise ValueError(f"sampler.options.sigma must be 'eta_s_sqrt' or 'eta_s', got {kind!r}.")


def ddim_sde_step(x_t, v, t, t_next, *, params, noise=None, generator=None, x_next=None) -> StepOutput:
    """Stepwise "DDIM-inspired" SDE step (ALGORITHMS.md §2.3; Stepwise §5.5).

        x_next = (1 − s)·x̂0 + c·x̂1 + σ·ε,   s = t_next,  σ = η·s·g(t)  (g: _ddim_sigma_factor)
        c = sqrt(max(s² − σ², 0))   ("ddim", exact variance preservation)   or   s − σ²/(2s)   ("mm", A2)
        std = σ (NOT times sqrt|Δt|),  kl_std = σ

    With σ = 0 this is exactly the Euler ODE step. The "mm" term σ²/(2s) is evaluated as η²·s·g²/2 (σ = η·s·g), so
    s = 0 never divides by zero.

    Args:
        x_t: (B, *latent) current state.
        v: (B, *latent) velocity at (x_t, t).
        t: (B,) or 0-dim current time.
        t_next: (B,) or 0-dim next time (< t).
        params: SamplerParams; ``noise_level`` is η; its options (DDIMOptions) ``sigma`` and ``coef``.
        noise: (B, *latent) optional standard-normal noise for sampling.
        generator: optional torch.Generator used when noise is None.
        x_next: (B, *latent) optional recorded next state to score (no sampling).

    Returns:
        StepOutput.
    """
    x_t, v, t, t_next = _prepare(x_t, v, t, t_next)
    eta, opts = noise_level(params), step_options(params)
    s = t_next
    g = _ddim_sigma_factor(t, t_next, opts.sigma)  # (B,)
    sigma = eta * s * g  # (B,)
    if opts.coef == "ddim":
        coef = torch.sqrt((s**2 - sigma**2).clamp_min(0.0))
    else:  # "mm": s − σ²/(2s) = s − η²·s·g²/2
        coef = s - 0.5 * eta**2 * s * g**2
    x0_hat = x_t - expand_like(t, x_t) * v
    x1_hat = x_t + expand_like(1 - t, x_t) * v
    mean = expand_like(1 - s, x_t) * x0_hat + expand_like(coef, x_t) * x1_hat
    return _sample_or_score(mean, sigma, sigma, params, noise, generator, x_next)


StepFn = Callable[..., StepOutput]

# name → step function + its own options dataclass (sampler.options) + its default noise level; `stochastic`: whether
# the step explores (σ > 0), i.e. whether SDE log-probs exist for it.
SAMPLERS = Registry("sampler", "sampler")
SAMPLERS.register("ode", ode_step, NoOptions, help="deterministic Euler step of the flow ODE (§1.1)",
                  noise_level=0.0, stochastic=False)
SAMPLERS.register("flow_sde", flow_sde_step, NoOptions, help="Flow-GRPO's Euler–Maruyama SDE, noise level a (§2.1)",
                  noise_level=0.7, stochastic=True)
SAMPLERS.register("cps", cps_step, NoOptions, help="Flow-CPS coefficient-preserving step, noise level a (§2.2)",
                  noise_level=0.7, stochastic=True)
SAMPLERS.register("ddim_sde", ddim_sde_step, DDIMOptions, help="Stepwise's DDIM-inspired SDE, noise level η (§2.3)",
                  noise_level=0.9, stochastic=True)


def sampler_step(params: SamplerParams, x_t: Tensor, v: Tensor, t, t_next, **kwargs) -> StepOutput:
    """Dispatch to the step function registered as ``params.name`` (see the step functions for the shapes).

    Args:
        params: SamplerParams selecting the step function (the config's `sampler` section is one).
        x_t: (B, *latent) current state.
        v: (B, *latent) velocity at (x_t, t).
        t: (B,) or 0-dim current time.
        t_next: (B,) or 0-dim next time.
        **kwargs: ``noise``, ``generator`` or ``x_next`` (see the step functions).

    Returns:
        StepOutput.
    """
    return SAMPLERS.spec(params.name).fn(x_t, v, t, t_next, params=params, **kwargs)
