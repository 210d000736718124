"""Registry of credit methods and the one entry point the trainer calls, ``assign_credit``.

Reading the registrations below tells you every built-in method: name → estimator function + its own options
dataclass (``credit.options``) + what it requires the trainer to compute. Adding a method is one file with a function
and its options dataclass plus one ``register_credit`` line (README "Extending flowcredit"). A
``"package.module:function"`` name is accepted as the plugin escape hatch (its options: the function's ``options``
attribute, a dataclass, if any; its requirements: its ``requires`` attribute).

Every estimator has the signature ``fn(inp: CreditInput, opts: <its options>, cfg: CreditCfg) -> CreditOutput``; the
shared knobs (eps, adv_clip, mask_stats, the anchor) are in ``CreditCfg`` (config/credit.py).

Notation: B batch, T steps (see ``flowcredit.credit.base``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flowcredit.config.registry import NoOptions, Registry, Spec, import_user_module
from flowcredit.credit.base import CreditCfg, CreditInput, CreditOutput
from flowcredit.credit.group import FlowGRPOOptions, flow_grpo_advantages
from flowcredit.credit.stepwise import StepwiseOptions, stepwise_advantages
from flowcredit.credit.vgpo import VGPOOptions, apply_adae_anchor, vgpo_advantages

CREDIT = Registry("credit", "credit method", allow_paths=True)
ANCHORS = Registry("credit_anchor", "credit anchor", name_key="credit.anchor", options_key="credit.anchor_options")

#: what an estimator may require the trainer to compute (besides the terminal rewards)
REQUIREMENTS = ("step_rewards", "instant_rewards")


def register_credit(
    name: str, fn: Callable[..., CreditOutput], options: type = NoOptions, requires: tuple[str, ...] = (),
    help: str = "",
) -> Spec:
    """Register estimator `fn` under `name` (then ``credit.name=NAME``, with ``method=custom``).

    Args:
        name: the config name; must not be taken.
        fn: ``(inp: CreditInput, opts, cfg: CreditCfg) -> CreditOutput`` with advantages (B, T).
        options: its options dataclass (``credit.options``; every field with a default, a help text and, for
            numbers, a range in its metadata).
        requires: what the trainer must compute for it: "step_rewards" (ρ_j of the x̂0 estimates of every state,
            (B, T+1)) and/or "instant_rewards" (I_j, (B, T)).
        help: one sentence for ``flowcredit train --help-config``.
    """
    bad = [r for r in requires if r not in REQUIREMENTS]
    if bad:
        raise ValueError(f"credit method {name!r}: unknown requirement(s) {bad}; use {REQUIREMENTS}")
    return CREDIT.register(name, fn, options, requires=tuple(requires), help=help)


register_credit("flow_grpo", flow_grpo_advantages, FlowGRPOOptions,
                help="§3.2 group-relative terminal reward (Flow-GRPO), the same advantage at every step")
register_credit("stepwise", stepwise_advantages, StepwiseOptions, requires=("step_rewards",),
                help="§4 normalized per-step reward gains of the x̂0 estimates (Stepwise-Flow-GRPO)")
register_credit("vgpo", vgpo_advantages, VGPOOptions, requires=("instant_rewards",),
                help="§5 TCRM value + ADAE absolute anchor (VGPO)")
ANCHORS.register("none", None, help="no anchor: the estimator's advantages as they are")
ANCHORS.register("adae", apply_adae_anchor, VGPOOptions, requires=("instant_rewards",),
                 help="§5.5 VGPO's ADAE absolute anchor k·Q (with TCRM's ω) on top of any estimator")


def names() -> list[str]:
    """The registered credit method names."""
    return CREDIT.names()


def spec_of(name: str) -> Spec:
    """The Spec of a registered name or of a ``"package.module:function"`` path.

    Raises:
        ValueError: unknown name (the message lists the valid names and suggests the closest), or a malformed path.
        ImportError / AttributeError: the module or function of a path does not exist.
    """
    if name in CREDIT or ":" not in name:
        return CREDIT.spec(name)
    module_name, _, func_name = name.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"credit.name={name!r}: a plugin path must look like 'package.module:function'.")
    module = import_user_module(module_name)
    try:
        fn = getattr(module, func_name)
    except AttributeError as err:
        raise AttributeError(f"Module {module_name!r} has no credit estimator {func_name!r} (from {name!r}).") from err
    known = CREDIT.spec_of_fn(fn)
    if known is not None:  # a path to a registered estimator: its registered options and requirements
        return known
    return Spec(name, fn, getattr(fn, "options", NoOptions), tuple(getattr(fn, "requires", ())))


def resolve(name: str) -> Callable[..., CreditOutput]:
    """The estimator function of a registered name or a ``"package.module:function"`` path (see `spec_of`)."""
    return spec_of(name).fn


def credit_options(cfg: CreditCfg) -> Any:
    """The options dataclass of ``cfg.name`` built from ``cfg.options`` (ConfigError naming credit.options.KEY)."""
    return CREDIT.options(spec_of(cfg.name), cfg.options)


def _requires(cfg: CreditCfg) -> tuple[str, ...]:
    return spec_of(cfg.name).requires + ANCHORS.spec(cfg.anchor).requires


def needs_step_rewards(cfg: CreditCfg) -> bool:
    """Whether the trainer must compute ρ_j (B, T+1) = rewards of the T′-substep x̂0 of every state (§4.1)."""
    return "step_rewards" in _requires(cfg)


def estimated_states(cfg: CreditCfg) -> str:
    """Which states the trainer estimates for the step rewards: "all", or "drawn" (the credit's ``states`` option,
    stepwise: only the states the drawn pairs' gains need)."""
    return str(getattr(CREDIT.options(spec_of(cfg.name), cfg.options), "states", "all"))


def needs_instant_rewards(cfg: CreditCfg) -> bool:
    """Whether the estimator or the anchor reads the instant rewards I_j (B, T) (§5.2).

    The trainer may satisfy it either with ``CreditInput.instant_rewards`` (one-step Tweedie of x^(j+1), VGPO's
    definition) or, when ``needs_step_rewards`` already makes it compute ρ, by leaving ``instant_rewards`` None:
    ρ_{j+1} is then used (identical for T′ = 1).
    """
    return "instant_rewards" in _requires(cfg)


def _check_input(cfg: CreditCfg, inp: CreditInput) -> None:
    """Shape and finiteness checks with messages that name the field."""
    b, t = inp.rewards.shape[0], inp.step_mask.shape[0]
    if inp.rewards.dim() != 1 or inp.group_ids.shape != (b,):
        raise ValueError(
            f"CreditInput.rewards must be (B,) and group_ids (B,); got {tuple(inp.rewards.shape)} and "
            f"{tuple(inp.group_ids.shape)}."
        )
    if inp.step_mask.dim() != 1 or inp.step_mask.dtype != torch.bool:
        raise ValueError(
            f"CreditInput.step_mask must be a (T,) bool tensor; got {inp.step_mask.dtype} "
            f"{tuple(inp.step_mask.shape)}."
        )
    expected = {"rewards": (b,), "step_rewards": (b, t + 1), "instant_rewards": (b, t)}
    for key, shape in expected.items():
        value = getattr(inp, key)
        if value is None:
            continue
        if tuple(value.shape) != shape:
            raise ValueError(
                f"CreditInput.{key} must have shape {shape} (B={b}, T={t} from step_mask); got {tuple(value.shape)}."
            )
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"CreditInput.{key} contains NaN or inf; fix the reward before assigning credit.")
    if needs_step_rewards(cfg) and inp.step_rewards is None:
        raise ValueError(f"Credit estimator {cfg.name!r} needs CreditInput.step_rewards (B, T+1) (§4.1).")
    if needs_instant_rewards(cfg) and inp.instant_rewards is None and inp.step_rewards is None:
        raise ValueError(
            f"Credit estimator {cfg.name!r} with anchor={cfg.anchor!r} needs CreditInput.instant_rewards (B, T) or "
            "step_rewards (B, T+1) (§5.2)."
        )


