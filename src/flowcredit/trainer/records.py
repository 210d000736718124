"""The typed records one iteration's phases return (`trainer/loop.py: Trainer.train_step`).

    rollout  → Rollout       prompts, conditioning, the trajectory (latents, log-probs, trained-step mask)
    reward   → Scores        R(x0), the decoded images, x̂0 step / instant rewards when the credit needs them
    credit   → Credit        advantages (B, T), or what was non-finite
    update   → UpdateStats   what the optimizer steps did (pairs, loss, gradient norm, the objective's statistics)

`Iteration` holds the four with the phase times and flattens them into one metrics.jsonl line (`metrics()`); no
phase reads another phase's statistics. `UpdatePlan` is the update in progress: the planned (sample, step) pairs of
every optimizer step and the sums the steps accumulate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..objectives import LossContext
from ..types import Trajectory
from .distributed import Chunk


@dataclasses.dataclass
class Rollout:
    """This rank's rows of one iteration: prompts, their metadata and global group ids (B,), the conditioning (cond,
    uncond: the model's prompt encodings, uncond None without CFG), the trajectory and its model evaluations."""

    prompts: list[str]
    meta: list[Any]
    gids: torch.Tensor  # (B,) int64, global group ids
    cond: Any
    uncond: Any
    traj: Trajectory
    nfe: int  # this rank's rollout NFEs: B · T · (2 with CFG)


@dataclasses.dataclass
class Scores:
    """The rewards of one iteration (Stepwise §4.1 / VGPO §5.2 step rewards when the credit requires them)."""

    images: torch.Tensor  # (B, 3, H, W) in [0, 1], or a video model's (B, F, 3, H, W)
    rewards: torch.Tensor  # (B_global,) R(x0), gathered over the ranks
    step_rewards: torch.Tensor | None  # (B, T+1) ρ_j of this rank's rows, ρ_T = R(x0); None when not needed
    instant: torch.Tensor | None  # (B, T) VGPO's instant rewards I_j; None when not needed (or = ρ_{j+1})
    reward_calls: int  # this rank's images scored (final + estimates)
    nfe_estimates: int | None  # this rank's NFEs of the x̂0 estimates; None when none were made
    stats: dict[str, float]  # reward_mean, reward_std, diversity, <component>_mean (global batch)
    gain_mask: torch.Tensor | None = None  # (B_global, T) bool: the drawn pairs whose gains were estimated; None: all


@dataclasses.dataclass
class Credit:
    """The advantages of this rank's rows, or the name of the non-finite input that stopped the credit."""

    advantages: torch.Tensor | None  # (B, T) float32; None when `nonfinite` is set
    nonfinite: str | None
    stats: dict[str, float | list[float]]  # the estimator's statistics (per-step lists too), logged as credit/<name>


@dataclasses.dataclass
class UpdateStats:
    """What the update did. `loss` is Σ pair losses / the planned pairs (optim.loss_mean), the objective's sums over
    the computed pairs, its maxes over every rank; fields left None were not measured (nothing was trained)."""

    pairs_trained: int  # pairs whose loss was computed (global)
    pairs_planned: int | None = None  # the loss denominator (global)
    nfe: int = 0  # this rank's update NFEs (forward + backward counted as 2)
    lr: float | None = None  # the scheduled learning rate (None: constant, untouched)
    loss: float | None = None
    objective: dict[str, float] = dataclasses.field(default_factory=dict)  # ratio_mean, clipfrac, kl, ...
    grad_norm: float | None = None
    skipped_update: int = 0  # optimizer steps skipped (non-finite or nothing to train)
    nonfinite: dict[str, Any] = dataclasses.field(default_factory=dict)  # nonfinite_skipped / nonfinite_reason
    old_policy_decay: float | None = None  # nft old_policy=soft: the decay of this iteration's soft update


