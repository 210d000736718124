"""Registry of credit estimators and the one entry point the trainer calls, ``assign_credit``.

Reading ``CREDIT`` tells you every built-in estimator (STYLE.md R4): a literal dict from name to
``"module:function"``; modules are imported only when resolved. A ``"package.module:function"`` path is accepted
as the plugin escape hatch. Every estimator has the signature ``(CreditInput, CreditCfg) -> CreditOutput``.

Notation: B batch, T steps (see ``flowcredit.credit.base``).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

import torch

from flowcredit.credit.base import CreditCfg, CreditInput, CreditOutput

CREDIT: dict[str, str] = {
    "flow_grpo": "flowcredit.credit.group:flow_grpo_advantages",  # §3.2 group-relative terminal reward
    "stepwise": "flowcredit.credit.stepwise:stepwise_advantages",  # §4 normalized per-step reward gains
    "vgpo": "flowcredit.credit.vgpo:vgpo_advantages",  # §5 TCRM value + ADAE absolute anchor
}


# estimators registered at run time (`register_credit`): a plugin or a test adds one without touching this file
_REGISTERED: dict[str, Callable[[CreditInput, CreditCfg], CreditOutput]] = {}


def register_credit(
    name: str, fn: Callable[[CreditInput, CreditCfg], CreditOutput], requires: tuple[str, ...] = ()
) -> None:
    """Register estimator `fn` under `name` (then `credit.name=NAME`, with `method=custom`).

    Args:
        name: the config name; must not shadow a built-in.
        fn: (CreditInput, CreditCfg) -> CreditOutput with advantages (B, T).
        requires: what the trainer must compute for it: "step_rewards" (ρ_j of x̂0 estimates, (B, T+1)) and/or
            "instant_rewards" (I_j, (B, T)); stored as `fn.requires`.
    """
    if name in CREDIT:
        raise ValueError(f"credit estimator {name!r} is built in; register under another name")
    if requires:
        fn.requires = tuple(requires)  # type: ignore[attr-defined]
    _REGISTERED[name] = fn


def names() -> list[str]:
    """The registered estimator names."""
    return list(CREDIT) + list(_REGISTERED)


def resolve(name: str) -> Callable[[CreditInput, CreditCfg], CreditOutput]:
    """Return the estimator function for a registered name or a ``"package.module:function"`` path.

    Raises:
        ValueError: unknown name (the message lists the valid names and suggests the closest), or a malformed path.
        ImportError / AttributeError: the module or function of a path does not exist.
    """
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in CREDIT:
        target = CREDIT[name]
    elif ":" in name:
        target = name
    else:
        close = difflib.get_close_matches(name, names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown credit estimator {name!r}. Valid names: {', '.join(names())}; or give a "
            f"'package.module:function' path.{hint}"
        )
    module_name, _, func_name = target.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"Credit estimator path {target!r} must look like 'package.module:function'.")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, func_name)
    except AttributeError as err:
        raise AttributeError(
            f"Module {module_name!r} has no credit estimator {func_name!r} (from {target!r})."
        ) from err


def _requires(cfg: CreditCfg) -> tuple[str, ...]:
    return tuple(getattr(resolve(cfg.name), "requires", ()))


def needs_step_rewards(cfg: CreditCfg) -> bool:
    """Whether the trainer must compute ρ_j (B, T+1) = rewards of the T′-substep x̂0 of every state (§4.1)."""
    return "step_rewards" in _requires(cfg)


def needs_instant_rewards(cfg: CreditCfg) -> bool:
    """Whether the estimator or the ADAE anchor reads the instant rewards I_j (B, T) (§5.2).

    The trainer may satisfy it either with ``CreditInput.instant_rewards`` (one-step Tweedie of x^(j+1), VGPO's
    definition) or, when ``needs_step_rewards`` already makes it compute ρ, by leaving ``instant_rewards`` None:
    ρ_{j+1} is then used (identical for T′ = 1).
    """
    return "instant_rewards" in _requires(cfg) or cfg.anchor == "adae"


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
    """Run the configured estimator, then the optional ADAE anchor, the final clip, and the step mask.

    1. ``resolve(cfg.name)(inp, cfg)`` → relative advantages (B, T);
    2. if ``cfg.anchor == "adae"``: Â = ω·(A + k·Q·1[j<K]) (``vgpo.apply_adae_anchor``, §5.5);
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
    _check_input(cfg, inp)
    out = resolve(cfg.name)(inp, cfg)
    adv = out.advantages
    shape = (inp.batch_size, inp.num_steps)
    if tuple(adv.shape) != shape:
        raise ValueError(
            f"Credit estimator {cfg.name!r} returned advantages of shape {tuple(adv.shape)}; expected (B, T) = "
            f"{shape}."
        )
    stats = dict(out.stats)
    if cfg.anchor == "adae":
        from flowcredit.credit.vgpo import apply_adae_anchor  # local: vgpo is only needed for the anchor

        adv, anchor_stats = apply_adae_anchor(adv, inp, cfg)
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