def assign_credit(cfg: CreditCfg, inp: CreditInput) -> CreditOutput:
    """Run the configured estimator, then the optional anchor, the final clip, and the step mask.

    1. ``fn(inp, opts, cfg)`` of ``cfg.name`` with its options built from ``cfg.options`` → relative advantages
       (B, T);
    2. if ``cfg.anchor == "adae"``: Â = ω·(A + k·Q·1[j<K]) (``vgpo.apply_adae_anchor``, §5.5, options from
       ``cfg.anchor_options``);
    3. clip to ±``cfg.adv_clip`` (Flow-GRPO ``adv_clip_max``, §3.2);
    4. steps with ``step_mask`` False get exactly 0.

    Args:
        cfg: CreditCfg.
        inp: CreditInput; see ``needs_step_rewards`` / ``needs_instant_rewards`` for what must be filled.

    Returns:
        CreditOutput: advantages (B, T) fp32; the estimator's stats plus ``adv_mean``, ``adv_std``, ``adv_abs_max``,
        ``adv_clip_frac`` over trained steps (plus the anchor's TCRM stats and ``abs_share``); the estimator's new
        state.
    """
    cfg.validate()
    spec = spec_of(cfg.name)
    opts = CREDIT.options(spec, cfg.options)
    anchor = ANCHORS.spec(cfg.anchor)
    anchor_opts = ANCHORS.options(anchor, cfg.anchor_options)
    _check_input(cfg, inp)
    out = spec.fn(inp, opts, cfg)
    adv = out.advantages
    shape = (inp.batch_size, inp.num_steps)
    if tuple(adv.shape) != shape:
        raise ValueError(
            f"Credit estimator {cfg.name!r} returned advantages of shape {tuple(adv.shape)}; expected (B, T) = "
            f"{shape}."
        )
    stats = dict(out.stats)
    if anchor.fn is not None:
        adv, anchor_stats = anchor.fn(adv, inp, anchor_opts, cfg)
        stats.update(anchor_stats)
    keep = inp.step_mask.to(device=adv.device, dtype=torch.bool)[None, :].expand_as(adv)
    kept = adv[keep]
    if cfg.adv_clip is not None:
        stats["adv_clip_frac"] = float((kept.abs() > cfg.adv_clip).float().mean()) if kept.numel() else 0.0
        adv = adv.clamp(-cfg.adv_clip, cfg.adv_clip)
    adv = torch.where(keep, adv, torch.zeros_like(adv)).float()
    kept = adv[keep]
    if kept.numel():
        stats.update(
            adv_mean=float(kept.mean()), adv_std=float(kept.std(correction=0)), adv_abs_max=float(kept.abs().max())
        )
    return CreditOutput(advantages=adv, stats=stats, state=out.state)
