"""Stepwise-Flow-GRPO credit: per-step reward gains (ALGORITHMS.md §4.2–4.6, arXiv 2603.28718).

    g_j = ρ_{j+1} − ρ_j,   j = 0 … T−1          (gain of step x^(j) → x^(j+1); A6 alignment)
    Σ_j g_j = ρ_T − ρ_0                          (telescoping, §4.2)
    Ã = (g − μ) / (σ + ε)                        (joint normalization over a group's N·T gains, paper Eq. 5)

Variants (§4.3 ablation, §4.6 variants that lost to the plain gain; formulas are best guesses [G]):
    ``per_step``  μ, σ per group and step, over the N trajectories (Fig. 9);
    ``global``    μ per group (joint), σ over every gain of the batch (A5, Flow-GRPO ``global_std`` style);
    ``per_step_mean``  μ per group and step, σ per group over its N·T centred gains (ours [R], §9.1);
    ``ema``       μ replaced by a per-step baseline b_j ← λ·b_j + (1−λ)·mean_batch g_j kept across iterations;
    ``use_gae``   g replaced by A_j = Σ_{l≥0} (γλ)^l g_{j+l} (value ≡ 0), so γ = λ = 1 gives ρ_T − ρ_j.

Notation: B batch, P groups, T steps, ρ (B, T+1) step rewards (see ``flowcredit.credit.base``).
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

EMA_STATE_KEY = "stepwise_ema_baseline"


@dataclass
class StepwiseOptions:
    """`credit.options` of stepwise (ALGORITHMS.md §4.2–4.6)."""

    norm: Literal["joint", "per_step", "global", "per_step_mean"] = field(
        default="joint",
        metadata={
            "help": "Gain normalization: 'joint' = per-group mean/std over the group's N·T gains (paper Eq. 5); "
            "'per_step' = per-group mean/std at each step over N trajectories (ablation, Fig. 9); 'global' = "
            "per-group joint mean, batch-wide std of all gains (A5); 'per_step_mean' = per-group mean at each step, "
            "one std per group over its N·T centred gains (ours, §9.1: no net pull per step, and steps with small "
            "spread keep small advantages)."
        },
    )
    baseline: Literal["none", "ema"] = field(
        default="none",
        metadata={
            "help": "'ema' replaces the group mean by a per-step EMA baseline b_j kept across iterations (§4.6 "
            "variant, lost to the plain gain in the paper); the std is unchanged."
        },
    )
    ema_decay: float = field(
        default=0.9,
        metadata={"help": "EMA baseline decay λ: b_j ← λ·b_j + (1−λ)·mean_batch g_j (§4.6).", "ge": 0, "le": 1},
    )
    use_gae: bool = field(
        default=False,
        metadata={
            "help": "Replace each gain by GAE over the gain sequence, A_j = Σ_{l≥0} (γλ)^l g_{j+l} (value ≡ 0, §4.6 "
            "variant), before normalization."
        },
    )
    gae_gamma: float = field(
        default=1.0, metadata={"help": "GAE discount γ over later denoising steps (use_gae).", "ge": 0, "le": 1}
    )
    gae_lambda: float = field(
        default=0.95,
        metadata={"help": "GAE λ (use_gae); γ = λ = 1 gives the reward-to-go ρ_T − ρ_j.", "ge": 0, "le": 1},
    )

    states: Literal["all", "drawn"] = field(
        default="all",
        metadata={
            "help": "Which states get an x̂0 estimate: 'all' = every state, gains normalized over all trainable "
            "steps (paper Eq. 5); 'drawn' = the trainer draws the trained (sample, step) pairs first and estimates "
            "only the states x^(j), x^(j+1) their gains need, normalized over the drawn gains (≈ 2.3× Flow-GRPO's "
            "NFEs at T′ = 5 instead of 3.3×; ALGORITHMS.md §4.3). Not with use_gae or baseline=ema, which need "
            "every gain."
        },
    )

    dip_threshold: float = field(
        default=0.0,
        metadata={
            "help": "Diagnostic only (metric credit/rho_nonmonotone_frac): a trajectory is non-monotone when some "
            "ρ_k falls more than this below max_{i≤k} ρ_i. Set it to the reward's own reading noise, 2·√2·σ, so a "
            "wiggle of a dense reward does not count (shapes: σ = 0.077 → 0.22, docs/results/step_credit_figures).",
            "ge": 0,
        },
    )

    def __post_init__(self) -> None:
        check_values(self, "credit.options")
        if self.states == "drawn" and (self.use_gae or self.baseline == "ema"):
            raise ValueError("credit.options.states=drawn estimates only the drawn pairs' gains; use_gae and "
                             "baseline=ema need every gain: use states=all with them")


def stepwise_gains(step_rewards: Tensor) -> Tensor:
    """Per-step reward gains g_j = ρ_{j+1} − ρ_j (§4.2, A6).

    Args:
        step_rewards: (B, T+1) ρ_0 … ρ_T.

    Returns:
        (B, T) gains, same dtype as the input; Σ_j g_j = ρ_T − ρ_0 up to float rounding.
    """
    return step_rewards[:, 1:] - step_rewards[:, :-1]


def gae_over_gains(gains: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE over the gain sequence with value ≡ 0 (δ_j = g_j), §4.6 [G].

    A_j = Σ_{l≥0} (γλ)^l g_{j+l}: each step is credited with its own gain plus the discounted gains of the LATER
    denoising steps. γ = λ = 1 gives the reward-to-go ρ_T − ρ_j; γλ = 0 gives g.

    Args:
        gains: (B, T).
        gamma: γ in [0, 1].
        lam: λ in [0, 1].

    Returns:
        (B, T).
    """
    return discounted_reverse_cumsum(gains, gamma * lam)


