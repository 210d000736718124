"""PPO clipped surrogate and Gaussian KL penalty (pure functions).

Notation: see ``flowcredit.types`` (B batch, *latent the latent shape without batch). Here B counts the
(sample, step) pairs of one loss evaluation: log-probs of one step for a batch of trajectories.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowcredit.samplers.sde import gaussian_kl_same_std


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


def kl_penalty(mean: Tensor, mean_ref: Tensor, kl_std: Tensor, reduce: str = "mean") -> Tensor:
    """Per-sample KL(π_θ ‖ π_ref) between same-std Gaussian steps (ALGORITHMS.md §2.3, §3.1; code scaling A16).

    Thin wrapper over ``samplers.sde.gaussian_kl_same_std``: reduce_d (mean − mean_ref)² / (2·kl_std²), 0 where
    kl_std == 0. Use the ``kl_std`` returned by the step function (``StepOutput.kl_std``).

    Args:
        mean: (B, *latent) policy step mean.
        mean_ref: (B, *latent) reference-policy step mean (same x_t, t).
        kl_std: (B,) std the KL is scaled with.
        reduce: "mean" (Flow-GRPO code) or "sum" over latent dims.

    Returns:
        (B,) fp32 KL values.
    """
    return gaussian_kl_same_std(mean, mean_ref, kl_std, reduce)
