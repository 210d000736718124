"""Many processes through accelerate: sharding, global statistics, gradient sync, layout-independent noise.

The contract (docs/SCALING.md): the SAME config trains the same way on 1 or N processes.

* ``data.prompts_per_iter`` is the GLOBAL number of prompt groups. Every process draws the same global batch from
  the same seeded ``PromptSampler`` (drawing prompts costs nothing) and keeps its contiguous slice of B/N rows
  (``Shard``); with P divisible by N, groups never span two processes. The sampler state is therefore identical on
  every rank and a checkpoint resumes on any number of processes.
* The initial noise and the SDE noise of a sample come from a generator seeded by (seed, iteration, global group
  index) (``layout_noise``); update-order and step-subset draws are seeded by (seed, iteration, ...) too. Nothing
  random depends on the rank layout, so N processes × B/N samples reproduce 1 process × B samples.
* Rewards (and step/instant rewards) are all-gathered; the credit is computed on the gathered global batch by
  every rank (identical inputs → identical advantages and credit state), and each rank keeps its rows.
* The loss of one optimizer step is Σ_pairs(...) / N_pairs_global on each rank and the gradients are SUMMED over
  ranks (``Dist.sync_grads``), which is exactly the one-process gradient.
* Only rank 0 writes (``Dist.is_main``).
* ``dist.fsdp`` (full fine-tunes): the network is sharded with PyTorch FSDP2 (``fsdp.apply_fsdp``); FSDP's
  reduce-scatter replaces ``sync_grads`` and is set to SUM, so the arithmetic above is unchanged.

Only the trainer layer imports accelerate, lazily (STYLE.md R6). One process: every collective is the identity.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

# seed streams of derived generators (seed, stream, iteration, index)
STREAM_NOISE = 1
STREAM_UPDATE_ORDER = 2
STREAM_STEP_SUBSET = 3
STREAM_GLOBAL_RNG = 4  # the global RNGs after setup, per rank (seed_global_rngs)

GRAD_BUCKET_NUMEL = 1 << 24  # 16 M elements (64 MB fp32) per gradient all-reduce


def derived_generator(seed: int, stream: int, iteration: int, index: int = 0) -> torch.Generator:
    """A CPU torch.Generator seeded by (seed, stream, iteration, index): the same on every rank and every layout."""
    s = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(stream), int(iteration), int(index)]).generate_state(
        2, np.uint32
    )
    return torch.Generator(device="cpu").manual_seed(int(s[0]) << 31 ^ int(s[1]))


def seed_global_rngs(seed: int, rank: int | None = None) -> None:
    """Seed the process-global RNGs (torch CPU + CUDA, numpy's ``np.random``, python's ``random``) from run.seed.

    ``rank=None`` seeds them with ``seed`` itself, identically on every rank: the trainer calls it first in
    ``setup()``, before anything is built, so whatever draws from the global RNG while building (peft's LoRA
    initialisation, diffusers' init of weights missing from a checkpoint, a plugin's modules) draws the same
    numbers in every run and on every rank: every rank starts from the same weights. ``rank=r`` reseeds them with a
    value derived from (seed, rank) once everything is built, for what draws from them later (e.g. dropout inside a
    plugin's network), like DDP's per-rank seeds; flowcredit's own randomness never draws from them (it uses
    `derived_generator`, keyed by global indices), so the rank offset cannot change what 1 or N processes compute.
    """
    import random

    if rank is None:
        value = int(seed)
    else:
        seq = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, STREAM_GLOBAL_RNG, int(rank)])
        value = int(seq.generate_state(1)[0])
    random.seed(value)
    np.random.seed(value & 0xFFFFFFFF)
    torch.manual_seed(value)  # also every CUDA device's generator


class Dist:
    """The process group as the trainer sees it (rank, world size, device, collectives).

    Built by ``Dist.create``; with one process every method is an identity or a no-op and accelerate is not imported.
    """

    def __init__(self, accelerator: Any = None, device: torch.device | str = "cpu"):
        self.acc = accelerator
        if accelerator is not None:
            self.rank, self.world_size, self.device = (
                accelerator.process_index,
                accelerator.num_processes,
                accelerator.device,
            )
        else:
            self.rank, self.world_size, self.device = 0, 1, torch.device(device)
        self.fsdp = False  # set by ``fsdp.apply_fsdp``: the network is sharded and FSDP reduces its gradients

    @classmethod
    def create(cls, enabled: bool | None, device: str) -> Dist:
        """``enabled`` None = on when the launcher set WORLD_SIZE > 1 (torchrun, accelerate launch)."""
        if enabled is None:
            enabled = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if not enabled:
            return cls(None, device)
        try:
            from accelerate import Accelerator
        except ImportError:
            raise RuntimeError("dist.enabled needs accelerate: pip install 'accelerate>=0.30'") from None
        acc = Accelerator(cpu=torch.device(device).type == "cpu", mixed_precision="no")
        return cls(acc)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def evaluates(self) -> bool:
        """Whether this rank runs the evaluations (periodic, gold, final): rank 0 only, or every rank under FSDP,
        where each rank holds a shard of the weights and must join every forward's all-gather. Rank 0 alone writes."""
        return self.is_main or self.fsdp

    def micro_batches(self, n_pairs: int, micro_batch: int) -> int:
        """How many micro-batches this rank runs for its ``n_pairs`` pairs of one optimizer step.

        ⌈n_pairs/micro_batch⌉, or under FSDP the max of that over ranks (every forward/backward of a sharded network
        is a collective, so a rank with fewer pairs runs zero-weight padding passes; see ``harness.DistPadding``).
        """
        n = -(-n_pairs // micro_batch)
        return int(self.max([n])[0]) if self.fsdp else n

    # --------------------------------------------------------------------------------------------- collectives
    def _comm_device(self) -> torch.device:
        return self.device if torch.device(self.device).type == "cuda" else torch.device("cpu")

    def gather(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Concatenate every rank's (B_local, ...) tensor along dim 0 in rank order → (B_global, ...)."""
        if t is None or not self.active:
            return t
        out = self.acc.gather(t.contiguous().to(self._comm_device()))
        return out.to(t.device)

    def _all_reduce(self, values: Sequence[float], op: str) -> list[float]:
        if not self.active:
            return [float(v) for v in values]
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, "sum")

    def max(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, "max")

    def any(self, flag: bool) -> bool:
        return self.max([1.0 if flag else 0.0])[0] > 0

    def gather_object(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's value on every rank."""
        if not self.active:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj])[0]

    def barrier(self) -> None:
        if self.active:
            self.acc.wait_for_everyone()

    def sync_grads(self, params: Sequence[torch.nn.Parameter], local_bad: bool = False) -> bool:
        """Sum the gradients of ``params`` over ranks (the loss is already normalised by the GLOBAL pair count).

        A parameter that got a gradient on no rank keeps ``grad = None`` (as in one process, so AdamW skips it); one
        that got it on some ranks gets zeros elsewhere. Returns True when any rank flagged a non-finite loss.
        """
        if not self.active:
            return local_bad
        if self.fsdp:  # FSDP already reduce-scattered (summed) the gradients during backward: only the flag is reduced
            return self.any(local_bad)
        import torch.distributed as dist

        dev = self._comm_device()
        flags = torch.tensor([p.grad is not None for p in params] + [local_bad], dtype=torch.float32, device=dev)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        has = flags[:-1].bool().tolist()
        grads: list[torch.Tensor] = []  # the gradients to sum, in parameter order (all ranks agree on the set)
        for p, h in zip(params, has):
            if h:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        bucket: list[torch.Tensor] = []
        numel = 0
        for g in [*grads, None]:
            if g is not None:
                bucket.append(g)
                numel += g.numel()
            if bucket and (g is None or numel >= GRAD_BUCKET_NUMEL):
                flat = torch.cat([q.reshape(-1).to(dev, torch.float32) for q in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                off = 0
                for q in bucket:
                    n = q.numel()
                    q.copy_(flat[off : off + n].view_as(q))
                    off += n
                bucket, numel = [], 0
        return bool(flags[-1] > 0)

    def close(self, barrier: bool = True) -> None:
        """Tear the process group down (gloo aborts at interpreter exit otherwise). ``barrier=False`` after an error,
        when the other ranks may never arrive."""
        if self.active:
            import torch.distributed as dist

            if dist.is_initialized():
                if barrier:
                    self.barrier()
                dist.destroy_process_group()


@dataclass(frozen=True)
class Shard:
    """This rank's contiguous slice [start, stop) of the global batch of B = P·G rows (group-major order)."""

    num_groups: int  # P (global)
    group_size: int  # G
    rank: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.num_groups * self.group_size

    @property
    def start(self) -> int:
        return self.rank * self.global_batch // self.world_size

    @property
    def stop(self) -> int:
        return (self.rank + 1) * self.global_batch // self.world_size

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)

    @classmethod
    def create(cls, num_groups: int, group_size: int, rank: int, world_size: int, split_groups: bool) -> Shard:
        B = num_groups * group_size
        if num_groups % world_size != 0:
            if not split_groups or B % world_size != 0:
                raise ValueError(
                    f"data.prompts_per_iter={num_groups} groups cannot be shared evenly by {world_size} processes; "
                    f"use a multiple of {world_size} (e.g. {world_size * max(1, round(num_groups / world_size))})"
                    + ("" if split_groups else f", or dist.split_groups=true when B={B} is a multiple of {world_size}")
                )
        return cls(num_groups, group_size, rank, world_size)

    def draw(self, sampler):
        """The global draw of the (shared, identically seeded) PromptSampler, cut to this rank's rows.

        Returns (prompts, metadata, group_ids) of this rank, group ids GLOBAL (0 … P−1), so unique across ranks.
        """
        prompts, meta, gids = sampler.draw(self.num_groups, self.group_size)
        r = self.rows
        return prompts[r], meta[r], gids[r]

    def global_group_ids(self) -> torch.Tensor:
        return torch.arange(self.num_groups, dtype=torch.long).repeat_interleave(self.group_size)


def layout_noise(
    seed: int, iteration: int, shard: Shard, latent_shape: Sequence[int], num_steps: int, shared: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial noise x^(0) (B_local, *latent) and SDE step noise (B_local, T, *latent) of this rank's rows.

    Every group g draws its own (G or 1 initial, G × T step) standard normals from ``derived_generator(seed,
    STREAM_NOISE, iteration, g)``, so a sample's noise depends on (seed, iteration, group, member) only, never on the
    number of processes. ``shared``: one initial noise per group (Stepwise/VGPO).
    """
    G = shard.group_size
    latent_shape = tuple(latent_shape)
    inits, steps = [], []
    for g in range(shard.start // G, (shard.stop - 1) // G + 1):
        gen = derived_generator(seed, STREAM_NOISE, iteration, g)
        x0 = torch.randn((1 if shared else G, *latent_shape), generator=gen)
        eps = torch.randn((G, num_steps, *latent_shape), generator=gen)
        lo, hi = max(shard.start, g * G) - g * G, min(shard.stop, (g + 1) * G) - g * G
        inits.append(x0.expand(G, *latent_shape)[lo:hi] if shared else x0[lo:hi])
        steps.append(eps[lo:hi])
    return torch.cat(inits).contiguous(), torch.cat(steps)


def systematic_steps(n: int, k: int, u: float) -> list[int]:
    """k of the indices 0..n−1 by systematic sampling: with the offset u·n/k (u ∈ [0, 1) uniform), ⌊u·n/k + i·n/k⌋
    for i = 0..k−1.

    Every index is drawn with probability exactly min(k, n)/n, as with k uniform draws without replacement (for index
    j the u that pick it form one interval of length k/n inside [0, 1)), so the expected loss is unchanged; but the k
    indices are spread evenly (consecutive ones ⌊n/k⌋ or ⌈n/k⌉ apart), never bunched at one end of the time range.
    k ≥ n gives all n indices.
    """
    if k >= n:
        return list(range(n))
    stride = n / k
    return [min(n - 1, int(math.floor((u + i) * stride))) for i in range(k)]


def awm_strata(n: int, k: int) -> list[tuple[int, int]]:
    """The k strata [lo_i, hi_i) of AWM's time draw over the steps 1..n−1 (step 0 never trained):
    lo_i = ⌊1 + i·(n−1)/k⌋, hi_i = ⌊1 + (i+1)·(n−1)/k⌋ in exact integer arithmetic (AWM: the floors of the float32
    `torch.linspace(1, n, k + 1)`, the same for the released 12 trainable steps and k = 6: [1,2), [2,4), [4,6), [6,8),
    [8,10), [10,12); they differ only where float32 rounds a boundary just under an integer, e.g. n = 29, k = 26).
    1 ≤ k ≤ n − 1 keeps every stratum non-empty and the strata disjoint."""
    if not 1 <= k <= n - 1:
        raise ValueError(f"sampler.train_step_draw=awm needs 1 ≤ train_steps_per_sample ≤ {n - 1}, got {k}")
    return [(1 + i * (n - 1) // k, 1 + (i + 1) * (n - 1) // k) for i in range(k)]


def awm_steps(n: int, k: int, u: torch.Tensor) -> list[int]:
    """AWM's stratified draw (`time_type = discrete_wo_init`, scxue/advantage_weighted_matching
    `scripts/train_sd3_awm.py` @ be51372): one index from each stratum of `awm_strata(n, k)`, lo_i + ⌊u_i·(hi_i −
    lo_i)⌋ for the k uniforms u (k,) float32 in [0, 1), as `lower_bounds + (rand_u * (upper_bounds −
    lower_bounds)).long()`. Index j of stratum i is drawn with probability 1/(hi_i − lo_i); index 0 never."""
    lo, hi = (torch.tensor(v, dtype=torch.long) for v in zip(*awm_strata(n, k)))
    return (lo + (u.float() * (hi - lo)).long()).tolist()


def step_draw_window(
    step_draw: str, num_steps: int, timestep_fraction: float, steps_per_sample: int
) -> tuple[float, int]:
    """(the fraction f whose first int(T·f) steps may be trained, the steps `plan_update` draws per sample, 0 = all)
    of a `sampler.train_step_draw`.

    random / systematic: (sampler.timestep_fraction, sampler.train_steps_per_sample). nft: (1, int(T·f)), f =
    sampler.timestep_fraction: every one of the T grid times may be trained and each sample trains int(T·f) of them,
    drawn as the random draw does (uniformly without replacement), so each time, t_{T−1} included, is trained with
    probability int(T·f)/T. This is DiffusionNFT's draw (NVlabs/DiffusionNFT `scripts/train_nft_sd3.py` @ 24af555:
    per sample `perms_time = torch.randperm(num_timesteps)` over all `sample.num_steps` grid times, and the first
    `num_train_timesteps = int(num_steps·timestep_fraction)` of the permuted ones are trained: 9 of 10 at 0.99).
    awm: as random / systematic (the first int(T·f) steps, k of them by `awm_steps`, never step 0).
    """
    if step_draw == "nft":
        return 1.0, int(num_steps * timestep_fraction)
    return timestep_fraction, steps_per_sample


class Chunk(NamedTuple):
    """One optimizer step of an update plan (`plan_update`).

    Attributes:
        mine: this rank's pairs to compute, as (local row, step), in the plan's order.
        n_norm: the GLOBAL normaliser of the step's loss (optim.loss_mean).
        pairs: every rank's pairs to compute, as (global row, step), in the same order (the same on every rank, so
            a per-step draw over them, e.g. the KL subset of `objectives.forward`, does not depend on the layout).
    """

    mine: list[tuple[int, int]]
    n_norm: int
    pairs: list[tuple[int, int]]


def drawn_pairs(B: int, steps_ok: list[int], steps_per_sample: int, seed: int, iteration: int,
                step_groups: list[int] | None, step_draw: str) -> list[tuple[int, int]]:
    """The (row, step) pairs an update may train: every allowed step of every row (steps_per_sample = 0), or
    `steps_per_sample` of them per row drawn by `step_draw` (see `plan_update`), seeded per (seed, iteration, row) or
    per prompt group with `step_groups`."""
    if steps_per_sample <= 0:
        return [(b, j) for b in range(B) for j in steps_ok]
    pairs = []
    for b in range(B):
        key = b if step_groups is None else B + int(step_groups[b])  # group keys never collide with row keys
        gen = derived_generator(seed, STREAM_STEP_SUBSET, iteration, key)
        if step_draw == "systematic":
            u = float(torch.rand((), generator=gen, dtype=torch.float64))
            picked = systematic_steps(len(steps_ok), steps_per_sample, u)
        elif step_draw == "awm":
            picked = awm_steps(len(steps_ok), steps_per_sample, torch.rand(steps_per_sample, generator=gen))
        else:
            picked = torch.randperm(len(steps_ok), generator=gen)[:steps_per_sample].tolist()
        pairs += [(b, steps_ok[int(i)]) for i in picked]
    return pairs


def update_pairs(sampler, step_mask: torch.Tensor, batch: int, seed: int, iteration: int,
                 step_groups: list[int] | None) -> list[tuple[int, int]]:
    """The (row, step) pairs an iteration's update may train under the config's sampler section (`drawn_pairs` with
    `sampler.train_step_draw` / `train_steps_per_sample` / `timestep_fraction`, `step_draw_window`); step_mask (T,)
    bool, the trainable steps; step_groups: the global group ids when a group shares its steps (nft's crn)."""
    T = step_mask.shape[0]
    _, k = step_draw_window(sampler.train_step_draw, T, sampler.timestep_fraction, sampler.train_steps_per_sample)
    steps_ok = [j for j in range(T) if bool(step_mask[j])]
    return drawn_pairs(batch, steps_ok, k, seed, iteration, step_groups, sampler.train_step_draw)


def plan_update(
    adv_global: torch.Tensor,
    step_mask: torch.Tensor,
    shard: Shard,
    *,
    seed: int,
    iteration: int,
    inner_epochs: int,
    updates_per_epoch: int,
    skip_zero_adv: bool,
    steps_per_sample: int = 0,
    step_groups: list[int] | None = None,
    step_draw: str = "random",
    loss_mean: str = "planned",
    pairs: list[tuple[int, int]] | None = None,
) -> tuple[int, int, list[list[Chunk]]]:
    """Which (sample, step) pairs each optimizer step trains, decided on the GLOBAL batch by every rank alike.

    Args:
        adv_global: (B_global, T) advantages of the global batch.
        step_mask: (T,) bool, the steps that may be trained.

    With `step_groups` (B prompt-group ids) the `steps_per_sample` random steps are drawn once per group, so the
    members of a group train the same steps (the forward-process objectives' common random numbers). `step_draw`:
    "random" (k of the n allowed steps without replacement), "systematic" (`systematic_steps`) or "nft" (drawn as
    "random"; the caller allows all T steps and k = int(T·timestep_fraction), `step_draw_window`) or "awm" (AWM's
    stratified draw of k of the n allowed steps, one per stratum of steps 1..n−1, `awm_steps`).

    AWM draws its k indices once per training micro-batch of `train.batch_size` (3) randomly shuffled samples of one
    GPU and shares them across it (the micro-batch's forward then has one time per block of 3 rows); flowcredit's
    micro-batches are cut from a seeded order of all pairs, so the draw is keyed instead by the sample (or by the
    prompt group with `step_groups`, nft's crn), like the other draws: every sample's k indices have AWM's law
    exactly, and the micro-batch size never changes what is drawn (1 and N processes alike). What is not
    reproduced is the coupling between the 3 samples of an AWM micro-batch (with one optimizer step per update, as
    in the released recipe, the gradient is the sum over all pairs, so only that within-triple correlation differs).

    `skip_zero_adv` (the objective says an A = 0 pair has exactly zero gradient) drops those pairs from the passes.
    `loss_mean` (optim.loss_mean) says what the loss of an optimizer step is divided by:
    "planned": the count of every planned pair of the chunk, the zero-advantage ones included, so skipping them only
    saves their forward/backward and never changes the step's scale (the order and the chunks are drawn over all
    planned pairs, so the plan is the same with or without the skip); "nonzero": the count of the pairs with A ≠ 0,
    filtered out before the chunks are drawn (flow_grpo's scripts/train_sd3.py filters zero-advantage samples, then
    takes a mean per micro-batch over what is left), so the step grows by N_planned / N_nonzero as groups collapse.

    Returns (global pairs in the loss's denominator over one epoch, global pairs computed per epoch, per epoch a list
    of `Chunk`s: this rank's pairs to compute as (local row, step), the chunk's GLOBAL normaliser, and every rank's). A
    chunk none of whose pairs is computed (every A = 0, no KL) is no optimizer step at all: its gradient would be
    exactly zero, and AdamW would still move the weights by its moments. With one process this is the classic
    update schedule.
    """
    if loss_mean not in ("planned", "nonzero"):
        raise ValueError(f"optim.loss_mean={loss_mean!r}; use planned or nonzero")
    if step_draw not in ("random", "systematic", "nft", "awm"):
        raise ValueError(f"sampler.train_step_draw={step_draw!r}; use random, systematic, nft or awm")
    B, T = adv_global.shape
    mask = step_mask.tolist()
    steps_ok = [j for j in range(T) if mask[j]]
    if pairs is None:  # `pairs`: the caller drew them already (`drawn_pairs` with these arguments)
        pairs = drawn_pairs(B, steps_ok, steps_per_sample, seed, iteration, step_groups, step_draw)
    nz = (adv_global != 0).tolist()
    if skip_zero_adv and loss_mean == "nonzero":  # zero advantage and no KL term: out of the plan and the mean
        pairs = [(b, j) for (b, j) in pairs if nz[b][j]]
    computed = (lambda b, j: nz[b][j]) if skip_zero_adv else (lambda b, j: True)
    epochs = []
    for epoch in range(inner_epochs):
        order = torch.randperm(
            len(pairs), generator=derived_generator(seed, STREAM_UPDATE_ORDER, iteration, epoch)
        ).tolist()
        chunks = []
        for chunk in np.array_split(np.array(order, dtype=np.int64), updates_per_epoch):
            if not any(computed(*pairs[i]) for i in chunk.tolist()):  # no pair with a gradient: no optimizer step
                continue
            todo = [pairs[i] for i in chunk.tolist() if computed(*pairs[i])]
            mine = [(b - shard.start, j) for b, j in todo if shard.start <= b < shard.stop]
            chunks.append(Chunk(mine, len(chunk), todo))
        epochs.append(chunks)
    return len(pairs), sum(computed(b, j) for b, j in pairs), epochs
