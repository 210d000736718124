"""What the forward-process objectives (`nft`, `awm`) share: noising the model's own samples.

For a pair (b, j) with the rollout's final sample x0 = x^(T)[b] and the rollout-grid time t = t_j (ALGORITHMS.md §9.1):

    noise = fresh:    ε ~ N(0, I) drawn once per update,  x_t = (1 − t)·x0 + t·ε
    noise = rollout:  x_t = x^(j) (the rollout's own state), ε = (x_t − (1 − t)·x0) / t

so the flow-matching target is u = ε − x0 and the model's clean-image estimate is x̂0 = x_t − t·v.
Pairing the advantage A[b, j] with the grid time t_j is how per-step credit (stepwise gains, VGPO ω-weighted
advantages) weights a forward-process loss per timestep; a sample-level credit (flow_grpo) is constant over j.
DiffusionNFT (`scripts/train_nft_sd3.py`) and AWM (Flow-Factory `trainers/awm.py`) both train the rollout's grid
times with fresh noise; `noise=rollout` is our option for ODE rollouts, whose states lie on the policy's own path.

The rollout may be the ODE (no log-probs needed): the trained steps are the first int(T·timestep_fraction).
"""

from __future__ import annotations

import contextlib
from dataclasses import field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from ..samplers.policy import nfe_per_sample, policy_velocity
from ..types import Trajectory, cond_index
from .base import LossContext, first_steps

STREAM_FORWARD_NOISE = 0x4E4654  # derived_generator stream of the forward-process noise ("NFT")
STREAM_KL_PAIRS = 0x4B4C50  # the pairs whose KL term is estimated (kl_fraction < 1), "KLP"

NoiseMode = Literal["fresh", "rollout"]


def noise_generator(
    seed: int, iteration: int, group: int | None = None, stream: int = STREAM_FORWARD_NOISE
) -> torch.Generator:
    """CPU generator of the forward-process noise of one iteration (the same on every rank and every resume); with
    `group`, the generator of that prompt group's shared noise (crn); `stream` separates other per-update draws."""
    key = [int(seed) & 0xFFFFFFFF, int(stream), int(iteration)] + ([] if group is None else [int(group)])
    seq = np.random.SeedSequence(key)
    s = seq.generate_state(2, np.uint32)
    return torch.Generator(device="cpu").manual_seed(int(s[0]) << 31 ^ int(s[1]))


def base_kl_enabled(train_cfg: Any) -> bool:
    """Whether the run's optim.kl_base_beta > 0 (the second KL term, `ForwardProcess.base_kl`); False without a
    TrainConfig."""
    optim = getattr(train_cfg, "optim", None)
    return float(getattr(optim, "kl_base_beta", 0.0) or 0.0) > 0


def kl_fraction_field() -> Any:
    """The `kl_fraction` option of the forward-process objectives' options (see `ForwardProcess.velocity_kl`)."""
    return field(
        default=1.0,
        metadata={
            "help": "Fraction of the trained pairs that get a reference forward for the KL term (optim.kl_beta): a "
            "random subset of that size of each micro-batch, weighted by the inverse fraction, so the same penalty in "
            "expectation for that fraction of the reference forwards (1 = every pair).",
            "gt": 0,
            "le": 1,
        },
    )


