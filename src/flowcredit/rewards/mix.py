"""Weighted reward mixing (e.g. Stepwise's OCR mix `0.8*ocr + 0.2*pickscore`), optionally normalizing each component
before the weighted sum (GDPO-style), with every component logged separately.

Normalization modes (`normalize=`):
- ``"none"`` / False: scores = Σ_k w_k · s_k (flow_grpo's `multi_score`).
- ``"batch"`` / True: each s_k is z-scored over the batch of the call.
- ``"group"``: each s_k is z-scored within each prompt group (GDPO: Group reward-Decoupled normalization, Liu et
  al. 2026), using the `group_ids` keyword the trainer may pass; falls back to "batch" without it. A group whose
  component has zero spread contributes 0 for that component.
- ``"running"``: each s_k is standardized with running (Welford) mean/std over every score seen so far. Use this
  when the same reward also scores intermediate x̂0 estimates (Stepwise / VGPO step rewards): per-call z-scores
  make ρ_j of different calls incomparable, running statistics do not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from .base import Reward, RewardOutput, check_output

MODES = ("none", "batch", "group", "running")


def _mode(normalize: bool | str | None) -> str:
    if normalize is None or normalize is False:
        return "none"
    if normalize is True:
        return "batch"
    if normalize in MODES:
        return str(normalize)
    raise ValueError(f"mix normalize must be one of {MODES} (or true/false), got {normalize!r}")


_NUM = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
_NAME = r"[A-Za-z_][\w.]*(?::[A-Za-z_][\w.]*)?"
_TERM = re.compile(rf"\s*([-+])?\s*(?:({_NUM})\s*\*\s*({_NAME})|({_NAME})\s*\*\s*({_NUM})|({_NAME}))\s*")


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """Parse ``"0.8*ocr + 0.2*pickscore"`` → [("ocr", 0.8), ("pickscore", 0.2)].

    Terms are ``w*name``, ``name*w`` or ``name`` (weight 1), joined by ``+`` or ``-`` (negates the weight). Names may
    be registry names or ``module:Class`` paths. Raises ValueError with the position of the first unparsable text.
    """
    out: list[tuple[str, float]] = []
    pos, first = 0, True
    spec = spec.strip()
    if not spec:
        raise ValueError("empty reward mix spec")
    while pos < len(spec):
        m = _TERM.match(spec, pos)
        if not m or m.end() == pos or (not first and m.group(1) is None):
            raise ValueError(
                f"cannot parse reward mix {spec!r} at position {pos}: {spec[pos : pos + 20]!r} (expected e.g. "
                "'0.8*ocr + 0.2*pickscore')"
            )
        sign = -1.0 if m.group(1) == "-" else 1.0
        if m.group(3):
            name, w = m.group(3), float(m.group(2))
        elif m.group(4):
            name, w = m.group(4), float(m.group(5))
        else:
            name, w = m.group(6), 1.0
        out.append((name, sign * w))
        pos, first = m.end(), False
    return out


class _Running:
    """Welford running mean / variance of one component."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, x: Tensor) -> None:
        for v in x.double().tolist():
            self.n += 1
            d = v - self.mean
            self.mean += d / self.n
            self.m2 += d * (v - self.mean)

    @property
    def std(self) -> float:
        return (self.m2 / self.n) ** 0.5 if self.n > 1 else 0.0


