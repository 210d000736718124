"""`awm`: Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050; ALGORITHMS.md §9.3).

The flow-matching loss of the model's own samples plays the log-likelihood of a policy gradient. For a pair
(b, j) with x_t, t, x0, ε from `forward.ForwardProcess` and the advantage A = A[b, j]:

    log p̃_θ = −w(t) · mean_d (v_θ(x_t, t) − (ε − x0))²           w(t) = 1 | t | t²   (`weighting`)
    ratio    = exp(log p̃_θ − log p̃_old)
    L        = max(−A·ratio, −A·clip(ratio, 1 − ε_c, 1 + ε_c)) + kl_beta·mean_d (v_θ − v_ref)²

ε_c = clip_range. On-policy ratio ≡ 1, so ∇L = A·w(t)·∇ mean_d (v_θ − u)²: positive advantages pull the velocity
toward the sample's flow-matching target, negative ones push it away; A = 0 gives zero loss and gradient.
Read from Flow-Factory `trainers/awm.py` (weighting names "Uniform", "t", "t**2"; KL in velocity space).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..types import Trajectory
from .base import LossContext, LossOut, register_objective
from .forward import ForwardProcess, NoiseMode, kl_fraction_field
from .grpo import clipped_surrogate


@dataclass
class AWMOptions:
    weighting: Literal["uniform", "t", "t2"] = field(
        default="uniform",
        metadata={"help": "w(t) of the matching log-likelihood: 1, t or t².", "choices": ("uniform", "t", "t2")},
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


def matching_log_prob(v: Tensor, target: Tensor, t: Tensor, weighting: str) -> Tensor:
    """(n,) −w(t)·mean_d (v − target)²: AWM's surrogate log-likelihood. v, target: (n, *latent); t: (n,)."""
    lp = -(v.float() - target.float()).pow(2).flatten(1).mean(1)
    if weighting == "t":
        lp = lp * t.float()
    elif weighting == "t2":
        lp = lp * t.float() ** 2
    return lp


class AWMObjective:
    needs_log_probs: bool = False
    sum_keys: tuple[str, ...] = ("kl", "clipfrac", "approx_kl", "ratio_mean", "fm_mse")
    max_keys: tuple[str, ...] = ()

    def __init__(self, options: AWMOptions):
        self.options = options
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
            self.old_lp[bi, ji] = matching_log_prob(self.fp.v_old[bi, ji], eps - x0, t, self.options.weighting).cpu()
        return nfe

    def start_step(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> None:
        self.fp.start_step(ctx, pairs)  # the KL subset of this optimizer step (kl_fraction < 1)

    def loss(self, ctx: LossContext, bi: Tensor, ji: Tensor, adv: Tensor) -> LossOut:
        x_t, t, x0, eps = self.fp.noised(ctx, bi, ji)
        v = self.fp.velocity(ctx, ctx.model, x_t, t, bi)
        lp = matching_log_prob(v, eps - x0, t, self.options.weighting)
        old = lp.detach() if self.old_lp is None else self.old_lp[bi, ji].to(lp.device)
        loss, st = clipped_surrogate(lp, old, adv, self.options.clip_range)
        kl, nfe = self.fp.velocity_kl(ctx, v, x_t, t, bi, ji)
        loss = loss + ctx.kl_beta * kl
        n = len(bi)
        sums = {k: float(val) * n for k, val in st.items()}
        sums["kl"] = float(kl.detach().sum())
        sums["fm_mse"] = float((v.detach().float() - (eps - x0).float()).pow(2).flatten(1).mean(1).sum())
        return LossOut(loss=loss, sums=sums, nfe=nfe)


register_objective(
    "awm", lambda o, cfg: AWMObjective(o), AWMOptions,
    "Advantage Weighted Matching: PPO-clip with the flow-matching loss of the model's samples as log-likelihood.",
)