class ForwardProcess:
    """Draws the per-update noise, builds x_t and keeps π_old's velocities for off-policy updates.

    Attributes:
        noise: "fresh" or "rollout".
        crn: common random numbers within a prompt group: every member is noised with the same ε at the same trained
            steps (`shares_steps_in_group`), so the part of the flow-matching gradient that does not depend on the
            sample cancels in Σ_b A_b ∇ℓ_b (group-centred advantages sum to 0). ALGORITHMS.md §9.1.
        kl_fraction: f, the fraction of pairs whose KL term is computed (`velocity_kl`); 1 = every pair.
        eps: (B, T, *latent) fresh noise of the current update (noise=fresh).
        v_old: (B, T, *latent) π_old's velocities where pairs are trained: θ at the start of the update (off-policy
            only) or the soft-updated old weights (`LossContext.old_policy`).
        kl_u: (B_global, T) uniform draws of this update that rank the pairs for the KL (kl_fraction < 1).
        kl_w: (B, T) KL weights of this rank's pairs in the current optimizer step (`start_step`): n/k for a pair in
            the KL subset of its block, 0 otherwise; None before `start_step` (each micro-batch is then its block).
    """

    def __init__(self, noise: NoiseMode, crn: bool = False, kl_fraction: float = 1.0):
        self.noise = noise
        self.crn = crn
        self.kl_fraction = kl_fraction
        self.eps: Tensor | None = None
        self.v_old: Tensor | None = None
        self.kl_u: Tensor | None = None
        self.kl_w: Tensor | None = None
        self.row_start = 0

    @staticmethod
    def trained_steps(traj: Trajectory, timestep_fraction: float) -> Tensor:
        """(T,) bool: j < int(T·timestep_fraction), whether the rollout step was stochastic or not."""
        return first_steps(traj.num_steps, timestep_fraction).to(traj.step_mask.device)

    def prepare(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> int:
        """Draw this update's noise (seeded by run seed and iteration) and, off-policy, π_old's velocities."""
        traj = ctx.traj
        lat = traj.latents
        self.eps = None
        B, start = lat.shape[0], ctx.row_start
        B_global = ctx.batch_global or B  # draws cover the GLOBAL batch; this rank keeps its rows
        self.row_start = start
        if self.noise == "fresh":
            shape = (B_global, traj.num_steps, *lat.shape[2:])
            if self.crn:  # one (T, *latent) draw per prompt group, whatever rank or row holds its members
                gids = traj.group_ids.tolist()
                per_group = {
                    g: torch.randn(shape[1:], generator=noise_generator(ctx.seed, ctx.iteration, g))
                    for g in sorted(set(gids))
                }
                eps = torch.stack([per_group[g] for g in gids])
            else:
                eps = torch.randn(shape, generator=noise_generator(ctx.seed, ctx.iteration), dtype=torch.float32)
                eps = eps[start : start + B]
            self.eps = eps.to(device=lat.device, dtype=lat.dtype)
        self.kl_u, self.kl_w = None, None
        if self.kl_fraction < 1:  # seeded like the noise: the same on every rank and resume
            gen = noise_generator(ctx.seed, ctx.iteration, stream=STREAM_KL_PAIRS)
            self.kl_u = torch.rand((B_global, traj.num_steps), generator=gen)
        self.v_old = None
        old_policy = getattr(ctx, "old_policy", None)  # (a hand-built context may lack it)
        if (ctx.on_policy and old_policy is None) or not pairs:
            return 0
        # π_old = θ at the start of the update, or the soft-updated old weights (ctx.old_policy): one no-grad pass over
        # every pair before the first optimizer step (π_old does not move during an update)
        self.v_old = torch.zeros_like(lat[:, :-1])
        uniq = sorted(set(pairs))
        old_weights = old_policy() if old_policy is not None else contextlib.nullcontext()
        with torch.no_grad(), old_weights:
            for s in range(0, len(uniq), ctx.micro_batch):
                bi = torch.tensor([p[0] for p in uniq[s : s + ctx.micro_batch]])
                ji = torch.tensor([p[1] for p in uniq[s : s + ctx.micro_batch]])
                x_t, t, _, _ = self.noised(ctx, bi, ji)
                self.v_old[bi, ji] = self.velocity(ctx, ctx.model, x_t, t, bi)
        return len(uniq) * nfe_per_sample(ctx.uncond, ctx.guidance)

    def noised(self, ctx: LossContext, bi: Tensor, ji: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x_t (n, *latent), t (n,), x0 (n, *latent), ε (n, *latent) of the pairs (bi, ji)."""
        traj = ctx.traj
        x0 = traj.latents[bi, -1]
        t = traj.timesteps[ji].to(x0.dtype)
        tb = t.view(-1, *([1] * (x0.dim() - 1)))
        if self.noise == "fresh":
            assert self.eps is not None, "ForwardProcess.prepare() draws the noise before any loss"
            eps = self.eps[bi, ji]
            x_t = (1 - tb) * x0 + tb * eps
        else:
            x_t = traj.latents[bi, ji]
            eps = (x_t - (1 - tb) * x0) / tb
        return x_t, t, x0, eps

    @staticmethod
    def velocity(ctx: LossContext, model, x_t: Tensor, t: Tensor, bi: Tensor) -> Tensor:
        """The ONE policy velocity (CFG as in the rollout) of `model` at (x_t, t) for rows bi: (n, *latent)."""
        c = cond_index(ctx.cond, bi)
        u = cond_index(ctx.uncond, bi) if ctx.uncond is not None else None
        return policy_velocity(model, x_t, t, c, u, ctx.guidance)

    def old_velocity(self, ctx: LossContext, v: Tensor, bi: Tensor, ji: Tensor) -> Tensor:
        """π_old's velocity of the pairs: v.detach() on-policy (θ_old = θ), else the one recorded in `prepare`."""
        return v.detach() if self.v_old is None else self.v_old[bi, ji]

    def _kl_block(self, u: Tensor) -> tuple[Tensor, float]:
        """(indices of the k pairs of a block of n with the smallest draws `u` (n,), in increasing u; n/k)."""
        n = u.shape[0]
        k = min(n, max(1, round(self.kl_fraction * n)))
        return torch.argsort(u)[:k], n / k

    def start_step(self, ctx: LossContext, pairs: list[tuple[int, int]]) -> None:
        """The KL subset of one optimizer step (kl_fraction < 1): its computed pairs (global row, step), in the plan's
        order, are cut into blocks of optim.micro_batch and each block's k = max(1, round(f·n)) pairs with the
        smallest draws get weight n/k (`kl_w`, this rank's rows). The blocks are the one-process micro-batches, so a
        single process computes exactly what a per-micro-batch draw computes, and N processes the same subset and
        weights, whichever rank computes a pair."""
        if self.kl_u is None:
            return
        B = ctx.traj.latents.shape[0]
        self.kl_w = torch.zeros(B, ctx.traj.num_steps)
        mb = max(1, ctx.micro_batch)
        for s in range(0, len(pairs), mb):
            block = pairs[s : s + mb]
            bg = torch.tensor([p[0] for p in block])
            jg = torch.tensor([p[1] for p in block])
            sel, w = self._kl_block(self.kl_u[bg, jg])
            local = bg[sel] - self.row_start
            keep = (local >= 0) & (local < B)
            self.kl_w[local[keep], jg[sel][keep]] = w

    def velocity_kl(
        self, ctx: LossContext, v: Tensor, x_t: Tensor, t: Tensor, bi: Tensor, ji: Tensor
    ) -> tuple[Tensor, int]:
        """(n,) mean_d (v_θ − v_ref)² (DiffusionNFT's and AWM's KL in velocity space) and the NFEs it cost; zeros
        without a reference forward when optim.kl_beta = 0.

        With kl_fraction f < 1 a block of n pairs (a one-process micro-batch, `start_step`) computes the reference
        forward for k = max(1, round(f·n)) of them, a uniformly random subset (the k smallest of the update's draws
        `kl_u`), and weights their term by n/k:
        every pair is in the subset with probability k/n, so this is an unbiased estimate of the same penalty (and
        its gradient) for ≈ f of the reference forwards (ALGORITHMS.md §9.4). The others' term is 0. A fixed k per
        micro-batch size keeps the reference batch's shape, and so the allocator's reuse of its buffers, constant
        (independent per-pair draws grew the peak RSS from 0.95 to 1.44 GB in 40 iterations).
        """
        if ctx.kl_beta <= 0:
            return torch.zeros(v.shape[0], device=v.device), 0
        return self._kl_to(ctx, ctx.reference, v, x_t, t, bi, ji)

    def base_kl(
        self, ctx: LossContext, v: Tensor, x_t: Tensor, t: Tensor, bi: Tensor, ji: Tensor
    ) -> tuple[Tensor, int]:
        """(n,) mean_d (v_θ − v_base)² to the INITIAL weights (`LossContext.base_reference`: for LoRA the model with
        its adapter disabled, else a frozen copy) and its NFEs: the second KL term of optim.kl_base_beta, next to the
        one to the EMA reference of optim.kl_reference=ema (AWM's `train.beta` = 1e-3 to `disable_adapter()` beside
        `train.ema_beta` = 1 to the EMA adapter, train_sd3_awm.py @ be51372). Same pairs and weights as
        `velocity_kl` (kl_fraction); zeros without a forward when optim.kl_base_beta = 0."""
        if getattr(ctx, "kl_base_beta", 0.0) <= 0 or getattr(ctx, "base_reference", None) is None:
            return torch.zeros(v.shape[0], device=v.device), 0
        return self._kl_to(ctx, ctx.base_reference, v, x_t, t, bi, ji)

    def kl_terms(
        self, ctx: LossContext, v: Tensor, x_t: Tensor, t: Tensor, bi: Tensor, ji: Tensor
    ) -> tuple[Tensor, dict[str, float], int]:
        """(n,) kl_beta·KL_ref (+ kl_base_beta·KL_base when optim.kl_base_beta > 0), the summed statistics ("kl", and
        "kl_base" with the base term) and the NFEs: the KL part of the nft / awm loss."""
        kl, nfe = self.velocity_kl(ctx, v, x_t, t, bi, ji)
        pen = ctx.kl_beta * kl
        sums = {"kl": float(kl.detach().sum())}
        if getattr(ctx, "kl_base_beta", 0.0) > 0:
            kb, nb = self.base_kl(ctx, v, x_t, t, bi, ji)
            pen = pen + ctx.kl_base_beta * kb
            sums["kl_base"] = float(kb.detach().sum())
            nfe += nb
        return pen, sums, nfe

    def _kl_to(
        self, ctx: LossContext, reference: Any, v: Tensor, x_t: Tensor, t: Tensor, bi: Tensor, ji: Tensor
    ) -> tuple[Tensor, int]:
        """(n,) mean_d (v_θ − v_ref)² to the policy of the context manager `reference()` (`velocity_kl`)."""
        n = v.shape[0]
        if self.kl_u is None:
            with torch.no_grad(), reference() as ref_model:
                v_ref = ForwardProcess.velocity(ctx, ref_model, x_t, t, bi)
            return (v.float() - v_ref.float()).pow(2).flatten(1).mean(1), n * nfe_per_sample(ctx.uncond, ctx.guidance)
        u = self.kl_u[bi.cpu() + self.row_start, ji.cpu()]
        if self.kl_w is None:  # no `start_step`: this micro-batch is its own block
            sel, w = self._kl_block(u)
            weight = torch.full((sel.shape[0],), w)
        else:  # the step's subset (`start_step`), in increasing u as a per-micro-batch draw orders it
            order = torch.argsort(u)
            wts = self.kl_w[bi.cpu(), ji.cpu()][order]
            sel, weight = order[wts > 0], wts[wts > 0]
        k = int(sel.shape[0])
        if k == 0:
            return torch.zeros(n, device=v.device), 0
        sel = sel.to(v.device)
        with torch.no_grad(), reference() as ref_model:
            v_ref = ForwardProcess.velocity(ctx, ref_model, x_t[sel], t[sel], bi[sel.to(bi.device)])
        d = (v[sel].float() - v_ref.float()).pow(2).flatten(1).mean(1) * weight.to(v.device)
        return torch.zeros(n, device=v.device).index_put((sel,), d), k * nfe_per_sample(ctx.uncond, ctx.guidance)