class MixedReward(Reward):
    """scores = Σ_k w_k · n_k(s_k), where s_k is reward k's score and n_k the normalization (see module docstring).

    Components logged: ``<label>`` (raw score of reward k), ``<label>/<sub>`` (its own components), and for
    normalized mixes ``<label>/norm`` (the value that entered the sum). Labels are the rewards' names (or the
    `labels` given), made unique with ``#2``, ``#3``.

    Args:
        parts: (reward, weight) pairs.
        normalize: "none" | "batch" | "group" | "running", or a bool (True = "batch").
        eps: added to the std.
        parallel: score the components concurrently on threads (worth it when one is remote or a VLM).
        labels: optional component labels.
    """

    name = "mix"

    def __init__(
        self,
        parts: Sequence[tuple[Any, float]],
        normalize: bool | str = False,
        eps: float = 1e-6,
        parallel: bool = False,
        labels: Sequence[str] | None = None,
    ):
        if not parts:
            raise ValueError("a mixed reward needs at least one component")
        self.parts = [(fn, float(w)) for fn, w in parts]
        self.mode = _mode(normalize)
        self.normalize = self.mode != "none"
        self.batch_dependent = self.normalize  # a score depends on the rest of the batch (servers must not split it)
        self.eps = eps
        self.parallel = parallel
        raw = list(labels) if labels is not None else [getattr(fn, "name", type(fn).__name__) for fn, _ in self.parts]
        if len(raw) != len(self.parts):
            raise ValueError(f"{len(raw)} labels for {len(self.parts)} mix components")
        seen: dict[str, int] = {}
        self.labels = []
        for lab in raw:
            seen[lab] = seen.get(lab, 0) + 1
            self.labels.append(lab if seen[lab] == 1 else f"{lab}#{seen[lab]}")
        self._running = [_Running() for _ in self.parts]
        self._pool: ThreadPoolExecutor | None = None

    def check_prompts(self, metadata: Sequence[dict[str, Any]], source: str) -> None:
        """Each component's own prompt check (e.g. `shapes` needs GenEval metadata), before training."""
        for fn, _ in self.parts:
            check = getattr(fn, "check_prompts", None)
            if callable(check):
                check(metadata, source)

    def describe(self) -> str:
        terms = " + ".join(f"{w:g}*{lab}" for (_, w), lab in zip(self.parts, self.labels))
        return terms + ("" if self.mode == "none" else f" (normalize={self.mode})")

    def _normalized(self, k: int, s: Tensor, group_ids: Tensor | None) -> Tensor:
        if self.mode == "none":
            return s
        if self.mode == "running":
            st = self._running[k]
            st.update(s)
            return (s - st.mean) / (st.std + self.eps)
        if self.mode == "group" and group_ids is not None:
            g = torch.as_tensor(group_ids).reshape(-1)
            out = torch.zeros_like(s)
            for gid in torch.unique(g):
                idx = g == gid
                x = s[idx]
                out[idx] = (x - x.mean()) / (x.std(unbiased=False) + self.eps)
            return out
        return (s - s.mean()) / (s.std(unbiased=False) + self.eps)

    def _score_all(self, images, prompts, metadata, meta) -> list[RewardOutput]:
        b = images.shape[0]
        if not self.parallel or len(self.parts) == 1:
            return [
                check_output(lab, fn(images, prompts, metadata, **meta), b)
                for (fn, _), lab in zip(self.parts, self.labels)
            ]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self.parts), thread_name_prefix="mix")
        futs = [self._pool.submit(fn, images, prompts, metadata, **meta) for fn, _ in self.parts]
        return [check_output(lab, f.result(), b) for f, lab in zip(futs, self.labels)]

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        group_ids = meta.get("group_ids")
        outs = self._score_all(images, prompts, metadata, meta)
        total = torch.zeros(images.shape[0])
        comps: dict[str, Tensor] = {}
        info: dict[str, Any] = {}
        for k, (((_, w), lab), out) in enumerate(zip(zip(self.parts, self.labels), outs)):
            s = out.scores.float()
            comps[lab] = s
            for sub, v in out.components.items():
                comps[f"{lab}/{sub}"] = v
            for key in ("results", "reasons"):
                if key in out.info and key not in info:
                    info[key] = out.info[key]
            info[lab] = out.info
            n = self._normalized(k, s, group_ids)
            if self.mode != "none":
                comps[f"{lab}/norm"] = n
            total = total + w * n
        return RewardOutput(total, comps, info)

    def close(self) -> None:
        for fn, _ in self.parts:
            if hasattr(fn, "close"):
                fn.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def build_mix(
    components: Sequence[Mapping[str, Any] | str] | str | None = None,
    spec: str | None = None,
    normalize: bool | str = False,
    parallel: bool = False,
    eps: float = 1e-6,
) -> MixedReward:
    """Registry factory for ``mix``: build the component rewards by name and mix them.

    Args:
        components: list of ``{name, weight=1.0, options={}, label=None}`` dicts (what `RewardCfg.components` holds),
            or a spec string for `parse_mix`.
        spec: alternatively a spec string, e.g. ``"0.8*ocr + 0.2*pickscore"``.
        normalize, parallel, eps: see `MixedReward`.
    """
    from .registry import build_reward

    if isinstance(components, str):
        spec, components = components, None
    if (components is None) == (spec is None):
        raise ValueError("reward 'mix' needs exactly one of components=[{name, weight}, ...] or spec='0.8*a + 0.2*b'")
    items: list[dict[str, Any]] = []
    if spec is not None:
        items = [{"name": n, "weight": w} for n, w in parse_mix(spec)]
    else:
        assert components is not None  # exactly one of components / spec
        for c in components:
            if isinstance(c, str):
                items += [{"name": n, "weight": w} for n, w in parse_mix(c)]
            elif isinstance(c, Mapping) or hasattr(c, "name"):
                get = c.get if isinstance(c, Mapping) else (lambda k, d=None, c=c: getattr(c, k, d))
                extra = set(c) - {"name", "weight", "options", "label"} if isinstance(c, Mapping) else set()
                if extra:
                    raise ValueError(
                        f"mix component {dict(c)} has unknown keys {sorted(extra)} (use name, weight, options, label)"
                    )
                items.append(
                    {
                        "name": get("name"),
                        "weight": float(get("weight", 1.0)),
                        "options": get("options") or {},
                        "label": get("label"),
                    }
                )
            else:
                raise ValueError(f"mix component must be a dict or a spec string, got {c!r}")
    if any(it["name"] == "mix" for it in items):
        raise ValueError("a mix cannot contain another 'mix'")
    parts = [(build_reward(it["name"], **(it.get("options") or {})), it["weight"]) for it in items]
    labels = [it.get("label") or getattr(fn, "name", it["name"]) for it, (fn, _) in zip(items, parts)]
    return MixedReward(parts, normalize=normalize, eps=eps, parallel=parallel, labels=labels)