def ema_baseline_update(baseline: Tensor | None, step_means: Tensor, decay: float) -> Tensor:
    """One EMA step of the per-step baseline (§4.6 [G]): b ← λ·b + (1−λ)·m; the first call returns m.

    Args:
        baseline: (T,) previous baseline, or None before the first iteration.
        step_means: (T,) batch mean of the per-step signal (gains, or GAE returns) of this iteration.
        decay: λ in [0, 1].

    Returns:
        (T,) new baseline (detached).
    """
    step_means = step_means.detach()
    if baseline is None:
        return step_means.clone()
    baseline = baseline.to(device=step_means.device, dtype=step_means.dtype)
    return decay * baseline + (1.0 - decay) * step_means


def normalize_gains(
    gains: Tensor,
    group_ids: Tensor,
    *,
    scope: str = "joint",
    eps: float = 1e-4,
    step_mask: Tensor | None = None,
    baseline: Tensor | None = None,
) -> Tensor:
    """Group-normalize per-step gains (§4.3 Eq. 5, per-step ablation, A5 global std).

    ``joint``:    Ã_ij = (g_ij − μ_g) / (σ_g + ε), μ_g, σ_g over the group's N·T gains.
    ``per_step``: Ã_ij = (g_ij − μ_gj) / (σ_gj + ε), μ_gj, σ_gj over the group's N gains at step j.
    ``global``:   Ã_ij = (g_ij − μ_g) / (σ + ε), μ_g joint per group, σ over all gains of the batch.
    ``per_step_mean``: Ã_ij = c_ij / (σ_g + ε), c_ij = g_ij − μ_gj (μ_gj over the group's N gains at step j; c = 0
                  exactly where those are all equal), σ_g the std of the group's N·T centred values c. Every
                  (group, step) sums to zero, as per_step, but a step whose gains barely differ keeps advantages
                  near 0 instead of being scaled up to unit size.

    With ``baseline`` b (T,), μ is replaced by b_j (EMA variant) and σ is unchanged. A cell whose gains are all
    equal (σ exactly 0: a whole group for joint/global, a (group, step) for per_step) gets exactly 0: with no
    spread there is no scale to normalize by, and (g − b)/ε would explode. Statistics are population (correction 0).

    Args:
        gains: (B, T) gains (or GAE returns).
        group_ids: (B,) int64.
        scope: ``"joint"``, ``"per_step"``, ``"global"`` or ``"per_step_mean"``.
        eps: ε.
        step_mask: (T,) bool, False columns left out of the statistics (their output is still computed), or
            (B, T) bool, single gains left out (``states=drawn``).
        baseline: (T,) per-step baseline replacing the group mean, or None.

    Returns:
        (B, T) normalized gains.
    """
    inverse, num_groups = group_index(group_ids)
    if scope not in ("joint", "per_step", "global", "per_step_mean"):
        raise ValueError(f"scope must be 'joint', 'per_step', 'global' or 'per_step_mean'; got {scope!r}.")
    if scope == "per_step_mean":
        if baseline is None:
            cell = group_moments(gains, inverse, num_groups, step_mask=step_mask)  # (P, T): per group and step
            centred = torch.where(cell.constant[inverse], torch.zeros_like(gains), gains - cell.mean[inverse])
        else:
            centred = gains - baseline.to(gains.device, gains.dtype)[None, :]
        pooled = group_moments(centred, inverse, num_groups, step_mask=step_mask, pool_steps=True)  # (P, 1)
        constant = pooled.constant[inverse]  # without a baseline, all-equal gains are all-zero centred values
        if baseline is not None:  # all-equal gains → 0 with a baseline too
            flat = group_moments(gains, inverse, num_groups, step_mask=step_mask, pool_steps=True)  # (P, 1)
            constant = constant | flat.constant[inverse]
        return safe_zscore(centred, torch.zeros_like(centred), pooled.std[inverse], constant, eps)
    mom = group_moments(gains, inverse, num_groups, step_mask=step_mask, pool_steps=scope != "per_step")
    center, scale, constant = mom.mean[inverse], mom.std[inverse], mom.constant[inverse]  # (B, 1) or (B, T)
    if scope == "global":
        m = None if step_mask is None else step_mask.to(gains.device, torch.bool)
        kept = gains if m is None else (gains[:, m] if m.dim() == 1 else gains[m])
        scale = (kept.std(correction=0) if kept.numel() else gains.new_zeros(())).expand_as(scale)
    if baseline is not None:
        center = baseline.to(device=gains.device, dtype=gains.dtype)[None, :]
    return safe_zscore(gains, center, scale, constant, eps)


