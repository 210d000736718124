"""The `credit:` section: which credit (advantage) method, its own options, and what every method shares.

    credit:
      name: stepwise                # `method=X` is a shorthand for it; an explicit name wins
      options: {norm: per_step}     # the method's own options dataclass (flowcredit/credit/registry.py)
      eps: 1.0e-4                   # shared by every estimator ...
      adv_clip: 5.0
      mask_stats: true
      anchor: adae                  # ... and the ADAE anchor, composable on any estimator
      anchor_options: {adae_k: 0.1} # its options (VGPO's TCRM + ADAE options)

Design: what one estimator reads is declared by that estimator, next to its function, as an options dataclass
(`FlowGRPOOptions` in credit/group.py, `StepwiseOptions` in credit/stepwise.py, `VGPOOptions` in credit/vgpo.py) and
registered with it; the loader checks `credit.options` against the dataclass of `credit.name`. What the registry's
`assign_credit` applies around every estimator (the ε of every std, the final clip, which steps the statistics see,
the anchor) stays a common field here. The schema is owned by `config` (which imports no component);
`flowcredit.credit.base` re-exports `CreditCfg`. Every estimator is ``fn(inp: CreditInput, opts, cfg: CreditCfg)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .build import check_ranges
from .fields import _h
from .registry import options_field


@dataclass
class CreditCfg:
    """The credit section: the estimator, its options and the knobs shared by every estimator."""

    name: str = _h("flow_grpo", "Credit method (registry flowcredit.credit.registry: flow_grpo, stepwise, vgpo; see "
        "--help-config) or a 'package.module:function' path to a function (inp, opts, cfg) -> CreditOutput.")
    options: dict[str, Any] = options_field("credit", "Options of the chosen credit method, checked against its own "
        "options dataclass (listed by --help-config), e.g. {std_scope: group} for flow_grpo, {norm: per_step} for "
        "stepwise.")
    eps: float = _h(1e-4, "ε added to every standard deviation before dividing (Flow-GRPO code uses 1e-4).", gt=0)
    adv_clip: float | None = _h(5.0, "Final advantages are clipped to ±adv_clip (Flow-GRPO adv_clip_max = 5); None "
        "disables.", gt=0)
    mask_stats: bool = _h(True, "Compute normalization statistics (stepwise mean/std over steps, the anchor's "
        "abs_share) only over the steps kept by step_mask, i.e. the advantages the loss actually sees.")
    anchor: str = _h("none", "Compose an absolute anchor on top of the (relative) estimator: 'adae' = Â = ω·(A_rel + "
        "k·Q·1[j<K]) with Q, ω from the instant rewards (or step_rewards[:, 1:]); 'none'. 'vgpo' already includes it.")
    anchor_options: dict[str, Any] = options_field("credit_anchor", "Options of the anchor (adae: VGPO's TCRM + ADAE "
        "options, e.g. {adae_k: 0.1}).", name_field="anchor")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Cross-field checks (also called by ``assign_credit``, since fields may be set after construction).

        Raises:
            ValueError: naming the fields and what to do.
        """
        check_ranges(self, "credit")
        if self.name == "vgpo" and self.anchor != "none":
            raise ValueError(
                "credit.name=vgpo already applies the ADAE anchor; set credit.anchor=none (and "
                "credit.options.adae_k=0 for TCRM without the anchor)"
            )
        if self.anchor == "none" and self.anchor_options:
            raise ValueError(
                f"credit.anchor_options={self.anchor_options} are set but credit.anchor=none; set credit.anchor=adae "
                "or remove them"
            )
