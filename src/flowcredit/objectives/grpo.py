"""`grpo`: the PPO-clipped policy gradient on SDE step log-probs with a Gaussian KL to π_ref (Flow-GRPO §3).

Per pair (b, j) (ALGORITHMS.md §3.1–3.2):

    v      = policy_velocity(θ, x^(j), t_j)                      the SAME function as the rollout
    logp   = sampler_step(x^(j) → x^(j+1), v).log_prob           the SAME step function
    ratio  = exp(logp − logp_old)
    loss   = max(−A·ratio, −A·clip(ratio, 1 − ε, 1 + ε)) + β·KL(π_θ ‖ π_ref)

On-policy (one pass, one optimizer step) θ_old = θ, so logp_old = logp.detach() and the ratio is exactly 1; the
rollout's recorded log-probs are compared with the recomputed ones (`parity_max_abs_dlogp`). ε = optim.clip_range,
β = optim.kl_beta (kept in `optim` because every preset of the field names them there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..samplers.policy import nfe_per_sample, policy_velocity
from ..samplers.sde import gaussian_kl_same_std, sampler_step
from ..types import Trajectory, cond_index
from .base import LossContext, LossOut, register_objective


def clipped_surrogate(
    log_prob: Tensor,
    old_log_prob: Tensor,
    adv: Tensor,
    clip_range: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate as a loss to minimise (Flow-GRPO Eq. 6 / official code, ALGORITHMS.md §3.1–3.2).

        ratio = exp(log_prob − old_log_prob)
        loss  = max(−A·ratio, −A·clip(ratio, 1 − ε, 1 + ε))

    Stats (detached 0-dim fp32 tensors, no host sync): "ratio_mean"; "clipfrac" = mean(|ratio − 1| > ε);
    "approx_kl" = mean((ratio − 1) − log ratio) (the non-negative k3 estimator of KL(π_old ‖ π_θ)).

    Args:
        log_prob: (B,) log π_θ of the recorded transitions (with grad).
        old_log_prob: (B,) log π_old recorded at rollout.
        adv: (B,) advantages (already clipped by the caller if desired).
        clip_range: ε > 0 (Flow-GRPO: 1e-4 with mean-reduced log-probs).

    Returns:
        (loss (B,) fp32, stats dict).
    """
    log_prob, old_log_prob, adv = log_prob.float(), old_log_prob.float(), adv.float()
    if not log_prob.shape == old_log_prob.shape == adv.shape:
        raise ValueError(
            f"log_prob, old_log_prob and adv must share one (B,) shape, got {tuple(log_prob.shape)}, "
            f"{tuple(old_log_prob.shape)}, {tuple(adv.shape)}."
        )
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        stats = {
            "ratio_mean": ratio.mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "approx_kl": ((ratio - 1.0) - log_ratio).mean(),
        }
    return loss, stats


@dataclass
class GRPOOptions:
    """`grpo` has no options of its own: ε is optim.clip_range and β is optim.kl_beta."""


class GRPOObjective:
    needs_log_probs: bool = True
    sum_keys: tuple[str, ...] = ("kl", "clipfrac", "approx_kl", "ratio_mean")
    max_keys: tuple[str, ...] = ("parity_max_abs_dlogp",)

    def __init__(self, options: GRPOOptions, clip_range: float = 1e-4):
        self.options = options
        self.clip_range = clip_range
        self.ref_means: Tensor | None = None

    def skip_zero_advantage(self, on_policy: bool, kl_beta: float) -> bool:
        return kl_beta == 0  # the surrogate of an A = 0 pair is 0 whatever the ratio

    def trained_steps(self, traj: Trajectory, timestep_fraction: float) -> Tensor:
        return traj.step_mask  # the rollout's: inside timestep_fraction and σ > 0

    def prepare(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> int:
        self.ref_means = None
        if ctx.kl_beta > 0 and ctx.ref_offload is not None and ctx.ref_offload.enabled:
            # optim.offload_reference: one reference pass, then park it
            self.ref_means, nfe = ctx.ref_offload.step_means(
                ctx.traj, pairs, ctx.cond, ctx.uncond, ctx.params, ctx.guidance, ctx.micro_batch
            )
            return nfe
        return 0

    def loss(self, ctx: LossContext, bi: Tensor, ji: Tensor, adv: Tensor) -> LossOut:
        traj, params = ctx.traj, ctx.params
        x_t, x_next = traj.latents[bi, ji], traj.latents[bi, ji + 1]
        t, t_next = traj.timesteps[ji], traj.timesteps[ji + 1]
        c = cond_index(ctx.cond, bi)
        u = cond_index(ctx.uncond, bi) if ctx.uncond is not None else None
        v = policy_velocity(ctx.model, x_t, t, c, u, ctx.guidance)
        step = sampler_step(params, x_t, v, t, t_next, x_next=x_next)
        rollout_lp = traj.log_probs[bi, ji]
        old_lp = step.log_prob.detach() if ctx.on_policy else rollout_lp
        loss, st = clipped_surrogate(step.log_prob, old_lp, adv, self.clip_range)
        kl = torch.zeros_like(loss)
        nfe = 0
        if ctx.kl_beta > 0 and self.ref_means is not None:
            kl = gaussian_kl_same_std(step.mean, self.ref_means[bi, ji], step.kl_std, params.reduce)
            loss = loss + ctx.kl_beta * kl
        elif ctx.kl_beta > 0:
            with torch.no_grad(), ctx.reference() as ref_model:
                v_ref = policy_velocity(ref_model, x_t, t, c, u, ctx.guidance)
                ref = sampler_step(params, x_t, v_ref, t, t_next, x_next=x_next)
            kl = gaussian_kl_same_std(step.mean, ref.mean, step.kl_std, params.reduce)
            loss = loss + ctx.kl_beta * kl
            nfe = len(bi) * nfe_per_sample(ctx.uncond, ctx.guidance)
        n = len(bi)
        sums = {k: float(val) * n for k, val in st.items()}
        sums["kl"] = float(kl.detach().sum())
        maxes = {"parity_max_abs_dlogp": float((step.log_prob.detach() - rollout_lp).abs().max())}
        return LossOut(loss=loss, sums=sums, maxes=maxes, nfe=nfe)


register_objective(
    "grpo", lambda o, cfg: GRPOObjective(o, clip_range=cfg.optim.clip_range if cfg is not None else 1e-4), GRPOOptions,
    "PPO-clip on the SDE step log-probs + Gaussian KL to π_ref (Flow-GRPO §3); needs an SDE rollout.",
    requires=("log_probs",),
)
