"""The `Objective` protocol and its registry: what the trainer's update minimises for a micro-batch of pairs.

A *pair* is (sample b, rollout step j) with its advantage A[b, j] (B, T) from the credit estimator. The trainer
plans which pairs each optimizer step trains (`trainer/distributed.plan_update`), accumulates gradients over
micro-batches and steps the optimizer; an objective only says, for one micro-batch, what the loss of each pair is:

    prepare(ctx, pairs)          once per update, before any optimizer step (e.g. π_old predictions, fresh noise)
    loss(ctx, bi, ji, adv)       (n,) per-pair losses with grad + summed statistics

Objectives (ALGORITHMS.md §3, §9):
- `grpo` (objectives/grpo.py): PPO-clip on the SDE step log-probs + Gaussian KL to π_ref (Flow-GRPO §3).
- `nft` (objectives/nft.py): DiffusionNFT's implicit positive/negative velocities on the forward process.
- `awm` (objectives/awm.py): Advantage Weighted Matching, PPO-clip with the flow-matching loss as log-likelihood.

Adding an objective = one file with a class and its options dataclass + `register_objective(...)` (the registry
`OBJECTIVES` is a `config.registry.Registry`, like credit methods, samplers and model families); the config says
`objective: {name: NAME, options: {...}}` and the loader checks the options against the dataclass with the rules of
every other key (unknown keys with a suggestion, types, choices, ranges; the key, file:line or override, the fix).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..config.registry import Registry, Spec
from ..types import Trajectory


@dataclass
class LossContext:
    """What a loss may read: the policy, the rollout, its conditioning, and the reference policy.

    Attributes:
        model: the FlowModel being trained (its `velocity` is called through `samplers.policy.policy_velocity`).
        traj: the rollout: latents (B, T+1, *latent), timesteps (T+1,), log_probs (B, T), step_mask (T,).
        cond / uncond: prompt conditioning of the B rows (uncond None without CFG).
        guidance: CFG scale used in rollout AND loss.
        params: the rollout's sampler (config.schema.SamplerParams: the run's `sampler` section).
        reference: zero-argument callable returning a context manager that yields π_ref (a frozen copy or the LoRA
            model with its adapter disabled).
        on_policy: one pass and one optimizer step per rollout batch, so θ_old = θ at every loss evaluation.
        seed / iteration: for objectives that draw noise (seeded per run and iteration, so a resume redraws it).
        kl_beta: optim.kl_beta, the weight of the KL to π_ref (0 = no reference forward).
        micro_batch: optim.micro_batch, pairs per forward of a no-grad pass in `prepare`.
        ref_offload: trainer/distributed.ReferenceOffload (optim.offload_reference), used by `grpo` only.
        row_start / batch_global: this rank's first row in the global batch and the global batch size (0 = the
            rows are the whole batch): draws over the global batch keep 1 and N processes alike.
        old_policy: None (π_old = θ at the start of the update), or a zero-argument callable returning a context
            manager within which `model` holds π_old's weights (nft's old_policy=soft, `trainer/harness.SoftOldPolicy`;
            π_old then differs from θ even on-policy, so v_old is computed with it in `prepare`).
        kl_base_beta: optim.kl_base_beta, the weight of a second KL term to the INITIAL weights next to the one to
            `reference` (0 = none; nft / awm, `forward.ForwardProcess.base_kl`; AWM's base-model KL `train.beta`).
        base_reference: None, or a zero-argument callable returning a context manager that yields the initial
            weights (the LoRA model with its adapter disabled, `model.reference()`, or a frozen copy).
    """

    model: Any
    traj: Trajectory
    cond: Any
    uncond: Any
    guidance: float
    params: Any
    reference: Callable[[], Any]
    on_policy: bool
    seed: int
    iteration: int
    kl_beta: float
    micro_batch: int = 64
    ref_offload: Any = None
    row_start: int = 0
    batch_global: int = 0
    old_policy: Callable[[], Any] | None = None
    kl_base_beta: float = 0.0
    base_reference: Callable[[], Any] | None = None


@dataclass
class LossOut:
    """Per-pair losses of one micro-batch and its statistics.

    Attributes:
        loss: (n,) fp32 per-pair loss with grad; the trainer sums it over the micro-batch and divides by the
            optimizer step's global pair count.
        sums: statistic name → sum over the n pairs (float); the trainer reports Σ / number of trained pairs.
        maxes: statistic name → max over the pairs (float), e.g. the log-prob parity of the rollout.
        nfe: model forward-images spent besides the policy forward/backward (reference or π_old forwards).
    """

    loss: Tensor
    sums: dict[str, float]
    maxes: dict[str, float] = dataclasses.field(default_factory=dict)
    nfe: int = 0


class Objective(Protocol):
    """One training objective. Instances are built once per run from their options dataclass.

    Optional attribute: `shares_steps_in_group` (bool, default False when absent): the trainer then plans the same
    trained steps for every member of a prompt group (nft's `crn`, ALGORITHMS.md §9.1).
    Optional attribute: `old_policy_decay` ((rate, max, flat) or None when absent): the trainer then keeps π_old as a
    soft-updated copy of the trainable weights (`trainer/harness.SoftOldPolicy`, nft's old_policy=soft) that samples
    the rollouts and is passed to the loss as `LossContext.old_policy`.
    Optional method: `start_step(ctx, pairs)`, called before each optimizer step with every rank's (global row, step)
    pairs of that step in the plan's order (`trainer/distributed.Chunk.pairs`), for draws that must not depend on the
    process layout (the KL subset of nft / awm, `objectives/forward.ForwardProcess.start_step`).
    """

    #: True when the loss needs the SDE step log-probs of the rollout (the rollout must have σ > 0 on trained steps).
    needs_log_probs: bool
    #: statistic names reported in `LossOut.sums` (the same on every rank, so they can be summed over ranks)
    sum_keys: tuple[str, ...]
    #: statistic names reported in `LossOut.maxes`
    max_keys: tuple[str, ...]

    def skip_zero_advantage(self, on_policy: bool, kl_beta: float) -> bool:
        """True when a pair with A = 0 has exactly zero gradient, so the trainer may skip its forward/backward."""
        ...

    def trained_steps(self, traj: Trajectory, timestep_fraction: float) -> Tensor:
        """(T,) bool: rollout steps whose pairs are trained."""
        ...

    def prepare(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> int:
        """Called once per update before any optimizer step with this rank's (row, step) pairs; returns its NFEs."""
        ...

    def loss(self, ctx: LossContext, bi: Tensor, ji: Tensor, adv: Tensor) -> LossOut:
        """bi, ji: (n,) long rows and steps of the pairs; adv: (n,) their advantages. Returns LossOut."""
        ...


def first_steps(num_steps: int, timestep_fraction: float) -> Tensor:
    """(T,) bool: j < int(T·timestep_fraction) (Flow-GRPO's `timestep_fraction`, ALGORITHMS.md §3.2)."""
    return torch.arange(num_steps) < int(num_steps * timestep_fraction)


OBJECTIVES = Registry("objective", "objective")  # name → build(options, train_cfg) + options dataclass


def register_objective(name: str, build: Callable[[Any, Any], Objective], options: type, help: str = "",
                       requires: tuple[str, ...] = ()) -> Spec:
    """Declare an objective once: `build(options_instance, train_cfg) -> Objective` (train_cfg: the run's
    TrainConfig, e.g. for optim.clip_range); `options` a dataclass whose fields all have defaults; `requires`:
    ("log_probs",) when the loss reads the rollout's SDE log-probs."""
    return OBJECTIVES.register(name, build, options, help=help, requires=tuple(requires))


def objective_spec(name: str) -> Spec:
    """The registered objective `name` (ValueError naming objective.name, the valid names and the closest)."""
    return OBJECTIVES.spec(name)


def objective_options(name: str, options: dict[str, Any] | None):
    """The options dataclass of objective `name` filled from `options`; an unknown key, a wrong type or choice and
    an out-of-range value are a one-line ConfigError naming `objective.options.KEY` (config/build.py rules)."""
    return OBJECTIVES.options(name, options)


def build_objective(name: str, options: dict[str, Any], train_cfg: Any = None) -> Objective:
    """The objective `name` built from its (checked) options and the run's TrainConfig."""
    spec = objective_spec(name)
    return spec.fn(OBJECTIVES.options(spec, options), train_cfg)
