"""Intermediate rewards of a rollout: what Stepwise-Flow-GRPO and VGPO credit reads besides the final reward.

    ρ_j  (B, T+1)  reward of the T′-substep x̂0 estimate of every state x^(j), ρ_T = R(x0)      Stepwise §4.1
    I_j  (B, T)    reward of the `instant_substeps` x̂0 estimate of the post-action state x^(j+1)  VGPO §5.2

Which of them a credit method needs is declared in its registry entry (`credit.registry.needs_step_rewards`,
`needs_instant_rewards`). The reward is passed as `score(images, prompts, metadata) -> (n,)` so the trainer's retries
and timeouts apply to every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from ..credit.registry import needs_instant_rewards, needs_step_rewards
from ..samplers.estimates import denoise_estimate, trajectory_estimates
from ..samplers.policy import nfe_per_sample
from ..types import Trajectory, cond_index

Score = Callable[[Tensor, list, list], Tensor]


def score_states(
    model, score: Score, x0_hat: Tensor, prompts: list, meta: list, gids: Tensor, shared_initial: bool,
    states: Tensor | None = None,
) -> tuple[Tensor, int]:
    """Rewards of decoded x̂0 estimates. x0_hat: (B, T, *latent) for states j = 0..T−1; states: (B, T) bool, the
    states to score (the others get 0), or None: all.

    Returns ((B, T), reward calls).

    With a shared x_T (`shared_initial`) state 0 is the same within a group and is scored once per group.
    """
    B, T = x0_hat.shape[:2]
    flat = x0_hat.reshape(B * T, *x0_hat.shape[2:])
    want = torch.ones(B, T, dtype=torch.bool) if states is None else states.cpu().bool()
    first: dict[int, int] = {}
    if shared_initial:
        for b in range(B):
            first.setdefault(int(gids[b]), b)
        group_needs_0 = {int(gids[b]) for b in range(B) if want[b, 0]}
        keep = [b * T + j for b in range(B) for j in range(T)
                if (j > 0 and want[b, j]) or (j == 0 and first[int(gids[b])] == b and int(gids[b]) in group_needs_0)]
    else:
        keep = [b * T + j for b in range(B) for j in range(T) if want[b, j]]
    scores = torch.zeros(B * T)
    scores[keep] = score(model.decode(flat[keep]), [prompts[k // T] for k in keep], [meta[k // T] for k in keep])
    if shared_initial:
        for b in range(B):
            scores[b * T] = scores[first[int(gids[b])] * T] if want[b, 0] else 0.0
    return scores.view(B, T), len(keep)


def instant_rewards(model, score: Score, traj: Trajectory, cond, uncond, guidance: float, prompts: list, meta: list,
                    substeps: int, chunk: int) -> tuple[Tensor, dict[str, int]]:
    """VGPO instant rewards I_j (B, T) from x̂0 of the post-action states x^(1) … x^(T−1) (I_{T−1} = R(x0)).

    The first substep reuses the rollout's velocity of the state when the trajectory kept them (0 extra NFEs for
    one-step Tweedie). Returns (I, {"calls", "nfe"}).
    """
    B, T = traj.batch_size, traj.num_steps
    flat = traj.latents[:, 1:T].reshape(B * (T - 1), *traj.latents.shape[2:])
    tt = traj.timesteps[1:T].repeat(B)
    rows = torch.arange(B).repeat_interleave(T - 1)
    v_first = traj.velocities[:, 1:T].reshape_as(flat) if traj.velocities is not None else None
    x0 = []
    for s in range(0, flat.shape[0], chunk):
        sl, r = slice(s, s + chunk), rows[s : s + chunk]
        u = cond_index(uncond, r) if uncond is not None else None
        x0.append(denoise_estimate(model, flat[sl], tt[sl], cond_index(cond, r), u, guidance, substeps,
                                   v_first=v_first[sl] if v_first is not None else None))
    sc = score(model.decode(torch.cat(x0)), [prompts[int(r)] for r in rows], [meta[int(r)] for r in rows])
    rewards = traj.rewards
    assert rewards is not None, "the rollout is scored before its intermediate rewards"
    inst = torch.cat([sc.view(B, T - 1), rewards[:, None]], dim=1)
    nfe = flat.shape[0] * (substeps - (1 if v_first is not None else 0)) * nfe_per_sample(uncond, guidance)
    return inst, {"calls": flat.shape[0], "nfe": nfe}


def drawn_mask(pairs: list[tuple[int, int]], batch: int, num_steps: int) -> tuple[Tensor, Tensor]:
    """(pairs (batch, T) bool, states (batch, T) bool): the drawn (row, step j) pairs and the states x^(j), x^(j+1),
    j + 1 < T, their gains need (ρ_T = R(x0) is always known)."""
    m = torch.zeros(batch, num_steps, dtype=torch.bool)
    for b, j in pairs:
        m[b, j] = True
    states = m.clone()
    states[:, 1:] |= m[:, :-1]
    return m, states


@dataclasses.dataclass
class EstimateCounts:
    """What the x̂0 estimates of one iteration cost on this rank: images scored and model evaluations."""

    calls: int = 0
    nfe: int = 0


def intermediate_rewards(
    model, score: Score, traj: Trajectory, cond, uncond, cfg, prompts: list, meta: list, gids: Tensor, timer,
    states: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, EstimateCounts]:
    """ρ (B, T+1) and/or I (B, T) as the credit method `cfg.credit` needs them (None otherwise) and their counts.

    I is left None when ρ was computed with the same number of substeps: the credit then uses ρ_{j+1}. states:
    (B, T) bool, the states x^(j), j < T, whose ρ_j is needed (stepwise states=drawn; the others hold 0), or None.
    """
    guidance, est_cfg = cfg.sampler.guidance_scale, cfg.estimate
    counts = EstimateCounts()
    step_rewards = instant = None
    if needs_step_rewards(cfg.credit):
        with timer("estimates"):
            est = trajectory_estimates(
                model, traj, cond, uncond, guidance, est_cfg.substeps, est_cfg.chunk_size, cfg.shared_noise, states
            )
        counts.nfe += est.nfe
        with timer("estimate_rewards"):
            rho, calls = score_states(model, score, est.x0_hat[:, :-1], prompts, meta, gids, cfg.shared_noise,
                                      states)
            rewards = traj.rewards
            assert rewards is not None, "the rollout is scored before its intermediate rewards"
            step_rewards = torch.cat([rho, rewards[:, None]], dim=1)  # ρ_T = R(x0)
        counts.calls += calls
        traj.step_rewards = step_rewards
    same_substeps = step_rewards is not None and est_cfg.substeps == est_cfg.instant_substeps
    if needs_instant_rewards(cfg.credit) and not same_substeps:
        with timer("estimates"):
            instant, n = instant_rewards(
                model, score, traj, cond, uncond, guidance, prompts, meta, est_cfg.instant_substeps, est_cfg.chunk_size
            )
        counts.calls += n["calls"]
        counts.nfe += n["nfe"]
    return step_rewards, instant, counts
