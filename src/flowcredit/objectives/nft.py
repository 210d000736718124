"""`nft`: DiffusionNFT's negative-aware fine-tuning on the forward process.

Zheng et al. 2025, §3–4; ALGORITHMS.md §9.2.

For a pair (b, j) with x_t, t, x0 from `forward.ForwardProcess` and the advantage A = A[b, j]:

    r    = clamp(clamp(A, −m, m) / (2m) + 1/2, 0, 1)           optimality probability, m = adv_clip_max
    v⁺   = β·v_θ + (1 − β)·v_old                                implicit positive policy
    v⁻   = (1 + β)·v_old − β·v_θ                                implicit negative policy
    x̂0±  = x_t − t·v±
    w±   = sg(mean_d |x̂0± − x0|) ∨ 1e-5                         adaptive weight (adaptive_weight=true)
    L    = m · [ r·mean_d (x̂0⁺ − x0)² / w⁺ + (1 − r)·mean_d (x̂0⁻ − x0)² / w⁻ ] / β + kl_beta·mean_d (v_θ − v_ref)²
           [+ kl_base_beta·mean_d (v_θ − v_base)², optim.kl_base_beta > 0]

v_old is π_old's velocity (sg(v_θ) on-policy: one optimizer step per rollout batch). At v_θ = v_old both x̂0± equal
x̂0(v_old), so ∇_v L = m·(2r − 1)·∇_v mean_d (x̂0 − x0)² / w: advantage-weighted flow matching, zero at A = 0
(tests/objectives/test_nft.py). Read from NVlabs/DiffusionNFT `scripts/train_nft_sd3.py` (m = 5, GenEval β = 1).

π_old (`old_policy`, ALGORITHMS.md §9.2): `current` (default) is θ at the start of the update (v_old = sg(v_θ) with
one optimizer step per rollout batch). `soft` is DiffusionNFT's: a copy of the trainable weights soft-updated once per
iteration (their epoch), after its optimizer steps, θ_old ← d·θ_old + (1 − d)·θ with d = `soft_update_decay`(k) of the
optimizer steps k taken so far (GenEval: min(0.001·k, 0.5)); it samples the rollouts and gives v_old
(`trainer/harness.SoftOldPolicy`; NVlabs/DiffusionNFT `scripts/train_nft_sd3.py` @ 24af555: `return_decay`, the
`set_adapter("old")` rollout and `old_prediction`, the soft update at the end of each epoch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..types import Trajectory
from .base import LossContext, LossOut, register_objective
from .forward import ForwardProcess, NoiseMode, base_kl_enabled, kl_fraction_field

AdvMode = Literal["all", "positive_only", "negative_only", "one_only", "binary"]
OldPolicy = Literal["current", "soft"]


@dataclass
class NFTOptions:
    beta: float = field(
        default=1.0, metadata={"help": "β of the implicit policies v± (DiffusionNFT GenEval: 1.0; OCR 0.1).", "gt": 0}
    )
    adv_clip_max: float = field(
        default=5.0, metadata={"help": "m: advantages are clipped to ±m and mapped to r ∈ [0, 1].", "gt": 0}
    )
    adaptive_weight: bool = field(
        default=True, metadata={"help": "Divide each x̂0 error by its detached mean |error| (DiffusionNFT)."}
    )
    noise: NoiseMode = field(
        default="fresh",
        metadata={
            "help": "fresh ε per pair, or the rollout's own state x^(j) as x_t.",
            "choices": ("fresh", "rollout"),
        },
    )
    crn: bool = field(
        default=False,
        metadata={
            "help": "Common random numbers: the members of a prompt group are trained at the same steps with the same "
            "ε, so sample-independent gradient noise cancels in the group-centred advantage sum (noise=fresh)."
        },
    )
    kl_fraction: float = kl_fraction_field()
    adv_mode: AdvMode = field(
        default="all",
        metadata={
            "help": "Which advantages train (DiffusionNFT `train.adv_mode`): all; positive_only = clamp(A, 0, m) (no "
            "push away from negatives); negative_only = clamp(A, −m, 0); one_only = 1 where A > 0, else 0 (r = 1/2 + "
            "1/(2m) or 1/2); binary = sign(A).",
            "choices": ("all", "positive_only", "negative_only", "one_only", "binary"),
        },
    )
    old_policy: OldPolicy = field(
        default="current",
        metadata={
            "help": "π_old of v± and of the rollouts: current = θ at the start of the update (v_old = sg(v_θ) "
            "on-policy); soft = DiffusionNFT's old adapter, a copy of the trainable weights that samples the rollouts "
            "and is soft-updated once per iteration, θ_old ← d·θ_old + (1 − d)·θ, d = min(old_decay_rate·(k − "
            "old_decay_flat), old_decay_max) after k optimizer steps (0 before old_decay_flat) (ALGORITHMS.md §9.2).",
            "choices": ("current", "soft"),
        },
    )
    old_decay_rate: float = field(
        default=0.001,
        metadata={"help": "old_policy=soft: the decay's growth per optimizer step (DiffusionNFT GenEval "
                          "decay_type 1: 0.001; OCR decay_type 2: 0.0075).", "ge": 0},
    )
    old_decay_max: float = field(
        default=0.5,
        metadata={"help": "old_policy=soft: the decay's cap (GenEval 0.5; OCR 0.999).", "ge": 0, "lt": 1},
    )
    old_decay_flat: int = field(
        default=0,
        metadata={"help": "old_policy=soft: optimizer steps with decay 0 (π_old = θ after each iteration) before the "
                          "ramp starts (GenEval 0; OCR 75).", "ge": 0},
    )


def nft_optimality(adv: Tensor, m: float, adv_mode: str = "all") -> Tensor:
    """r = clamp(clamp(A', −m, m)/(2m) + 1/2, 0, 1) with A' the advantage after `adv_mode` (DiffusionNFT §3.2).

    The modes are those of NVlabs/DiffusionNFT `scripts/train_nft_sd3.py` (@ 24af555), applied after the clip to ±m:
    positive_only clamp(A, 0, m), negative_only clamp(A, −m, 0), one_only 1 where A > 0 else 0, binary sign(A).

    Args:
        adv: (n,) advantages. m: adv_clip_max. adv_mode: all | positive_only | negative_only | one_only | binary.

    Returns:
        (n,) fp32 optimality probabilities r ∈ [0, 1].
    """
    a = adv.float().clamp(-m, m)
    if adv_mode == "positive_only":
        a = a.clamp(0.0, m)
    elif adv_mode == "negative_only":
        a = a.clamp(-m, 0.0)
    elif adv_mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif adv_mode == "binary":
        a = torch.sign(a)
    elif adv_mode != "all":
        raise ValueError(
            f"objective.options.adv_mode: {adv_mode!r}; use all|positive_only|negative_only|one_only|binary"
        )
    return (a / m / 2.0 + 0.5).clamp(0.0, 1.0)


def nft_pair_loss(
    v: Tensor, v_old: Tensor, x_t: Tensor, t: Tensor, x0: Tensor, adv: Tensor, opts: NFTOptions
) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT's policy loss of n pairs (without the KL term).

    Args:
        v: (n, *latent) policy velocity v_θ(x_t, t) (with grad).
        v_old: (n, *latent) π_old's velocity (detached).
        x_t: (n, *latent) noised sample; t: (n,) times in (0, 1]; x0: (n, *latent) the clean sample.
        adv: (n,) advantages.
        opts: NFTOptions (β, m, adaptive weight).

    Returns:
        ((n,) fp32 losses, {"r": (n,), "fm_mse": (n,)} detached): r the optimality probability, fm_mse the plain
        mean_d (x̂0(v_θ) − x0)² of the pair.
    """
    v, v_old, x_t, x0 = v.float(), v_old.float().detach(), x_t.float(), x0.float()
    m, beta = opts.adv_clip_max, opts.beta
    r = nft_optimality(adv, m, opts.adv_mode)
    tb = t.float().view(-1, *([1] * (x0.dim() - 1)))
    v_pos = beta * v + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v
    dims = tuple(range(1, x0.dim()))
    err_pos = x_t - tb * v_pos - x0
    err_neg = x_t - tb * v_neg - x0
    if opts.adaptive_weight:
        w_pos = err_pos.detach().abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
        w_neg = err_neg.detach().abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
    else:
        w_pos = w_neg = torch.ones_like(tb)
    l_pos = (err_pos.pow(2) / w_pos).mean(dim=dims)
    l_neg = (err_neg.pow(2) / w_neg).mean(dim=dims)
    loss = m * (r * l_pos + (1.0 - r) * l_neg) / beta
    with torch.no_grad():
        fm = (x_t - tb * v - x0).pow(2).mean(dim=dims)
    return loss, {"r": r.detach(), "fm_mse": fm}


class NFTObjective:
    needs_log_probs: bool = False
    sum_keys: tuple[str, ...] = ("kl", "nft_r", "fm_mse", "old_deviate")
    max_keys: tuple[str, ...] = ()

    def __init__(self, options: NFTOptions, base_kl: bool = False):
        self.options = options
        if base_kl:  # optim.kl_base_beta > 0: the second KL term's statistic (the same keys on every rank)
            self.sum_keys = (*NFTObjective.sum_keys, "kl_base")
        self.fp = ForwardProcess(options.noise, options.crn, options.kl_fraction)
        self.shares_steps_in_group: bool = options.crn
        # optional Objective attribute (objectives/base.py): the trainer keeps a soft-updated π_old
        # (trainer/harness.SoftOldPolicy) that samples the rollouts and gives v_old (LossContext.old_policy)
        self.old_policy_decay: tuple[float, float, int] | None = (
            (options.old_decay_rate, options.old_decay_max, options.old_decay_flat)
            if options.old_policy == "soft" else None
        )

    def skip_zero_advantage(self, on_policy: bool, kl_beta: float) -> bool:
        # r = 1/2 gives zero gradient only at v_θ = v_old (on-policy, π_old = θ) and without a KL term
        return on_policy and kl_beta == 0 and self.old_policy_decay is None

    def trained_steps(self, traj: Trajectory, timestep_fraction: float) -> Tensor:
        return self.fp.trained_steps(traj, timestep_fraction)

    def prepare(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> int:
        return self.fp.prepare(ctx, pairs)

    def start_step(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> None:
        self.fp.start_step(ctx, pairs)  # the KL subset of this optimizer step (kl_fraction < 1)

    def loss(self, ctx: LossContext, bi: Tensor, ji: Tensor, adv: Tensor) -> LossOut:
        x_t, t, x0, _ = self.fp.noised(ctx, bi, ji)
        v = self.fp.velocity(ctx, ctx.model, x_t, t, bi)
        v_old = self.fp.old_velocity(ctx, v, bi, ji)
        loss, st = nft_pair_loss(v, v_old, x_t, t, x0, adv, self.options)
        pen, kl_sums, nfe = self.fp.kl_terms(ctx, v, x_t, t, bi, ji)
        loss = loss + pen
        sums = {
            **kl_sums,
            "nft_r": float(st["r"].sum()),
            "fm_mse": float(st["fm_mse"].sum()),
            "old_deviate": float((v.detach().float() - v_old.float()).pow(2).flatten(1).mean(1).sum()),
        }
        return LossOut(loss=loss, sums=sums, nfe=nfe)


register_objective(
    "nft", lambda o, cfg: NFTObjective(o, base_kl_enabled(cfg)), NFTOptions,
    "DiffusionNFT: implicit positive/negative velocities on the forward process of the model's samples "
    "(ODE rollouts).",
)
