"""Records, config and group helpers shared by every credit (advantage) estimator.

Every estimator has ONE signature, ``fn(inp: CreditInput, cfg: CreditCfg) -> CreditOutput``, so the trainer never
special-cases a method (STYLE.md R4/R5). The estimators are pure functions; the only cross-iteration state (the
Stepwise EMA baseline) travels explicitly in ``CreditInput.state`` / ``CreditOutput.state``.

Notation (as in ``flowcredit.types``):
    B   batch size (= prompts × group size G)
    P   number of distinct prompt groups in the batch
    T   number of recorded SDE steps; step j maps state x^(j) (time t_j) to x^(j+1), j = 0 … T−1
    ρ_j reward of the T′-substep x̂0 estimate of state x^(j), j = 0 … T (ALGORITHMS.md §1.5, §4.1); ρ_T = R(x0)
    I_j VGPO instant reward of step j = reward of the one-step Tweedie estimate of x^(j+1) (§5.2)

All statistics are population statistics (``correction=0``), as in Flow-GRPO's ``np.std`` and the Stepwise blog.
A statistic over a set of equal values is treated as exactly constant: the normalized value is then exactly 0,
never ``0/ε`` noise and never NaN (see ``group_moments``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

Stats = dict[str, "float | list[float]"]


@dataclass
class CreditInput:
    """What the trainer hands to a credit estimator.

    Attributes:
        rewards: (B,) terminal rewards R(x0) (fp32).
        group_ids: (B,) int64 prompt-group index; samples with equal id share a prompt (any integer values).
        step_mask: (T,) bool, True where the step is trained (σ > 0 and inside ``timestep_fraction``). Masked steps
            get advantage exactly 0 from ``assign_credit`` and, by default, are left out of normalization statistics.
        step_rewards: (B, T+1) ρ_j, j = 0 … T, or None. ρ_T should equal ``rewards``; ρ_0 is shared within a group
            when the initial noise is shared (§4.1). Needed by ``stepwise``.
        instant_rewards: (B, T) VGPO instant rewards I_j, or None. With T′ = 1, I_j == ρ_{j+1}; when None, VGPO and
            the ADAE anchor fall back to ``step_rewards[:, 1:]``.
        state: estimator state carried across training iterations (e.g. the Stepwise EMA baseline under
            ``stepwise.EMA_STATE_KEY``). Pass back the ``CreditOutput.state`` of the previous iteration.
    """

    rewards: Tensor
    group_ids: Tensor
    step_mask: Tensor
    step_rewards: Tensor | None = None
    instant_rewards: Tensor | None = None
    state: dict[str, Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.rewards.shape[0]

    @property
    def num_steps(self) -> int:
        return self.step_mask.shape[0]


@dataclass
class CreditOutput:
    """What a credit estimator returns.

    Attributes:
        advantages: (B, T) fp32 per-step advantages; column j is the advantage of step x^(j) → x^(j+1).
        stats: diagnostics for logging: scalars (float) and per-step-index lists (list[float] of length T).
        state: updated cross-iteration state (empty for stateless estimators); feed it to the next CreditInput.
    """

    advantages: Tensor
    stats: Stats = field(default_factory=dict)
    state: dict[str, Tensor] = field(default_factory=dict)


class CreditFn(Protocol):
    """The estimator protocol: every entry of ``registry.CREDIT`` has this signature.

    An estimator may declare the optional inputs it reads with a ``requires`` attribute, a tuple of
    ``CreditInput`` field names (e.g. ``("step_rewards",)``); ``registry.needs_step_rewards`` reads it for
    dotted-path plugins.
    """

    def __call__(self, inp: CreditInput, cfg: CreditCfg) -> CreditOutput: ...


@dataclass
class CreditCfg:
    """Every knob of the credit layer; defaults from the ALGORITHMS.md decisions table."""

    name: str = field(
        default="flow_grpo",
        metadata={"help": "Estimator: a name of flowcredit.credit.registry.CREDIT ('flow_grpo', 'stepwise', 'vgpo') "
                  "or a 'package.module:function' path to a function (inp, cfg) -> CreditOutput."},
    )
    eps: float = field(
        default=1e-4,
        metadata={"help": "ε added to every standard deviation before dividing (Flow-GRPO code uses 1e-4).", "gt": 0},
    )
    adv_clip: float | None = field(
        default=5.0,
        metadata={"help": "Final advantages are clipped to ±adv_clip (Flow-GRPO adv_clip_max = 5); None disables.", "gt": 0},
    )
    mask_stats: bool = field(
        default=True,
        metadata={"help": "Compute normalization statistics (stepwise mean/std over steps) only over the steps "
                  "kept by step_mask, i.e. the advantages the loss actually sees."},
    )
    # --- Flow-GRPO (ALGORITHMS.md §3.2) ---
    std_scope: Literal["global", "group"] = field(
        default="global",
        metadata={"help": "flow_grpo std: 'global' = population std of all rewards in the batch (Flow-GRPO "
                  "global_std=True, the released configs); 'group' = per-prompt std. The mean is always per prompt."},
    )
    # --- Stepwise-Flow-GRPO (§4.2–4.6) ---
    stepwise_norm: Literal["joint", "per_step", "global"] = field(
        default="joint",
        metadata={"help": "Stepwise gain normalization: 'joint' = per-group mean/std over the group's N·T gains "
                  "(paper Eq. 5); 'per_step' = per-group mean/std at each step over N trajectories "
                  "(ablation, Fig. 9); "
                  "'global' = per-group joint mean, batch-wide std of all gains (A5)."},
    )
    stepwise_baseline: Literal["none", "ema"] = field(
        default="none",
        metadata={"help": "'ema' replaces the group mean by a per-step EMA baseline b_j kept across iterations "
                  "(§4.6 variant, lost to the plain gain in the paper); the std is unchanged."},
    )
    ema_decay: float = field(
        default=0.9,
        metadata={"help": "EMA baseline decay λ: b_j ← λ·b_j + (1−λ)·mean_batch g_j (§4.6).", "ge": 0, "le": 1},
    )
    use_gae: bool = field(
        default=False,
        metadata={"help": "Replace each gain by GAE over the gain sequence, A_j = Σ_{l≥0} (γλ)^l g_{j+l} (value ≡ 0, "
                  "§4.6 variant), before normalization."},
    )
    gae_gamma: float = field(
        default=1.0, metadata={"help": "GAE discount γ over later denoising steps (use_gae).", "ge": 0, "le": 1}
    )
    gae_lambda: float = field(
        default=0.95, metadata={"help": "GAE λ (use_gae); γ = λ = 1 gives the reward-to-go ρ_T − ρ_j.", "ge": 0, "le": 1}
    )
    # --- VGPO: TCRM + ADAE (§5.2–5.5) ---
    vgpo_gamma: float = field(
        default=0.9,
        metadata={"help": "TCRM discount γ of the reward-to-go Q_j = Σ_{m≥j} γ^{m−j} I_m (§5.3, A11; γ unknown, "
                  "0.9–1.0 suggested).", "ge": 0, "le": 1},
    )
    vgpo_weights: bool = field(
        default=True,
        metadata={"help": "TCRM timestep weights ω_j = Q_j / mean_t Q_t per trajectory (§5.4, Eq. 11); off ⇒ ω = 1."},
    )
    vgpo_weights_degenerate: Literal["zero", "uniform"] = field(
        default="zero",
        metadata={"help": "ω of a trajectory whose Q is all 0 (none of its x̂0 estimates scored; common under a "
                  "binary reward): 'zero' = the A14 guard, no advantage at all for it; 'uniform' = ω 1, it keeps its "
                  "relative (e.g. negative) advantage."},
    )
    reward_shift: Literal["min", "none"] = field(
        default="min",
        metadata={"help": "Make instant rewards non-negative before Q and ω (A14): 'min' subtracts the batch minimum "
                  "when any instant reward is negative; 'none' requires rewards ≥ 0 (error otherwise, when ω is on)."},
    )
    adae_k: float = field(
        default=0.1,
        metadata={"help": "ADAE absolute-anchor weight k in Â = ω·(z + k·Q) (§5.5, A13; tuned, Q is O(T·R)); "
                  "0 switches the anchor off.", "ge": 0},
    )
    adae_steps: int = field(
        default=5,
        metadata={"help": "The absolute anchor k·Q acts only on the first K sampling steps j < K (VGPO App. A.2: "
                  "first 5 steps); -1 = all steps.", "ge": -1},
    )
    adae_norm: Literal["plus", "one_plus_k"] = field(
        default="plus",
        metadata={"help": "ADAE form where the anchor acts: 'plus' = ω·(z + k·Q); 'one_plus_k' = ω·(z + k·Q)/(1+k), "
                  "i.e. (Q − μ + αQ)/(σ + α) with α = kσ (§5.5 alternative)."},
    )
    anchor: Literal["none", "adae"] = field(
        default="none",
        metadata={"help": "Compose the ADAE absolute anchor on top of another (relative) estimator: "
                  "Â = ω·(A_rel + k·Q·1[j<K]), with Q, ω from the instant rewards (or step_rewards[:, 1:]). "
                  "'vgpo' already includes it."},
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check choices and ranges (also called by ``assign_credit``, since fields may be set after construction).

        Raises:
            ValueError: naming the field, the value and what is allowed.
        """
        choices = {
            "std_scope": ("global", "group"),
            "stepwise_norm": ("joint", "per_step", "global"),
            "stepwise_baseline": ("none", "ema"),
            "reward_shift": ("min", "none"),
            "adae_norm": ("plus", "one_plus_k"),
            "anchor": ("none", "adae"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"CreditCfg.{key}={getattr(self, key)!r} is not one of {allowed}.")
        if not self.eps > 0:
            raise ValueError(f"CreditCfg.eps must be > 0 (it guards divisions by a std); got {self.eps}.")
        if self.adv_clip is not None and not self.adv_clip > 0:
            raise ValueError(f"CreditCfg.adv_clip must be > 0 or None (no clipping); got {self.adv_clip}.")
        for key in ("ema_decay", "gae_gamma", "gae_lambda", "vgpo_gamma"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"CreditCfg.{key} must lie in [0, 1]; got {getattr(self, key)}.")
        if self.adae_k < 0:
            raise ValueError(f"CreditCfg.adae_k must be ≥ 0 (0 switches the anchor off); got {self.adae_k}.")
        if self.adae_steps < -1:
            raise ValueError(f"CreditCfg.adae_steps must be ≥ 0, or -1 for all steps; got {self.adae_steps}.")
        if self.name == "vgpo" and self.anchor == "adae":
            raise ValueError("CreditCfg: name='vgpo' already applies the ADAE anchor; set anchor='none' "
                             "(and adae_k=0 for TCRM without the anchor).")


# ---------------------------------------------------------------------------------------------------------------
# Group statistics (vectorized with index_add / scatter_reduce; no Python loop over groups)
# ---------------------------------------------------------------------------------------------------------------


class GroupMoments(NamedTuple):
    """Per-group population statistics; K = T (per step) or 1 (pooled / 1-D input).

    Attributes:
        mean: (P, K) group mean.
        std: (P, K) group population std.
        constant: (P, K) bool, True when every (unmasked) value of the cell is exactly equal, or the cell is empty.
        count: (P, K) number of values in the cell.
    """

    mean: Tensor
    std: Tensor
    constant: Tensor
    count: Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs (so float64 tests stay exact)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to contiguous indices.

    Args:
        group_ids: (B,) int64 group ids (any values, any order).

    Returns:
        inverse: (B,) int64 in [0, P), samples of the same group share the index.
        P: number of distinct groups.
    """
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def group_moments(
    x: Tensor, inverse: Tensor, num_groups: int, *, step_mask: Tensor | None = None, pool_steps: bool = False
) -> GroupMoments:
    """Mean, population std and exact-constancy of the values of each group.

    Args:
        x: (B,) or (B, T) values.
        inverse: (B,) contiguous group index from ``group_index``.
        num_groups: P.
        step_mask: (T,) bool, only for 2-D ``x``: columns left out of the statistics when False.
        pool_steps: 2-D ``x`` only: pool each group's (unmasked) B_g·T values into one cell (K = 1) instead of one
            cell per step (K = T).

    Returns:
        GroupMoments with (P, K) tensors. ``constant`` is decided by max == min, which is exact; a mean computed as
        sum/count of equal floats is not always bit-equal to them, so callers must use ``constant`` (not std == 0)
        to output exact zeros.
    """
    x2 = x[:, None] if x.dim() == 1 else x
    keep = torch.ones_like(x2, dtype=torch.bool)
    if step_mask is not None:
        keep = keep & step_mask.to(device=x2.device, dtype=torch.bool)[None, :]
    w = keep.to(x2.dtype)
    hi = x2.masked_fill(~keep, float("-inf"))
    lo = x2.masked_fill(~keep, float("inf"))
    if pool_steps:
        s, c = (x2 * w).sum(1, keepdim=True), w.sum(1, keepdim=True)  # (B, 1)
        hi, lo = hi.amax(1, keepdim=True), lo.amin(1, keepdim=True)
    else:
        s, c = x2 * w, w  # (B, K)
    k = s.shape[1]
    zeros = x2.new_zeros(num_groups, k)
    total = zeros.index_add(0, inverse, s)
    count = zeros.index_add(0, inverse, c)
    mean = total / count.clamp_min(1)  # (P, K)
    dev = (x2 - mean[inverse]) * w  # (B, T) or (B, K)
    sq = (dev**2).sum(1, keepdim=True) if pool_steps else dev**2
    var = zeros.index_add(0, inverse, sq) / count.clamp_min(1)
    idx = inverse[:, None].expand(-1, k)
    g_hi = torch.full_like(zeros, float("-inf")).scatter_reduce(0, idx, hi, reduce="amax")
    g_lo = torch.full_like(zeros, float("inf")).scatter_reduce(0, idx, lo, reduce="amin")
    constant = g_hi <= g_lo  # equal values, or empty cell (-inf <= inf)
    return GroupMoments(mean=mean, std=var.clamp_min(0).sqrt(), constant=constant, count=count)


def safe_zscore(x: Tensor, center: Tensor, scale: Tensor, constant: Tensor, eps: float) -> Tensor:
    """(x − center) / (scale + ε), and exactly 0 where ``constant`` is True.

    Args:
        x: (B, T) or (B,) values.
        center, scale, constant: broadcastable to ``x`` (e.g. (B, 1) or (B, T) gathered group statistics).
        eps: ε.

    Returns:
        Tensor shaped like ``x``; never NaN for finite inputs.
    """
    z = (x - center) / (scale + eps)
    return torch.where(constant, torch.zeros_like(z), z)


def zero_std_group_ratio(values: Tensor, group_ids: Tensor) -> float:
    """Fraction of groups whose values are all equal (std exactly 0); Flow-GRPO's ``calculate_zero_std_ratio``.

    Args:
        values: (B,) values, e.g. terminal rewards.
        group_ids: (B,) int64.
    """
    inverse, num_groups = group_index(group_ids)
    return float(group_moments(values, inverse, num_groups).constant.float().mean())


def discounted_reverse_cumsum(x: Tensor, discount: float) -> Tensor:
    """y_j = Σ_{m ≥ j} discount^{m−j} · x_m along the last axis (toward later denoising steps).

    Used by TCRM's value Q (§5.3) and by GAE over gains (§4.6). ``discount = 0`` returns ``x``.

    Args:
        x: (B, T).
        discount: in [0, 1].

    Returns:
        (B, T), same dtype as ``x``.
    """
    out = torch.empty_like(x)
    acc = torch.zeros_like(x[:, 0])
    for step in range(x.shape[1] - 1, -1, -1):
        acc = x[:, step] + discount * acc
        out[:, step] = acc
    return out
