"""Options of the credit (advantage) layer: `credit.*` in a config; defaults from the ALGORITHMS.md decisions table.

The schema is owned by `config` (which imports no component); `flowcredit.credit.base` re-exports `CreditCfg`, and
every estimator receives it as its second argument, ``fn(inp: CreditInput, cfg: CreditCfg) -> CreditOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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
        metadata={
            "help": "Final advantages are clipped to ±adv_clip (Flow-GRPO adv_clip_max = 5); None disables.",
            "gt": 0,
        },
    )
    mask_stats: bool = field(
        default=True,
        metadata={
            "help": "Compute normalization statistics (stepwise mean/std over steps) only over the steps kept by "
            "step_mask, i.e. the advantages the loss actually sees."
        },
    )
    # --- Flow-GRPO (ALGORITHMS.md §3.2) ---
    std_scope: Literal["global", "group"] = field(
        default="global",
        metadata={
            "help": "flow_grpo std: 'global' = population std of all rewards in the batch (Flow-GRPO global_std=True, "
            "the released configs); 'group' = per-prompt std. The mean is always per prompt."
        },
    )
    # --- Stepwise-Flow-GRPO (§4.2–4.6) ---
    stepwise_norm: Literal["joint", "per_step", "global"] = field(
        default="joint",
        metadata={
            "help": "Stepwise gain normalization: 'joint' = per-group mean/std over the group's N·T gains (paper Eq. "
            "5); 'per_step' = per-group mean/std at each step over N trajectories (ablation, Fig. 9); 'global' = "
            "per-group joint mean, batch-wide std of all gains (A5)."
        },
    )
    stepwise_baseline: Literal["none", "ema"] = field(
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
    # --- VGPO: TCRM + ADAE (§5.2–5.5) ---
    vgpo_gamma: float = field(
        default=0.9,
        metadata={
            "help": "TCRM discount γ of the reward-to-go Q_j = Σ_{m≥j} γ^{m−j} I_m (§5.3, A11; γ unknown, 0.9–1.0 "
            "suggested).",
            "ge": 0,
            "le": 1,
        },
    )
    vgpo_weights: bool = field(
        default=True,
        metadata={"help": "TCRM timestep weights ω_j = Q_j / mean_t Q_t per trajectory (§5.4, Eq. 11); off ⇒ ω = 1."},
    )
    vgpo_weights_degenerate: Literal["zero", "uniform"] = field(
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
    anchor: Literal["none", "adae"] = field(
        default="none",
        metadata={
            "help": "Compose the ADAE absolute anchor on top of another (relative) estimator: Â = ω·(A_rel + "
            "k·Q·1[j<K]), with Q, ω from the instant rewards (or step_rewards[:, 1:]). 'vgpo' already includes it."
        },
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
            raise ValueError(
                "CreditCfg: name='vgpo' already applies the ADAE anchor; set anchor='none' (and adae_k=0 for TCRM "
                "without the anchor)."
            )
