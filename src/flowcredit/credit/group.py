"""Flow-GRPO group-relative advantages (ALGORITHMS.md §3.1 Eq. 4–6, §3.2 ``PerPromptStatTracker``).

    A_i = (r_i − mean_{j ∈ group(i)} r_j) / (std + ε),   broadcast to every step j = 0 … T−1

with ``std`` the population std of ALL rewards of the batch (``std_scope="global"``, Flow-GRPO's
``global_std=True`` in every released config) or of the group's rewards (``std_scope="group"``).

Notation: B batch, P groups, T steps (see ``flowcredit.credit.base``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor

from flowcredit.config.build import check_values
from flowcredit.credit.base import (
    CreditCfg,
    CreditInput,
    CreditOutput,
    Stats,
    compute_dtype,
    group_index,
    group_moments,
    safe_zscore,
)


@dataclass
class FlowGRPOOptions:
    """`credit.options` of flow_grpo (ALGORITHMS.md §3.2)."""

    std_scope: Literal["global", "group"] = field(
        default="global",
        metadata={
            "help": "The std of the advantage: 'global' = population std of all rewards in the batch (Flow-GRPO "
            "global_std=True, the released configs); 'group' = per-prompt std. The mean is always per prompt."
        },
    )

    def __post_init__(self) -> None:
        check_values(self, "credit.options")


def group_relative_rewards(
    rewards: Tensor, group_ids: Tensor, *, std_scope: str = "global", eps: float = 1e-4
) -> Tensor:
    """Per-sample Flow-GRPO advantage (§3.2).

    A_i = (r_i − μ_g(i)) / (s + ε), μ_g = mean of the group's rewards, s = population std of the whole batch
    (``"global"``) or of the group (``"group"``). A group whose rewards are all equal gets exactly 0 (never NaN, and
    not the float noise of r − mean(r)).

    Args:
        rewards: (B,) terminal rewards.
        group_ids: (B,) int64 prompt-group ids.
        std_scope: ``"global"`` or ``"group"``.
        eps: ε added to the std.

    Returns:
        (B,) advantages, fp32 (fp64 for fp64 rewards).
    """
    r = rewards.to(compute_dtype(rewards))
    inverse, num_groups = group_index(group_ids)
    mom = group_moments(r, inverse, num_groups)  # (P, 1)
    if std_scope == "global":
        scale = r.std(correction=0).expand(r.shape[0], 1)  # (B, 1) population std of the batch
    elif std_scope == "group":
        scale = mom.std[inverse]
    else:
        raise ValueError(f"std_scope must be 'global' or 'group'; got {std_scope!r}.")
    return safe_zscore(r[:, None], mom.mean[inverse], scale, mom.constant[inverse], eps)[:, 0]


def reward_stats(rewards: Tensor, group_ids: Tensor) -> Stats:
    """Terminal-reward diagnostics logged by every estimator.

    Args:
        rewards: (B,) terminal rewards.
        group_ids: (B,) int64.

    Returns:
        ``reward_mean``, ``reward_std`` (population), ``zero_std_group_ratio`` (fraction of groups whose rewards are
        all equal, Flow-GRPO's ``calculate_zero_std_ratio``), ``num_groups``.
    """
    r = rewards.to(compute_dtype(rewards))
    inverse, num_groups = group_index(group_ids)
    mom = group_moments(r, inverse, num_groups)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(correction=0)),
        "zero_std_group_ratio": float(mom.constant.float().mean()),
        "num_groups": float(num_groups),
    }


def flow_grpo_advantages(inp: CreditInput, opts: FlowGRPOOptions, cfg: CreditCfg) -> CreditOutput:
    """Flow-GRPO estimator (§3.1–3.2): one group-relative advantage per trajectory, the same at every step.

    Args:
        inp: uses ``rewards`` (B,), ``group_ids`` (B,), ``step_mask`` (T,) (for T only).
        opts: uses ``std_scope``.
        cfg: uses ``eps``.

    Returns:
        CreditOutput with advantages (B, T) (every column equal; clipping and masking are done by
        ``registry.assign_credit``) and ``reward_stats``.
    """
    adv = group_relative_rewards(inp.rewards, inp.group_ids, std_scope=opts.std_scope, eps=cfg.eps)  # (B,)
    advantages = adv[:, None].expand(-1, inp.num_steps).clone()  # (B, T)
    return CreditOutput(advantages=advantages, stats=reward_stats(inp.rewards, inp.group_ids))

