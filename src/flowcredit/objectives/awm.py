"""`awm`: Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050; ALGORITHMS.md §9.3).

The flow-matching loss of the model's own samples plays the log-likelihood of a policy gradient. For a pair
(b, j) with x_t, t, x0, ε from `forward.ForwardProcess` and the advantage A = A[b, j]:

    ℓ        = mean_d (v_θ(x_t, t) − (ε − x0))²
    log p̃_θ = −w(t)·ℓ  (uniform | t | t2: w = 1, t, t²);  −t·(√(ℓ + 1e-10) − 1e-5)  (huber);
               −t·((ℓ + 1e-10)^p − 1e-10^p) / p  (ghuber, p = ghuber_power)                       (`weighting`)
    Â        = clamp(A, −m, m) / m · a_max        (adv_clip_max = m > 0, advantage_max = a_max > 0; else A)
    ratio    = exp(log p̃_θ − log p̃_old)
    L        = max(−Â·ratio, −Â·clip(ratio, 1 − ε_c, 1 + ε_c)) + kl_beta·mean_d (v_θ − v_ref)²
               [+ kl_base_beta·mean_d (v_θ − v_base)²]   (optim.kl_base_beta > 0: the base model beside the EMA)

ε_c = clip_range. On-policy ratio ≡ 1, so ∇L = −Â·∇ log p̃_θ (uniform: Â·∇ℓ): positive advantages pull the velocity
toward the sample's flow-matching target, negative ones push it away; A = 0 gives zero loss and gradient.
The weightings and the advantage scaling are those of the AWM authors' code, scxue/advantage_weighted_matching
`advantage_weighted_matching/scripts/train_sd3_awm.py` @ be51372 (`compute_log_prob_awm`: "Uniform", "t", "t**2",
"huber", "ghuber"; `advantage_max`), whose released GenEval recipe (`config/dgx_awm.py: geneval_sd3_no_cfg_1node`)
is ghuber with p = 0.25, Â = A/5 (m = 5, a_max = 1), clip_range 1, a KL of weight 1 to an EMA of the policy and
one of weight 1e-3 to the base model (optim.kl_base_beta), its times drawn by sampler.train_step_draw=awm (preset
sd35m_awm_official; ALGORITHMS.md §9.3). Flow-Factory `trainers/awm.py` has the same first three weightings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..types import Trajectory
from .base import LossContext, LossOut, register_objective
from .forward import ForwardProcess, NoiseMode, base_kl_enabled, kl_fraction_field
from .grpo import clipped_surrogate

Weighting = Literal["uniform", "t", "t2", "huber", "ghuber"]


@dataclass
class AWMOptions:
    weighting: Weighting = field(
        default="uniform",
        metadata={
            "help": "The matching log-likelihood log p̃ of ℓ = mean_d (v − (ε − x0))²: uniform −ℓ, t −t·ℓ, t2 −t²·ℓ, "
            "huber −t·(√(ℓ + 1e-10) − 1e-5), ghuber −t·((ℓ + 1e-10)^p − 1e-10^p)/p with p = ghuber_power (AWM's "
            "released recipe: ghuber, p = 0.25; train_sd3_awm.py `compute_log_prob_awm`).",
            "choices": ("uniform", "t", "t2", "huber", "ghuber"),
        },
    )
    ghuber_power: float = field(
        default=0.25,
        metadata={"help": "p of weighting=ghuber (AWM `train.ghuber_power`, 0.25 in the released configs).", "gt": 0},
    )
    adv_clip_max: float = field(
        default=0.0,
        metadata={
            "help": "m > 0: advantages are clipped to ±m in the loss (AWM `train.adv_clip_max`, 5); 0 = not clipped "
            "here (credit.adv_clip still applies).",
            "ge": 0,
        },
    )
    advantage_max: float = field(
        default=0.0,
        metadata={
            "help": "a > 0: the clipped advantages are rescaled to ±a, Â = clamp(A, ±m)/m·a (AWM "
            "`train.advantage_max`; the released recipe: 1 with m = 5, i.e. A/5); 0 = not rescaled. Needs "
            "adv_clip_max > 0.",
            "ge": 0,
        },
    )
    clip_range: float = field(
        default=1e-4, metadata={"help": "PPO ratio clip ε_c of the matching log-likelihood ratio.", "gt": 0}
    )
    noise: NoiseMode = field(
        default="fresh",
        metadata={
            "help": "fresh ε per pair, or the rollout's own state x^(j) as x_t.",
            "choices": ("fresh", "rollout"),
        },
    )
    kl_fraction: float = kl_fraction_field()

    def __post_init__(self) -> None:
        if self.advantage_max > 0 and self.adv_clip_max <= 0:
            raise ValueError(
                f"objective.options.advantage_max={self.advantage_max} rescales clamp(A, ±adv_clip_max)/adv_clip_max, "
                "but objective.options.adv_clip_max=0; set adv_clip_max > 0 (AWM's recipe: 5) or advantage_max=0"
            )


def matching_log_prob(v: Tensor, target: Tensor, t: Tensor, weighting: str, power: float = 0.25) -> Tensor:
    """(n,) AWM's surrogate log-likelihood of ℓ = mean_d (v − target)² (module docstring; `power`: ghuber's p).

    v, target: (n, *latent); t: (n,). huber and ghuber are evaluated in float64 as the AWM code does (their constant
    1e-10^p matters next to small ℓ) and returned in fp32.
    """
    lp = -(v.float() - target.float()).pow(2).flatten(1).mean(1)
    if weighting == "t":
        lp = lp * t.float()
    elif weighting == "t2":
        lp = lp * t.float() ** 2
    elif weighting == "huber":
        lp = (-(torch.sqrt(-lp.double() + 1e-10) - 1e-5) * t.double()).float()
    elif weighting == "ghuber":
        lp = (-((-lp.double() + 1e-10) ** power - 1e-10**power) * t.double() / power).float()
    elif weighting != "uniform":
        raise ValueError(f"objective.options.weighting: {weighting!r}; use uniform|t|t2|huber|ghuber")
    return lp


def awm_advantages(adv: Tensor, adv_clip_max: float = 0.0, advantage_max: float = 0.0) -> Tensor:
    """(n,) the advantages the AWM loss uses: clamp(A, ±m) with m = adv_clip_max > 0, then ·a/m with
    a = advantage_max > 0 (AWM's released recipe: m = 5, a = 1, i.e. A/5); A unchanged when both are 0."""
    if adv_clip_max > 0:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
        if advantage_max > 0:
            adv = adv / adv_clip_max * advantage_max
    return adv


class AWMObjective:
    needs_log_probs: bool = False
    sum_keys: tuple[str, ...] = ("kl", "clipfrac", "approx_kl", "ratio_mean", "fm_mse")
    max_keys: tuple[str, ...] = ()

    def __init__(self, options: AWMOptions, base_kl: bool = False):
        self.options = options
        if base_kl:  # optim.kl_base_beta > 0: the second KL term's statistic (the same keys on every rank)
            self.sum_keys = (*AWMObjective.sum_keys, "kl_base")
        self.fp = ForwardProcess(options.noise, kl_fraction=options.kl_fraction)
        self.old_lp: Tensor | None = None

    def skip_zero_advantage(self, on_policy: bool, kl_beta: float) -> bool:
        return kl_beta == 0  # −A·ratio = 0 at A = 0 whatever the ratio

    def trained_steps(self, traj: Trajectory, timestep_fraction: float) -> Tensor:
        return self.fp.trained_steps(traj, timestep_fraction)

    def prepare(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> int:
        nfe = self.fp.prepare(ctx, pairs)
        self.old_lp = None
        if self.fp.v_old is not None:  # off-policy: log p̃_old from θ at the start of the update
            self.old_lp = torch.zeros(ctx.traj.latents.shape[0], ctx.traj.num_steps)
            uniq = sorted(set(pairs))
            bi = torch.tensor([p[0] for p in uniq])
            ji = torch.tensor([p[1] for p in uniq])
            _, t, x0, eps = self.fp.noised(ctx, bi, ji)
            self.old_lp[bi, ji] = matching_log_prob(self.fp.v_old[bi, ji], eps - x0, t, self.options.weighting,
                                                    self.options.ghuber_power).cpu()
        return nfe

    def start_step(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> None:
        self.fp.start_step(ctx, pairs)  # the KL subset of this optimizer step (kl_fraction < 1)

    def loss(self, ctx: LossContext, bi: Tensor, ji: Tensor, adv: Tensor) -> LossOut:
        x_t, t, x0, eps = self.fp.noised(ctx, bi, ji)
        v = self.fp.velocity(ctx, ctx.model, x_t, t, bi)
        o = self.options
        lp = matching_log_prob(v, eps - x0, t, o.weighting, o.ghuber_power)
        old = lp.detach() if self.old_lp is None else self.old_lp[bi, ji].to(lp.device)
        adv = awm_advantages(adv, o.adv_clip_max, o.advantage_max)
        loss, st = clipped_surrogate(lp, old, adv, o.clip_range)
        pen, kl_sums, nfe = self.fp.kl_terms(ctx, v, x_t, t, bi, ji)
        loss = loss + pen
        n = len(bi)
        sums = {k: float(val) * n for k, val in st.items()}
        sums.update(kl_sums)
        sums["fm_mse"] = float((v.detach().float() - (eps - x0).float()).pow(2).flatten(1).mean(1).sum())
        return LossOut(loss=loss, sums=sums, nfe=nfe)


register_objective(
    "awm", lambda o, cfg: AWMObjective(o, base_kl_enabled(cfg)), AWMOptions,
    "Advantage Weighted Matching: PPO-clip with the flow-matching loss of the model's samples as log-likelihood.",
)
