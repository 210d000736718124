"""VGPO credit: TCRM values and weights + ADAE absolute anchor (ALGORITHMS.md §5.2–5.5, arXiv 2512.12387).

    I_j   instant reward of step j: reward of the one-step Tweedie estimate of x^(j+1)       (§5.2, Eq. 9)
    Q_j = Σ_{m ≥ j} γ^{m−j} I_m                   discounted reward-to-go, sampling order       (§5.3, Eq. 10) [G]
    ω_j = Q_j / max(mean_t Q_t, ε)                per-trajectory timestep weight, mean_t ω = 1   (§5.4, Eq. 11)
    z_j = (Q_j − μ_j) / (σ_j + ε)                 per-step group z-score of Q (A12), 0 if σ_j = 0
    Â_j = ω_j · (z_j + k·Q_j·1[j < K])            ADAE, ``adae_norm="plus"``                      (§5.5, Eq. 13) [G]
    Â_j = ω_j · (z_j + k·Q_j·1[j < K]) / (1 + k·1[j < K])       ``adae_norm="one_plus_k"``

Options: ``VGPOOptions`` (credit.options of vgpo; credit.anchor_options of the ADAE anchor on another estimator).

Limit (VGPO App. B claim): when a group's Q at step j has no spread (σ_j → 0), z_j → 0 and Â_j → ω_j·k·Q_j (or
ω_j·k·Q_j/(1+k)) on the anchored steps, instead of vanishing like Flow-GRPO's advantage.

Instant rewards are first made non-negative (A14): with ``reward_shift="min"`` the batch minimum is subtracted
when any I_j < 0, so Q ≥ 0 and ω ≥ 0 (a negative mean_t Q would flip the sign of ω, a zero one would blow it up).
The shift is constant across a step's group, so z is unchanged; only the absolute term k·Q sees it.

Notation: B batch, P groups, T steps (see ``flowcredit.credit.base``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from flowcredit.config.build import check_values
from flowcredit.credit.base import (
    CreditCfg,
    CreditInput,
    CreditOutput,
    compute_dtype,
    discounted_reverse_cumsum,
    group_index,
    group_moments,
    safe_zscore,
)
from flowcredit.credit.group import reward_stats

TCRMOut = tuple[Tensor, Tensor, dict[str, "float | list[float]"]]  # Q (B, T), ω (B, T), stats


@dataclass
class VGPOOptions:
    """`credit.options` of vgpo, and `credit.anchor_options` of the ADAE anchor on another estimator (§5.2–5.5):
    TCRM (instant rewards → Q → ω) and ADAE (the absolute anchor k·Q on the first K steps)."""

    gamma: float = field(
        default=0.9,
        metadata={
            "help": "TCRM discount γ of the reward-to-go Q_j = Σ_{m≥j} γ^{m−j} I_m (§5.3, A11; γ unknown, 0.9–1.0 "
            "suggested).",
            "ge": 0,
            "le": 1,
        },
    )
    weights: bool = field(
        default=True,
        metadata={"help": "TCRM timestep weights ω_j = Q_j / mean_t Q_t per trajectory (§5.4, Eq. 11); off ⇒ ω = 1."},
    )
    weights_degenerate: Literal["zero", "uniform"] = field(
        default="zero",
        metadata={
            "help": "ω of a trajectory whose Q is all 0 (none of its x̂0 estimates scored; common under a binary "
            "reward): 'zero' = the A14 guard, no advantage at all for it; 'uniform' = ω 1, it keeps its relative "
            "(e.g. negative) advantage."
        },
    )
    reward_shift: Literal["min", "none"] = field(
        default="min",
        metadata={
            "help": "Make instant rewards non-negative before Q and ω (A14): 'min' subtracts the batch minimum when "
            "any instant reward is negative; 'none' requires rewards ≥ 0 (error otherwise, when ω is on)."
        },
    )
    adae_k: float = field(
        default=0.1,
        metadata={
            "help": "ADAE absolute-anchor weight k in Â = ω·(z + k·Q) (§5.5, A13; tuned, Q is O(T·R)); 0 switches the "
            "anchor off.",
            "ge": 0,
        },
    )
    adae_steps: int = field(
        default=5,
        metadata={
            "help": "The absolute anchor k·Q acts only on the first K sampling steps j < K (VGPO App. A.2: first 5 "
            "steps); -1 = all steps.",
            "ge": -1,
        },
    )
    adae_norm: Literal["plus", "one_plus_k"] = field(
        default="plus",
        metadata={
            "help": "ADAE form where the anchor acts: 'plus' = ω·(z + k·Q); 'one_plus_k' = ω·(z + k·Q)/(1+k), i.e. (Q "
            "− μ + αQ)/(σ + α) with α = kσ (§5.5 alternative)."
        },
    )

    def __post_init__(self) -> None:
        check_values(self, "credit.options")


def instant_rewards_of(inp: CreditInput) -> Tensor:
    """The instant rewards I (B, T): ``inp.instant_rewards``, else ``inp.step_rewards[:, 1:]`` (§5.2).

    ρ_{j+1} is the reward of the T′-substep x̂0 estimate of the post-action state x^(j+1); with T′ = 1 it is
    exactly VGPO's I_j, otherwise a less noisy estimate of the same quantity.

    Raises:
        ValueError: when neither is available.
    """
    if inp.instant_rewards is not None:
        return inp.instant_rewards
    if inp.step_rewards is not None:
        return inp.step_rewards[:, 1:]
    raise ValueError("VGPO / the ADAE anchor need CreditInput.instant_rewards (B, T): rewards of the one-step Tweedie "
                     "estimates of x^(1) … x^(T) (ALGORITHMS.md §5.2), or step_rewards (B, T+1).")


def shift_nonnegative(instant_rewards: Tensor, mode: str) -> tuple[Tensor, float]:
    """Make instant rewards non-negative for Q and ω (A14).

    Args:
        instant_rewards: (B, T) I.
        mode: ``"min"``: subtract the batch minimum when it is negative (otherwise unchanged); ``"none"``: unchanged.

    Returns:
        (B, T) shifted rewards and the shift that was subtracted (≤ 0 means added; 0.0 when unchanged).
    """
    if mode == "none":
        return instant_rewards, 0.0
    if mode != "min":
        raise ValueError(f"reward_shift must be 'min' or 'none'; got {mode!r}.")
    low = instant_rewards.min()
    if low < 0:
        return instant_rewards - low, float(low)
    return instant_rewards, 0.0


def discounted_value(instant_rewards: Tensor, gamma: float) -> Tensor:
    """TCRM cumulative value Q_j = Σ_{m=j}^{T−1} γ^{m−j} I_m (§5.3, Eq. 10 in sampling order, A11).

    γ = 0 gives Q = I; γ = 1 gives the undiscounted reward-to-go.

    Args:
        instant_rewards: (B, T) I.
        gamma: γ in [0, 1].

    Returns:
        (B, T) Q.
    """
    return discounted_reverse_cumsum(instant_rewards, gamma)


def timestep_weights(value: Tensor, eps: float, degenerate: str = "zero") -> Tensor:
    """TCRM timestep weights ω_j = Q_j / max(mean_t Q_t, ε) per trajectory (§5.4, Eq. 11, A14).

    For Q ≥ 0 the weights are finite, non-negative and average to 1 over the T steps. A trajectory whose Q is all
    0 (mean_t Q < ε: none of its intermediate estimates scored) has no defined weights: ``degenerate="zero"`` gives
    it ω = 0 (so it gets no advantage at all, e.g. no negative signal for a failing sample under a binary reward),
    ``"uniform"`` gives it ω = 1 (it keeps its relative advantage).

    Args:
        value: (B, T) Q.
        eps: ε floor of the denominator.
        degenerate: "zero" | "uniform", the ω of all-zero trajectories.

    Returns:
        (B, T) ω.
    """
    mean = value.mean(1, keepdim=True)  # (B, 1)
    omega = value / mean.clamp_min(eps)
    if degenerate == "uniform":
        return torch.where(mean < eps, torch.ones_like(omega), omega)
    if degenerate != "zero":
        raise ValueError(f"weights_degenerate: unknown value '{degenerate}'; use 'zero' or 'uniform'")
    return omega


def group_step_zscore(value: Tensor, group_ids: Tensor, eps: float) -> Tensor:
    """Per-step group z-score of Q (§5.5, A12): z_ij = (Q_ij − μ_gj) / (σ_gj + ε), population σ over the group's
    N trajectories at step j; exactly 0 where the group's Q at step j is constant.

    Args:
        value: (B, T) Q.
        group_ids: (B,) int64.
        eps: ε.

    Returns:
        (B, T) z.
    """
    inverse, num_groups = group_index(group_ids)
    mom = group_moments(value, inverse, num_groups)  # (P, T)
    return safe_zscore(value, mom.mean[inverse], mom.std[inverse], mom.constant[inverse], eps)


def adae_step_mask(num_steps: int, adae_steps: int, device: torch.device | None = None) -> Tensor:
    """(T,) bool, True on the first K sampling steps j < K where the absolute anchor acts; K = -1 → all steps."""
    steps = torch.arange(num_steps, device=device)
    return torch.ones_like(steps, dtype=torch.bool) if adae_steps < 0 else steps < adae_steps


def adae_anchor(relative: Tensor, value: Tensor, omega: Tensor, opts: VGPOOptions) -> Tensor:
    """ADAE: add the absolute, value-anchored term to a relative advantage (§5.5, Eqs. 12–13 [G]).

        Â_j = ω_j · (A_rel,j + k·Q_j·1[j < K]) / d_j,   d_j = 1 (``plus``) or 1 + k·1[j < K] (``one_plus_k``)

    With A_rel = z (the group z-score of Q) this is VGPO's ADAE; any other relative estimator (e.g. stepwise
    gains) can be anchored the same way. Limit: when the group has no spread, A_rel → 0 and
    Â_j → ω_j·k·Q_j / d_j on the anchored steps (0 after them), so the signal does not vanish (VGPO App. B).
    ``one_plus_k`` is (Q − μ + αQ)/(σ + α) with α = kσ; after the first K steps α = 0, hence d_j = 1 there.

    Args:
        relative: (B, T) relative advantage A_rel.
        value: (B, T) Q (non-negative after ``shift_nonnegative``).
        omega: (B, T) ω (all ones when weights are off).
        opts: uses ``adae_k``, ``adae_steps``, ``adae_norm``.

    Returns:
        (B, T) anchored advantages.
    """
    anchored = adae_step_mask(relative.shape[1], opts.adae_steps, relative.device).to(relative.dtype)[None, :]  # (1,T)
    absolute = opts.adae_k * value * anchored
    denom = 1.0 + opts.adae_k * anchored if opts.adae_norm == "one_plus_k" else torch.ones_like(anchored)
    return omega * (relative + absolute) / denom


def tcrm(inp: CreditInput, opts: VGPOOptions, eps: float = 1e-4) -> TCRMOut:
    """TCRM (§5.2–5.4): instant rewards → non-negative shift → Q → ω.

    Args:
        inp: uses ``instant_rewards`` (or ``step_rewards[:, 1:]``), ``group_ids``.
        opts: uses ``reward_shift``, ``gamma``, ``weights``, ``weights_degenerate``.
        eps: ε floor of mean_t Q (credit.eps).

    Returns:
        Q (B, T), ω (B, T) (ones when ``opts.weights`` is False), and stats ``reward_shift``, ``q_mean``,
        ``q_zero_std_frac`` (fraction of (group, step) cells whose Q has no spread), ``omega_per_step`` (list).

    Raises:
        ValueError: ``reward_shift="none"`` with weights on and a negative instant reward (ω would be ill-defined).
    """
    inst = instant_rewards_of(inp)
    inst = inst.to(compute_dtype(inst))
    inst, shift = shift_nonnegative(inst, opts.reward_shift)
    if opts.weights and bool((inst < 0).any()):
        raise ValueError("VGPO timestep weights ω = Q / mean_t Q need non-negative instant rewards (A14); got a "
                         f"minimum of {float(inst.min()):.4g} with reward_shift='none'. Use reward_shift='min', shift "
                         "the reward itself, or set weights=False.")
    value = discounted_value(inst, opts.gamma)  # (B, T)
    if opts.weights:
        omega = timestep_weights(value, eps, opts.weights_degenerate)
    else:
        omega = torch.ones_like(value)
    inverse, num_groups = group_index(inp.group_ids)
    stats: dict[str, float | list[float]] = {
        "reward_shift": shift,
        "q_mean": float(value.mean()),
        "q_zero_std_frac": float(group_moments(value, inverse, num_groups).constant.float().mean()),
        "omega_per_step": omega.mean(0).tolist(),
    }
    return value, omega, stats


def anchor_stats(relative: Tensor, value: Tensor, omega: Tensor, opts: VGPOOptions, step_mask: Tensor | None) -> float:
    """abs_share: Σ|absolute term| / (Σ|relative term| + Σ|absolute term|) of the ADAE output over trained steps.

    Args:
        relative, value, omega: (B, T) as in ``adae_anchor``.
        opts: as in ``adae_anchor``.
        step_mask: (T,) bool or None (all steps).

    Returns:
        Share in [0, 1] of the advantage mass coming from ω·k·Q (0 when both terms are 0).
    """
    zeros = torch.zeros_like(relative)
    absolute = adae_anchor(zeros, value, omega, opts).abs()
    rel = adae_anchor(relative, zeros, omega, opts).abs()
    if step_mask is not None:
        keep = step_mask.to(device=relative.device, dtype=relative.dtype)[None, :]
        absolute, rel = absolute * keep, rel * keep
    total = float(absolute.sum() + rel.sum())
    return float(absolute.sum()) / total if total > 0 else 0.0


def apply_adae_anchor(
    relative: Tensor, inp: CreditInput, opts: VGPOOptions, cfg: CreditCfg, tcrm_out: TCRMOut | None = None
) -> tuple[Tensor, dict[str, float | list[float]]]:
    """Compose the ADAE anchor on top of any relative advantage, with Q and ω from TCRM (used by ``vgpo`` and, as
    the registered anchor ``adae``, by ``registry.assign_credit`` when ``credit.anchor=adae``).

    Args:
        relative: (B, T) relative advantage of some estimator.
        inp: CreditInput with instant rewards (or step rewards).
        opts: TCRM/ADAE options.
        cfg: uses ``eps``, ``mask_stats``.
        tcrm_out: the result of ``tcrm(inp, opts, cfg.eps)`` when already computed.

    Returns:
        (B, T) anchored advantages and the TCRM stats plus ``abs_share``.
    """
    value, omega, stats = tcrm(inp, opts, cfg.eps) if tcrm_out is None else tcrm_out
    stats = dict(stats)
    relative = relative.to(value.dtype)
    stats["abs_share"] = anchor_stats(relative, value, omega, opts, inp.step_mask if cfg.mask_stats else None)
    return adae_anchor(relative, value, omega, opts), stats


def vgpo_advantages(inp: CreditInput, opts: VGPOOptions, cfg: CreditCfg) -> CreditOutput:
    """VGPO estimator (§5): Â = ω·(z + k·Q·1[j < K]) with z the per-step group z-score of Q.

    ``adae_k = 0`` gives TCRM alone (ω·z); ``weights=False`` drops ω. See the module docstring for the
    σ → 0 limit (Â → ω·k·Q on the anchored steps).

    Args:
        inp: uses ``instant_rewards`` (B, T) (or ``step_rewards[:, 1:]``), ``group_ids``, ``rewards`` (stats only).
        opts: VGPOOptions (``gamma``, ``weights``, ``weights_degenerate``, ``reward_shift``, ``adae_*``).
        cfg: uses ``eps``, ``mask_stats``.

    Returns:
        CreditOutput with advantages (B, T) and stats: reward stats, TCRM stats, ``abs_share``.
    """
    tcrm_out = tcrm(inp, opts, cfg.eps)
    z = group_step_zscore(tcrm_out[0], inp.group_ids, cfg.eps)  # (B, T)
    adv, stats = apply_adae_anchor(z, inp, opts, cfg, tcrm_out)
    return CreditOutput(advantages=adv, stats={**reward_stats(inp.rewards, inp.group_ids), **stats})