def gain_stats(step_rewards: Tensor, group_ids: Tensor, dip: float = 0.0) -> dict[str, float | list[float]]:
    """Diagnostics of the intermediate rewards ρ (B, T+1).

    Returns:
        ``gain_abs_mean_per_step`` (list of T floats, cf. the paper's Fig. 2 |g_t| plot), ``gain_neg_frac``
        (fraction of negative gains), ``rho_nonmonotone_frac`` (fraction of trajectories with a dip: some ρ_k more
        than `dip` below max_{i≤k} ρ_i, Stepwise Fig. 1; `dip` = the reward's reading noise keeps wiggles out),
        ``gain_telescope_err`` (max |Σ_j g_j − (ρ_T − ρ_0)|, float rounding only), ``rho0_group_spread`` (max over
        groups of max − min of ρ_0; 0 when the initial noise and x̂0 estimator are shared as §4.1 requires).
    """
    rho = step_rewards.to(compute_dtype(step_rewards))
    gains = stepwise_gains(rho)
    inverse, num_groups = group_index(group_ids)
    idx = inverse
    rho0 = rho[:, 0]
    hi = torch.full((num_groups,), float("-inf"), dtype=rho.dtype, device=rho.device).scatter_reduce(
        0, idx, rho0, reduce="amax"
    )
    lo = torch.full((num_groups,), float("inf"), dtype=rho.dtype, device=rho.device).scatter_reduce(
        0, idx, rho0, reduce="amin"
    )
    dips = (rho < torch.cummax(rho, dim=1).values - dip).any(1)
    return {
        "gain_abs_mean_per_step": gains.abs().mean(0).tolist(),
        "gain_neg_frac": float((gains < 0).float().mean()),
        "rho_nonmonotone_frac": float(dips.float().mean()),
        "gain_telescope_err": float((gains.sum(1) - (rho[:, -1] - rho[:, 0])).abs().max()),
        "rho0_group_spread": float((hi - lo).max()),
    }


