"""Records, config and group helpers shared by every credit (advantage) estimator.

Every estimator has ONE signature, ``fn(inp: CreditInput, opts, cfg: CreditCfg) -> CreditOutput`` (``opts``: its own
options dataclass, built from ``credit.options``; ``cfg``: the knobs every estimator shares), so the trainer never
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
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from ..config.credit import CreditCfg as CreditCfg  # the options schema is owned by config; re-exported here

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
        gain_mask: (B, T) bool, the (sample, step) pairs whose gains were estimated (stepwise ``states=drawn``: the
            drawn pairs; ρ at the states no drawn pair needs holds 0 and is never read), or None: every pair.
        state: estimator state carried across training iterations (e.g. the Stepwise EMA baseline under
            ``stepwise.EMA_STATE_KEY``). Pass back the ``CreditOutput.state`` of the previous iteration.
    """

    rewards: Tensor
    group_ids: Tensor
    step_mask: Tensor
    step_rewards: Tensor | None = None
    instant_rewards: Tensor | None = None
    gain_mask: Tensor | None = None
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

    What it requires besides the terminal rewards (``"step_rewards"``, ``"instant_rewards"``) and its options
    dataclass are declared when it is registered (``registry.register_credit``); a dotted-path plugin may carry them
    as ``requires`` / ``options`` attributes.
    """

    def __call__(self, inp: CreditInput, opts: Any, cfg: CreditCfg) -> CreditOutput: ...


# ---------------------------------------------------------------------------------------------------------------
# Group statistics (vectorized with index_add / scatter_reduce; no Python loop over groups)
# ---------------------------------------------------------------------------------------------------------------


class GroupMoments(NamedTuple):
    """Per-group population statistics; K = T (per step) or 1 (pooled / 1-D input).

    Attributes:
        mean: (P, K) group mean.
        std: (P, K) group population std.
        constant: (P, K) bool, True when every (unmasked) value of the cell is exactly equal, or the cell is empty.
        counts: (P, K) number of values in the cell.
    """

    mean: Tensor
    std: Tensor
    constant: Tensor
    counts: Tensor  # not `count`: that would shadow tuple.count


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
        step_mask: only for 2-D ``x``: (T,) bool, columns left out of the statistics when False, or (B, T) bool,
            single values left out.
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
        m = step_mask.to(device=x2.device, dtype=torch.bool)
        keep = keep & (m[None, :] if m.dim() == 1 else m)
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
    return GroupMoments(mean=mean, std=var.clamp_min(0).sqrt(), constant=constant, counts=count)


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