@dataclasses.dataclass
class UpdatePlan:
    """An update in progress: the context of every pair's loss, this rank's advantages, the optimizer steps' pairs
    (`epochs[e][u]`: a `distributed.Chunk`, one optimizer step) and what the steps accumulate."""

    ctx: LossContext | None  # None when no pair is trained
    adv: torch.Tensor  # (B, T) this rank's advantages
    epochs: list[list[Chunk]]
    n_planned: int  # the loss denominator per epoch (global)
    n_computed: int  # pairs whose loss is computed (global)
    lr: float | None
    nfe: int = 0
    sums: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "loss", the objective's sum/max keys
    skipped: int = 0
    nonfinite: dict[str, Any] = dataclasses.field(default_factory=dict)

    def steps(self) -> list[Chunk]:
        """The optimizer steps in order (every inner epoch's updates)."""
        return [chunk for chunks in self.epochs for chunk in chunks]

    def add(self, key: str, value: float) -> None:
        self.sums.setdefault(key, []).append(value)

    def summary(self, sum_over_ranks, max_over_ranks, sum_keys: tuple[str, ...], max_keys: tuple[str, ...],
                inner_epochs: int) -> UpdateStats:
        """UpdateStats from the accumulated sums; `sum_over_ranks` / `max_over_ranks`: `Dist.sum` / `Dist.max`."""
        out = UpdateStats(pairs_trained=self.n_computed, pairs_planned=self.n_planned, nfe=self.nfe, lr=self.lr,
                          skipped_update=self.skipped, nonfinite=self.nonfinite)
        if self.ctx is None:  # nothing to train: the objective's statistics are those of an untouched policy
            out.loss, out.grad_norm, out.skipped_update = 0.0, 0.0, 1
            out.objective = dict.fromkeys(sum_keys + max_keys, 0.0)
            if "ratio_mean" in sum_keys:
                out.objective["ratio_mean"] = 1.0
            return out
        keys = ("loss",) + tuple(sum_keys)
        totals = sum_over_ranks([sum(self.sums.get(k, [0.0])) for k in keys])  # Σ over ranks
        for k, v in zip(keys, totals):
            # the loss over the pairs of its denominator (optim.loss_mean; a skipped pair's loss is exactly 0), the
            # diagnostics (ratio, clip fraction, KL) over the pairs that were computed
            mean = v / ((self.n_planned if k == "loss" else self.n_computed) * inner_epochs)
            if k == "loss":
                out.loss = mean
            else:
                out.objective[k] = mean
        out.grad_norm = float(np.mean(self.sums.get("grad_norm", [0.0])))
        for k in max_keys:
            out.objective[k] = max_over_ranks([max(self.sums.get(k, [0.0]))])[0]
        return out


@dataclasses.dataclass
class Iteration:
    """One finished iteration: its phases' records, the phase times (s) and the rollout/reward/estimate/update
    counts summed over the ranks (`counts`)."""

    rollout: Rollout
    scores: Scores
    credit: Credit
    update: UpdateStats
    seconds: dict[str, float]
    counts: dict[str, int]  # nfe_rollout, reward_calls, nfe_estimates (when made), nfe_update: Σ over ranks

    def metrics(self) -> dict[str, Any]:
        """The metrics.jsonl record of this iteration (without "iteration", which the logger adds)."""
        s, u = self.scores, self.update
        m: dict[str, Any] = {"nfe_rollout": self.counts["nfe_rollout"], "reward_calls": self.counts["reward_calls"]}
        m.update(s.stats)
        if "nfe_estimates" in self.counts:
            m["nfe_estimates"] = self.counts["nfe_estimates"]
        m.update({f"credit/{k}": v for k, v in self.credit.stats.items()})
        m["pairs_trained"] = u.pairs_trained
        optional = {"pairs_planned": u.pairs_planned, "lr": u.lr, "loss": u.loss}
        m.update({k: v for k, v in optional.items() if v is not None})
        m.update(u.objective)
        if u.grad_norm is not None:
            m["grad_norm"] = u.grad_norm
        if u.skipped_update:
            m["skipped_update"] = u.skipped_update
        m.update(u.nonfinite)
        m["nfe_update"] = self.counts["nfe_update"]
        if u.old_policy_decay is not None:
            m["old_policy_decay"] = u.old_policy_decay
        m["seconds"] = self.seconds
        m["seconds_total"] = sum(self.seconds.values())
        return m
