"""Credit assignment: advantage estimators for Flow-GRPO, Stepwise-Flow-GRPO and VGPO (ALGORITHMS.md §3–5).

The trainer builds a ``CreditInput`` and calls ``assign_credit(cfg, inp)``; it asks ``needs_step_rewards(cfg)`` /
``needs_instant_rewards(cfg)`` beforehand to know which intermediate rewards to compute. Methods are registered in
``registry.CREDIT`` (name → estimator + options dataclass + requirements); add one with ``register_credit``.
"""

from flowcredit.credit.base import CreditCfg, CreditInput, CreditOutput
from flowcredit.credit.registry import (
    CREDIT,
    assign_credit,
    credit_options,
    names,
    needs_instant_rewards,
    needs_step_rewards,
    resolve,
)

__all__ = [
    "CREDIT",
    "CreditCfg",
    "CreditInput",
    "CreditOutput",
    "assign_credit",
    "credit_options",
    "names",
    "needs_instant_rewards",
    "needs_step_rewards",
    "resolve",
]