def stepwise_advantages(inp: CreditInput, opts: StepwiseOptions, cfg: CreditCfg) -> CreditOutput:
    """Stepwise-Flow-GRPO estimator (§4.2–4.6): normalized per-step gains.

    Pipeline: g = ρ_{j+1} − ρ_j → (GAE over gains if ``opts.use_gae``) → (EMA baseline if
    ``opts.baseline == "ema"``) → ``normalize_gains`` with ``opts.norm``.

    EMA variant: the baseline used for this batch already includes this batch's per-step mean,
    b = λ·b_prev + (1−λ)·mean_batch g, so the first iteration (no b_prev) centres each step on its batch mean.

    Args:
        inp: uses ``step_rewards`` (B, T+1) (required), ``group_ids``, ``step_mask`` (statistics only, when
            ``cfg.mask_stats``), ``state[EMA_STATE_KEY]`` (EMA variant).
        opts: StepwiseOptions (``norm``, ``baseline``, ``ema_decay``, ``use_gae``, ``gae_gamma``, ``gae_lambda``).
        cfg: uses ``eps``, ``mask_stats``.

    Returns:
        CreditOutput with advantages (B, T), gain and reward stats, and ``state`` holding the new EMA baseline
        under ``EMA_STATE_KEY`` (EMA variant only).
    """
    if inp.step_rewards is None:
        raise ValueError("stepwise credit needs CreditInput.step_rewards (B, T+1): the rewards ρ_j of the x̂0 "
                         "estimates of every state x^(0) … x^(T) (ALGORITHMS.md §4.1).")
    rho = inp.step_rewards.to(compute_dtype(inp.step_rewards))
    signal = stepwise_gains(rho)  # (B, T)
    if inp.gain_mask is not None:  # states=drawn: only the drawn pairs' gains exist (ρ_j and ρ_{j+1} estimated)
        return _drawn_advantages(inp, rho, signal, opts, cfg)
    if opts.use_gae:
        signal = gae_over_gains(signal, opts.gae_gamma, opts.gae_lambda)
    stat_mask = inp.step_mask if cfg.mask_stats else None
    state = dict(inp.state)
    baseline = None
    if opts.baseline == "ema":
        baseline = ema_baseline_update(inp.state.get(EMA_STATE_KEY), signal.mean(0), opts.ema_decay)  # (T,)
        state[EMA_STATE_KEY] = baseline
    adv = normalize_gains(
        signal, inp.group_ids, scope=opts.norm, eps=cfg.eps, step_mask=stat_mask, baseline=baseline
    )
    stats: dict[str, float | list[float]] = {
        **reward_stats(inp.rewards, inp.group_ids),
        **gain_stats(rho, inp.group_ids, opts.dip_threshold),
    }
    if baseline is not None:
        stats["ema_baseline_per_step"] = baseline.tolist()
    return CreditOutput(advantages=adv, stats=stats, state=state)



def _drawn_advantages(inp: CreditInput, rho: Tensor, gains: Tensor, opts: StepwiseOptions,
                      cfg: CreditCfg) -> CreditOutput:
    """``states=drawn``: the gains g_ij = ρ_i,j+1 − ρ_ij of the drawn pairs (``inp.gain_mask`` (B, T)), normalized
    with ``opts.norm`` over those gains only; every other pair gets 0.

    Args:
        rho: (B, T+1) ρ, 0 at states no drawn pair needs. gains: (B, T) their differences.
    """
    drawn = inp.gain_mask.to(device=gains.device, dtype=torch.bool)  # type: ignore[union-attr]
    if cfg.mask_stats:
        drawn = drawn & inp.step_mask.to(device=gains.device, dtype=torch.bool)[None, :]
    g = torch.where(drawn, gains, torch.zeros_like(gains))
    adv = normalize_gains(g, inp.group_ids, scope=opts.norm, eps=cfg.eps, step_mask=drawn)
    adv = torch.where(drawn, adv, torch.zeros_like(adv))
    kept = gains[drawn]
    w = drawn.to(gains.dtype)
    per_step = (g.abs() * w).sum(0) / w.sum(0).clamp_min(1)  # (T,) mean |gain| over the drawn pairs of each step
    stats: dict[str, float | list[float]] = {
        **reward_stats(inp.rewards, inp.group_ids),
        "gain_abs_mean_per_step": per_step.tolist(),
        "gain_neg_frac": float((kept < 0).float().mean()) if kept.numel() else 0.0,
        "drawn_gains": int(drawn.sum()),
    }
    return CreditOutput(advantages=adv, stats=stats, state=dict(inp.state))
