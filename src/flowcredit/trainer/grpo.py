"""THE training loop of every GRPO-family method (Flow-GRPO, Stepwise-Flow-GRPO, VGPO).

One iteration reads as pseudocode:

    prompts, groups = sampler.draw(P, G)
    traj    = rollout(policy, prompts, sampler=SDE)                  # no grad, records log π_old
    rewards = reward(decode(x_T))                                    # (B,)
    if the credit needs them: ρ_j = reward(decode(x̂0(x^(j))))        # (B, T+1), Stepwise §4.1 / VGPO §5.2
    adv     = assign_credit(cfg.credit, rewards, ρ, groups)          # (B, T)
    update:  for every trained (sample, step) pair:
                 v      = policy_velocity(θ, x^(j), t_j)              # the SAME function as the rollout
                 logp   = sampler_step(x^(j) → x^(j+1), v).log_prob   # the SAME step function
                 loss  += PPO-clip(logp, logp_old, adv) + β·KL(π_θ ‖ π_ref)
    log → checkpoint

Only this file touches the optimizer, the reference model and the run folder. Components are pure.
Ratio parity: when the update is strictly on-policy (one pass, one optimizer step per rollout batch), θ_old = θ,
so we use logp_old = logp.detach() and the ratio is exactly 1 (its gradient is ∇logp). The rollout's recorded
log-probs are compared with the recomputed ones every iteration (`parity_max_abs_dlogp`): in fp32 they agree to
~1e-7; in bf16 the difference is numeric noise that must not be mistaken for off-policyness.

Scale and faults (docs/SCALING.md): on N processes each rank runs its slice of the global batch and the credit sees
the gathered batch (`distributed.py`); checkpoints are atomic and verified (`checkpoint.py`); NaN/Inf updates are
skipped, failing rewards retried, SIGTERM checkpoints and exits (`faults.py`). Only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.load import dump_yaml
from ..config.schema import TrainConfig
from ..credit.base import CreditInput
from ..credit.registry import assign_credit, needs_instant_rewards, needs_step_rewards
from ..objectives import LossContext, build_objective
from ..rewards.guards import group_diversity
from ..samplers.estimates import denoise_estimate, trajectory_estimates
from ..samplers.policy import nfe_per_sample
from ..samplers.rollout import rollout
from ..samplers.schedules import time_grid
from ..samplers.sde import SamplerParams
from ..types import Trajectory, cond_index, cond_repeat
from . import checkpoint
from .checkpoint import rng_states, set_rng_states
from .distributed import (
    Dist,
    ReferenceOffload,
    Shard,
    apply_fsdp,
    build_optimizer,
    clip_grad_norm,
    enable_gradient_checkpointing,
    layout_noise,
    plan_update,
)
from .faults import NonFiniteGuard, RetryingCall, StopSignal, first_nonfinite, inject_point
from .harness import EMAWeights, HackingGuard, PhaseTimer, TimeBudget
from .loggers import build_loggers, scalars_of


class TrainingError(RuntimeError):
    """A run cannot start or continue; the message is one line saying what to fix."""


def sampler_params(cfg: TrainConfig) -> SamplerParams:
    s = cfg.sampler
    return SamplerParams(name=s.name, noise_level=s.noise_level, reduce=s.reduce, ddim_sigma=s.ddim_sigma, ddim_coef=s.ddim_coef)


class GRPOTrainer:
    """Flow-GRPO-family trainer. `setup()` builds everything and validates inputs before anything is written;
    `train()` runs the loop; `save_checkpoint()` / `load_checkpoint()` persist every state."""

    def __init__(self, cfg: TrainConfig, preset_name: str = "custom"):
        self.cfg = cfg
        self.preset_name = preset_name
        self.t_created = time.time()  # run.budget_minutes counts from here (setup included)

    # ------------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg = self.cfg
        from ..models.factory import build_model, set_trainable
        from ..rewards.registry import build_reward
        from ..shapes.prompts import PromptFileError, load_prompts
        from .data import PromptSampler

        # --- validate inputs first: nothing is written to the run folder on bad input -----------------------
        try:
            self.train_prompts = load_prompts(cfg.data.train_prompts)
        except PromptFileError as e:
            raise TrainingError(f"data.train_prompts: {e}") from None
        try:
            self.prompt_sampler = PromptSampler(self.train_prompts, cfg.run.seed, cfg.data.balance_tags, cfg.data.tag_weights)
        except ValueError as e:
            raise TrainingError(str(e)) from None
        try:
            self.reward_fn = self._build_reward(build_reward)
        except ValueError as e:
            raise TrainingError(str(e)) from None
        if cfg.reward.name in ("shapes",) or any(c.name == "shapes" for c in cfg.reward.components):
            missing = [i for i, m in enumerate(self.train_prompts.metadata) if "include" not in m]
            if missing:
                raise TrainingError(
                    f"data.train_prompts: reward 'shapes' needs GenEval-schema .jsonl prompts, but line {missing[0] + 1} of "
                    f"{self.train_prompts.source} has no metadata; use shapes:train or a .jsonl file"
                )
        if cfg.run.eval_at_end or cfg.run.eval_every:
            try:
                self.eval_prompts = load_prompts(cfg.run.eval_prompts)
            except PromptFileError as e:
                raise TrainingError(f"run.eval_prompts: {e}") from None

        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.dist = Dist.create(cfg.dist.enabled, cfg.run.device)  # accelerate when launched on N processes
        try:
            self.shard = Shard.create(cfg.data.prompts_per_iter, cfg.data.group_size, self.dist.rank, self.dist.world_size, cfg.dist.split_groups)
        except ValueError as e:
            raise TrainingError(str(e)) from None
        self.device = torch.device(self.dist.device)
        self.model = build_model(cfg.model, str(self.device))
        self.trainable = set_trainable(self.model, cfg.model.trainable)
        self.trainable_names = [n for n, p in self.model.net.named_parameters() if p.requires_grad]
        self.model.train()
        # Reference policy for the KL: a frozen copy of the initial weights, or, for LoRA models, the model itself with
        # its adapter disabled (`model.reference()` context, no copy).
        self.ref_model = None
        if cfg.optim.kl_beta > 0 and not hasattr(self.model, "reference"):
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False).eval()
        self.ref_offload = ReferenceOffload(self.ref_model, self.device, cfg.optim.offload_reference)
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        if cfg.dist.fsdp:  # shard the network (and the reference copy unless it is offloaded) over the processes
            try:
                sharded = apply_fsdp(self.dist, self.model, None if self.ref_offload.enabled else self.ref_model,
                                     groups_per_rank_even=cfg.data.prompts_per_iter % self.dist.world_size == 0)
            except ValueError as e:
                raise TrainingError(str(e)) from None
            self.trainable = sharded if sharded is not None else self.trainable
        self.initial_state = None
        if cfg.run.eval_baseline and cfg.run.eval_at_end:
            self.initial_state = {k: v.detach().clone() for k, v in self.model.net.state_dict().items()}
        self.opt = build_optimizer(
            self.trainable, cfg.optim.offload_optimizer, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
            eps=cfg.optim.eps,
        )
        # the harness (trainer/harness.py): EMA of the weights, hacking guard, time budget; all saved in checkpoints
        self.ema_weights = EMAWeights(self.trainable, cfg.optim.ema_decay)
        self.guard_ = HackingGuard.from_config(cfg.run, build_reward)
        self.budget = TimeBudget(cfg.run.budget_minutes, self.t_created, self.eval_forwards)
        self.gen = torch.Generator(device="cpu").manual_seed(cfg.run.seed)
        self.timesteps = time_grid(cfg.sampler.num_steps, cfg.sampler.shift, cfg.sampler.grid)
        self.params = sampler_params(cfg)
        try:
            self.objective = build_objective(cfg.objective.name, cfg.objective.options, cfg)
        except ValueError as e:
            raise TrainingError(str(e)) from None
        self.credit_state: dict[str, torch.Tensor] = {}
        self.iteration = 0
        self.nonfinite = NonFiniteGuard(cfg.faults.max_nonfinite, self.dist.is_main)
        self.call_reward = RetryingCall(cfg.faults.reward_retries, cfg.faults.reward_backoff, cfg.faults.reward_timeout)
        self.uncond1 = self.model.encode_prompts([""]) if cfg.sampler.guidance_scale != 1.0 else None

        # --- the run folder ---------------------------------------------------------------------------------
        out = cfg.run.out_dir or f"runs/{self.preset_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.out = Path(self.dist.broadcast_object(out))  # rank 0 writes; every rank reads the checkpoint
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "checkpoints").mkdir(exist_ok=True)
            (self.out / "grids").mkdir(exist_ok=True)
            # the resolved config; a resumed run keeps its original config.yaml and records the new one beside it
            dump_yaml(cfg, self.out / ("config.yaml" if not (self.out / "config.yaml").exists() else "config.resumed.yaml"))
        self.dist.barrier()
        ckpt = self.latest_checkpoint()
        if ckpt is not None:
            self.load_checkpoint(ckpt)
            if self.dist.is_main:
                print(f"resuming from {ckpt} (iteration {self.iteration})", file=sys.stderr, flush=True)
        self.metrics_f, self.loggers = None, []  # rank 0 only: metrics.jsonl + run.loggers (trainer/loggers.py)
        if self.dist.is_main:
            for log_file in ("metrics.jsonl", "eval_curve.jsonl", "gold.jsonl"):  # a resumed run redoes later iterations
                checkpoint.truncate_jsonl(self.out / log_file, self.iteration if ckpt is not None else -1)
            self.metrics_f = open(self.out / "metrics.jsonl", "a")
            try:  # default [tensorboard] is best effort: metrics.jsonl is the record of truth
                self.loggers = build_loggers(cfg.run.loggers, self.out, dataclasses.asdict(cfg))
            except ValueError as e:  # a named logger that is unknown or not installed: one line with the pip command
                raise TrainingError(str(e)) from None

    def _build_reward(self, build_reward):
        rc = self.cfg.reward
        if rc.name != "mix":
            return build_reward(rc.name, **rc.options)
        if not rc.components:
            raise ValueError("reward.name=mix needs reward.components, e.g. [{name: shapes, weight: 1.0}]")
        comps = [{"name": c.name, "weight": c.weight, "options": c.options, "label": c.label} for c in rc.components]
        return build_reward("mix", components=comps, normalize=rc.normalize)

    # -------------------------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, Any]:
        cfg = self.cfg
        t_start = time.time()
        bar = None
        try:
            from tqdm import tqdm

            bar = tqdm(total=cfg.run.iterations, initial=self.iteration, desc=f"train[{cfg.method}]", dynamic_ncols=True,
                       disable=not self.dist.is_main)
        except ImportError:
            pass
        signals, stopped = StopSignal(cfg.faults.handle_signals), None  # SIGTERM/SIGINT: stop after the iteration
        stopped_by_budget = False
        with signals:
            if cfg.run.eval_every and self.iteration == 0 and self.dist.evaluates:
                self.periodic_eval()  # the curve starts at the initial model
            while self.iteration < cfg.run.iterations:
                if self.dist.any(bool(cfg.run.max_minutes) and (time.time() - t_start) > 60 * cfg.run.max_minutes):
                    break
                if self.dist.any(self.budget.over()):
                    stopped_by_budget = True
                    break
                t_iter = time.time()
                stats = self.train_step()
                self.iteration += 1
                if self.iteration % cfg.run.log_every == 0:
                    self.log(stats)
                if cfg.run.grid_every and self.iteration % cfg.run.grid_every == 0:
                    self.save_grid(stats.pop("_images"), stats.pop("_prompts"))
                if cfg.run.eval_every and self.iteration % cfg.run.eval_every == 0:
                    self.periodic_eval()
                self.guard(stats)
                if (cfg.run.checkpoint_every and self.iteration % cfg.run.checkpoint_every == 0) or self.iteration == cfg.run.iterations:
                    self.save_checkpoint()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", strict=f"{stats.get('strict_mean', float('nan')):.2f}")
                self.budget.record(time.time() - t_iter, stats["nfe_rollout"], stats["seconds"].get("rollout", 0.0))
                if self.dist.any(signals.requested is not None):  # every rank stops at the same iteration
                    stopped = signals.requested or "signal"
                    break
            if bar is not None:
                bar.close()
            self.save_checkpoint()
        result: dict[str, Any] = {"iterations": self.iteration, "train_seconds": time.time() - t_start}
        if stopped_by_budget:
            result["stopped_by_budget"] = True
        if stopped:
            result["stopped"] = stopped
        elif cfg.run.eval_at_end and self.dist.evaluates:
            result["eval"] = self.final_eval()
        if self.metrics_f is not None:
            self.metrics_f.close()
        for logger in self.loggers:
            logger.close()
        self.dist.close()
        return result

    def _eval_kwargs(self) -> dict[str, Any]:
        """Settings of every evaluation of a run (periodic and final): the reward, ODE steps, CFG scale, the fixed
        noise seed (run.seed + 12345) and the time-grid shift."""
        rc = self.cfg.run
        return dict(reward=self.reward_fn, steps=rc.eval_steps, guidance=rc.eval_guidance, seed=rc.seed + 12345, shift=self.cfg.sampler.shift)

    def eval_forwards(self) -> int:
        """Model forward-images the final evaluation costs: every eval prompt line × ODE steps × (2 with CFG), for
        the trained model and, unless cached, the initial one."""
        rc = self.cfg.run
        if not (rc.eval_at_end and self.dist.evaluates):
            return 0
        per_model = len(self.eval_prompts) * rc.eval_steps * (2 if rc.eval_guidance != 1.0 else 1)
        models = 1
        if self.initial_state is not None:
            cache = self._baseline_cache_file(self._eval_kwargs())
            models += 0 if cache is not None and cache.is_file() else 1
        return per_model * models

    def over_budget(self, iter_seconds: list[float], fwd_rates: list[float]) -> bool:
        """run.budget_minutes with the given measurements (`harness.TimeBudget.over`)."""
        self.budget.iter_seconds, self.budget.fwd_rates = list(iter_seconds), list(fwd_rates)
        return self.budget.over()

    def train_step(self) -> dict[str, Any]:
        """One iteration: rollout → rewards → (intermediate rewards) → credit → update.

        On N processes this rank rolls out and scores its B/N rows of the global batch; the rewards are gathered so
        the credit (and every statistic) sees the global batch, and the rank keeps its rows' advantages.
        """
        cfg, model = self.cfg, self.model
        timer = PhaseTimer(iteration=self.iteration + 1)
        stats: dict[str, Any] = {}
        prompts, meta, gids = self.shard.draw(self.prompt_sampler)  # this rank's rows; group ids are global
        B = len(prompts)
        guidance = cfg.sampler.guidance_scale
        nfe = nfe_per_sample(self.uncond1, guidance)

        # ---------------------------------------------------------------- ROLLOUT
        with timer("rollout"):
            model.eval()
            cond = model.encode_prompts(prompts)
            uncond = cond_repeat(self.uncond1, B) if self.uncond1 is not None else None
            # noise seeded per (seed, iteration, group): the same samples on 1 or N processes
            init, noise = layout_noise(cfg.run.seed, self.iteration + 1, self.shard, model.latent_shape, len(self.timesteps) - 1, cfg.shared_noise)
            traj = rollout(
                model, prompts, meta, gids, timesteps=self.timesteps, sampler=self.params, guidance_scale=guidance,
                generator=None, init_noise=init, step_noise=noise,
                keep_velocities=needs_step_rewards(cfg.credit) or needs_instant_rewards(cfg.credit),
                train_fraction=cfg.sampler.timestep_fraction, ode_untrained=cfg.sampler.ode_untrained, cond=cond, uncond=uncond,
            )
        T = traj.num_steps
        # grpo trains the stochastic steps inside timestep_fraction; forward-process objectives the first
        # int(T·fraction) steps whatever the rollout SDE (an ODE rollout has no σ > 0 step)
        traj.step_mask = self.objective.trained_steps(traj, cfg.sampler.timestep_fraction)
        stats["nfe_rollout"] = B * T * nfe

        # ---------------------------------------------------------------- REWARD
        with timer("reward"):
            images = model.decode(traj.latents[:, -1])
            ro = self.call_reward(self.reward_fn, images, prompts, meta, group_ids=gids)  # retried per `faults`
            traj.rewards = ro.scores.float()
        rewards = self.dist.gather(traj.rewards)  # (B_global,)
        stats["reward_calls"] = B
        stats["reward_mean"] = float(rewards.mean())
        stats["reward_std"] = float(rewards.std(unbiased=False))
        # hacking guard: within-group diversity (mean pairwise RMS pixel distance); collapse = mode collapse
        stats["diversity"] = float(group_diversity(images, gids).mean())
        for k, v in ro.components.items():
            stats[f"{k}_mean"] = float(self.dist.gather(v.float()).mean())

        # ---------------------------------------------------------------- INTERMEDIATE REWARDS (Stepwise / VGPO)
        step_rewards = instant = None
        if needs_step_rewards(cfg.credit):
            with timer("estimates"):
                est = trajectory_estimates(
                    model, traj, cond, uncond, guidance, cfg.estimate.substeps, cfg.estimate.chunk_size, cfg.shared_noise
                )
            stats["nfe_estimates"] = est.nfe
            with timer("estimate_rewards"):
                step_rewards, calls = self._score_states(est.x0_hat[:, :-1], prompts, meta, gids, cfg.shared_noise)
                step_rewards = torch.cat([step_rewards, traj.rewards[:, None]], dim=1)  # ρ_T = R(x0)
            stats["reward_calls"] += calls
            traj.step_rewards = step_rewards
        if needs_instant_rewards(cfg.credit) and not (needs_step_rewards(cfg.credit) and cfg.estimate.substeps == cfg.estimate.instant_substeps):
            # VGPO I_j = R(x̂0 of the post-action state x^(j+1)), one-step Tweedie by default (§5.2)
            with timer("estimates"):
                instant, n_inst = self._instant_rewards(traj, cond, uncond, guidance, prompts, meta)
            stats["reward_calls"] += n_inst["calls"]
            stats["nfe_estimates"] = stats.get("nfe_estimates", 0) + n_inst["nfe"]

        # ---------------------------------------------------------------- CREDIT (on the gathered global batch)
        with timer("credit"):
            step_rewards, instant = self.dist.gather(step_rewards), self.dist.gather(instant)
            bad = first_nonfinite(rewards=rewards, step_rewards=step_rewards, instant_rewards=instant)
            if bad is None:
                cin = CreditInput(
                    rewards=rewards, group_ids=self.dist.gather(gids), step_mask=traj.step_mask, step_rewards=step_rewards,
                    instant_rewards=instant, state=self.credit_state,
                )
                cout = assign_credit(cfg.credit, cin)
                bad = first_nonfinite(advantages=cout.advantages)
            if bad is None:
                self.credit_state = cout.state
                adv = cout.advantages.float()[self.shard.rows]  # (B, T): this rank's rows
                for k, v in cout.stats.items():
                    stats[f"credit/{k}"] = v

        # ---------------------------------------------------------------- UPDATE
        with timer("update"):
            if bad is None:
                ustats = self.update(traj, adv, cond, uncond)
            else:  # NaN/Inf: skip and count; stops the run after faults.max_nonfinite in a row
                ustats = {"pairs_trained": 0, "skipped_update": 1, "_nfe": 0, **self.nonfinite.skip(bad, self.iteration + 1)}
        stats.update(ustats)
        stats["nfe_update"] = ustats.pop("_nfe")
        counts = [k for k in ("nfe_rollout", "reward_calls", "nfe_estimates", "nfe_update") if k in stats]
        stats.update(zip(counts, (int(v) for v in self.dist.sum([stats[k] for k in counts]))))  # over all ranks
        stats["seconds"] = timer.seconds
        stats["seconds_total"] = sum(timer.seconds.values())
        stats["_images"] = images
        stats["_prompts"] = prompts
        return stats

    # ---------------------------------------------------------------------------------------------------------
    def _score_states(self, x0_hat, prompts, meta, gids, shared_initial):
        """Rewards of decoded x̂0 estimates. x0_hat: (B, T, *latent) for states j = 0..T−1. Returns (B, T), calls."""
        B, T = x0_hat.shape[:2]
        flat = x0_hat.reshape(B * T, *x0_hat.shape[2:])
        idx = torch.arange(B * T)
        if shared_initial:  # state j = 0 is shared within a group: score it once per group
            first = {}
            for b in range(B):
                first.setdefault(int(gids[b]), b)
            keep = [b * T + j for b in range(B) for j in range(T) if j > 0 or first[int(gids[b])] == b]
        else:
            keep = idx.tolist()
        p = [prompts[k // T] for k in keep]
        m = [meta[k // T] for k in keep]
        imgs = self.model.decode(flat[keep])
        scores = torch.empty(B * T)
        sc = self.call_reward(self.reward_fn, imgs, p, m).scores.float()
        scores[keep] = sc
        if shared_initial:
            for b in range(B):
                scores[b * T] = scores[first[int(gids[b])] * T]
        return scores.view(B, T), len(keep)

    def _instant_rewards(self, traj: Trajectory, cond, uncond, guidance, prompts, meta):
        """VGPO instant rewards I_j (B, T) from x̂0 of the post-action states with `instant_substeps`."""
        B, T = traj.batch_size, traj.num_steps
        states = traj.latents[:, 1:T]  # x^(1) … x^(T−1); x^(T) is the sample (I_{T−1} = R(x0))
        ts = traj.timesteps[1:T]
        flat = states.reshape(B * (T - 1), *states.shape[2:])
        tt = ts.repeat(B)
        rows = torch.arange(B).repeat_interleave(T - 1)
        v_first = traj.velocities[:, 1:T].reshape_as(flat) if traj.velocities is not None else None
        x0 = []
        cs = self.cfg.estimate.chunk_size
        for s in range(0, flat.shape[0], cs):
            sl = slice(s, s + cs)
            r = rows[sl]
            x0.append(
                denoise_estimate(
                    self.model, flat[sl], tt[sl], cond_index(cond, r), cond_index(uncond, r) if uncond is not None else None,
                    guidance, self.cfg.estimate.instant_substeps, v_first=v_first[sl] if v_first is not None else None,
                )
            )
        x0 = torch.cat(x0)
        sc = self.call_reward(self.reward_fn, self.model.decode(x0), [prompts[int(r)] for r in rows], [meta[int(r)] for r in rows]).scores.float()
        inst = torch.cat([sc.view(B, T - 1), traj.rewards[:, None]], dim=1)
        k = self.cfg.estimate.instant_substeps
        nfe = flat.shape[0] * (k - (1 if v_first is not None else 0)) * nfe_per_sample(uncond, guidance)
        return inst, {"calls": flat.shape[0], "nfe": nfe}

    def update(self, traj: Trajectory, adv: torch.Tensor, cond, uncond) -> dict[str, Any]:
        """Gradient steps on the objective's loss over (sample, step) pairs with gradient accumulation.

        The loss of one optimizer step is Σ_pairs objective.loss(pair) / N_pairs, accumulated over micro-batches of
        `optim.micro_batch` pairs, so micro-batch size never changes the gradient. The pairs and their order are planned
        on the global batch (`distributed.plan_update`; zero-advantage pairs are skipped when the objective says their
        gradient is exactly zero); each rank trains its rows with N_pairs the GLOBAL count and the gradients are summed
        over ranks. The objective (grpo / nft / awm, `flowcredit.objectives`) says what the loss of a pair is.
        """
        cfg, model, obj = self.cfg, self.model, self.objective
        oc = cfg.optim
        on_policy = oc.inner_epochs == 1 and oc.updates_per_epoch == 1
        n_pairs, epochs = plan_update(
            self.dist.gather(adv), traj.step_mask, self.shard, seed=cfg.run.seed, iteration=self.iteration + 1,
            inner_epochs=oc.inner_epochs, updates_per_epoch=oc.updates_per_epoch,
            steps_per_sample=cfg.sampler.train_steps_per_sample, skip_zero_adv=obj.skip_zero_advantage(on_policy, oc.kl_beta),
        )
        out: dict[str, Any] = {"pairs_trained": n_pairs, "_nfe": 0}
        if not n_pairs:
            out.update(loss=0.0, grad_norm=0.0, skipped_update=1, **{k: 0.0 for k in obj.sum_keys + obj.max_keys})
            if "ratio_mean" in obj.sum_keys:
                out["ratio_mean"] = 1.0
            return out
        ctx = LossContext(
            model=model, traj=traj, cond=cond, uncond=uncond, guidance=cfg.sampler.guidance_scale, params=self.params,
            reference=self._reference, on_policy=on_policy, seed=cfg.run.seed, iteration=self.iteration + 1,
            kl_beta=oc.kl_beta, micro_batch=oc.micro_batch, ref_offload=self.ref_offload,
        )
        model.train()
        out["_nfe"] += obj.prepare(ctx, [p for chunks in epochs for mine, _ in chunks for p in mine])
        acc: dict[str, list[float]] = {}
        nfe = nfe_per_sample(uncond, cfg.sampler.guidance_scale)
        for chunks in epochs:
            for mine, n_chunk in chunks:  # this rank's (row, step) pairs of one optimizer step; its global pair count
                self.opt.zero_grad(set_to_none=True)
                nonfinite_loss = False
                n_mb = self.dist.micro_batches(len(mine), oc.micro_batch)  # FSDP: the max over ranks
                for s in range(0, n_mb * oc.micro_batch, oc.micro_batch):
                    mb = mine[s : s + oc.micro_batch]
                    pad = not mb  # FSDP only: this rank is out of pairs; a zero-weight pass joins the others' collectives
                    if pad:
                        mb = [(0, int(traj.step_mask.nonzero()[0]))]
                    bi = torch.tensor([p[0] for p in mb])
                    ji = torch.tensor([p[1] for p in mb])
                    lo = obj.loss(ctx, bi, ji, adv[bi, ji])
                    mb_loss = lo.loss.sum() / n_chunk
                    if pad:
                        (mb_loss * 0.0).backward()
                        continue
                    out["_nfe"] += lo.nfe
                    nonfinite_loss |= not bool(torch.isfinite(mb_loss))
                    mb_loss.backward()
                    out["_nfe"] += len(mb) * nfe * 2  # forward + backward ≈ counted as 2 NFE-equivalents
                    for k, val in lo.sums.items():
                        acc.setdefault(k, []).append(val)
                    acc.setdefault("loss", []).append(float(lo.loss.detach().sum()))
                    for k, val in lo.maxes.items():
                        acc.setdefault(k, []).append(val)
                nonfinite_loss = self.dist.sync_grads(self.trainable, nonfinite_loss)  # Σ over ranks
                gn = clip_grad_norm(self.trainable, oc.grad_clip)  # the global norm, also of FSDP shards
                if nonfinite_loss or not torch.isfinite(gn):  # skip and count; stops after faults.max_nonfinite in a row
                    self.opt.zero_grad(set_to_none=True)
                    out["skipped_update"] = out.get("skipped_update", 0) + 1
                    out.update(self.nonfinite.skip("loss" if nonfinite_loss else "gradients", self.iteration + 1))
                    continue
                self.nonfinite.ok()
                self.opt.step()
                acc.setdefault("grad_norm", []).append(float(gn))
                self.ema_weights.update(self.trainable)
        n_total = n_pairs * oc.inner_epochs
        keys = ("loss",) + tuple(obj.sum_keys)
        for k, v in zip(keys, self.dist.sum([sum(acc.get(k, [0.0])) for k in keys])):  # Σ over ranks
            out[k] = v / n_total
        out["grad_norm"] = float(np.mean(acc.get("grad_norm", [0.0])))
        for k in obj.max_keys:
            out[k] = self.dist.max([max(acc.get(k, [0.0]))])[0]
        return out

    def guard(self, stats: dict[str, Any]) -> None:
        """Hacking guard (run.gold_reward): the alarm sees the training reward and diversity every iteration and the
        held-out gold reward (sampled with the EMA weights) every run.gold_every iterations; gold.jsonl, stderr."""
        if self.guard_ is None or not self.dist.evaluates:
            return
        from ..eval.evaluate import generate

        rc = self.cfg.run

        def sample(prompts, metadata):
            self.model.eval()
            with self.ema_weights.swapped_in(self.trainable):
                return generate(self.model, prompts, steps=rc.eval_steps, guidance=rc.eval_guidance, seed=rc.seed + 999, shift=self.cfg.sampler.shift)

        line = self.guard_.step(self.iteration, stats, sample)
        if line is None or not self.dist.is_main:  # FSDP: the other ranks only joined the sharded forwards
            return
        with open(self.out / "gold.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if line["alarm"]:
            print(f"warning: reward-hacking alarm at iteration {self.iteration}: {line['message']}", file=sys.stderr)

    def _reference(self):
        """Context yielding the reference policy π_ref: a frozen copy of the initial weights, or the model itself
        with its LoRA adapter disabled when it provides `reference()` (Flow-GRPO: `disable_adapter()`)."""
        if self.ref_model is not None:
            return contextlib.nullcontext(self.ref_model)
        return self.model.reference()

    # ------------------------------------------------------------------------------------------- logging / io
    def log(self, stats: dict[str, Any]) -> None:
        if self.metrics_f is None:  # not rank 0
            return
        inject_point("log", self.iteration)
        rec = {"iteration": self.iteration}
        for k, v in stats.items():
            if k.startswith("_"):
                continue
            rec[k] = v
        self.metrics_f.write(json.dumps(rec) + "\n")
        self.metrics_f.flush()
        if self.loggers:
            scalars = scalars_of(rec)  # finite numbers + seconds/<phase>
            for logger in self.loggers:
                logger.log_scalars(self.iteration, scalars)

    def save_grid(self, images: torch.Tensor, prompts: list[str]) -> None:
        """`grids/iterNNNNN.png`: one row per prompt group (G samples), its prompt as the row's caption; the prompts
        also go to `grids/iterNNNNN.txt`. images: (B, 3, H, W) in [0, 1], group-major like `prompts` (B,)."""
        from ..eval.evaluate import caption_grid, save_png

        if not self.dist.is_main:
            return
        G = self.cfg.data.group_size
        u8 = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        save_png(caption_grid(u8, list(prompts), ncol=G, scale=3), self.out / "grids" / f"iter{self.iteration:05d}.png")
        (self.out / "grids" / f"iter{self.iteration:05d}.txt").write_text("\n".join(prompts[::G]) + "\n")

    @property
    def ema(self) -> list[torch.Tensor] | None:
        """The EMA weights in the order of `self.trainable` (None when optim.ema_decay = 0)."""
        return self.ema_weights.shadow

    @ema.setter
    def ema(self, tensors: list[torch.Tensor] | None) -> None:
        self.ema_weights.shadow = tensors

    def periodic_eval(self) -> None:
        from ..eval.evaluate import evaluate, tag_balanced_subset

        if not self.dist.evaluates:  # rank 0; under FSDP every rank (the forwards are collectives), rank 0 writes
            return
        sub = tag_balanced_subset(self.eval_prompts, self.cfg.run.eval_subset)
        self.model.eval()
        t0 = time.time()
        with self.ema_weights.swapped_in(self.trainable):
            s = evaluate(self.model, sub, **self._eval_kwargs())
        rec = {"iteration": self.iteration, "eval_reward": s["reward_mean"], "eval_strict": s.get("strict_overall"), "eval_seconds": time.time() - t0}
        if self.dist.is_main:
            with open(self.out / "eval_curve.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        inject_point("eval", self.iteration)
        scalars = {"eval/reward": s["reward_mean"]}
        if s.get("strict_overall") is not None:
            scalars["eval/strict_overall"] = s["strict_overall"]
        for logger in self.loggers:
            logger.log_scalars(self.iteration, scalars)

    def final_eval(self) -> dict[str, Any]:
        """eval.json: the trained model (EMA weights if on) and, with run.eval_baseline, the initial model, on the
        same prompts with the same noise, via the same code path as `flowcredit eval`."""
        from ..eval.evaluate import evaluate

        kw = self._eval_kwargs()
        self.model.eval()
        t0 = time.time()
        main = self.dist.is_main  # under FSDP every rank evaluates (collective forwards); rank 0 writes
        with self.ema_weights.swapped_in(self.trainable):
            trained = evaluate(self.model, self.eval_prompts, out_dir=self.out / "eval" if main else None, write_samples=False, **kw)
        result: dict[str, Any] = {"trained": trained, "eval_seconds": time.time() - t0}
        if self.initial_state is not None:
            cache = self._baseline_cache_file(kw)
            if cache is not None and cache.is_file():
                base = json.loads(cache.read_text())
                result["base_cached"] = str(cache)
            else:
                current = {k: v.detach().clone() for k, v in self.model.net.state_dict().items()}
                self.model.net.load_state_dict(self.initial_state)
                base = evaluate(self.model, self.eval_prompts, out_dir=self.out / "eval_base" if main else None, write_samples=False, **kw)
                self.model.net.load_state_dict(current)
                if cache is not None and main:
                    cache.parent.mkdir(parents=True, exist_ok=True)
                    tmp = cache.with_suffix(f".tmp{os.getpid()}")
                    tmp.write_text(json.dumps(base))
                    os.replace(tmp, cache)  # atomic: runs in parallel never read a half-written file
            result["base"] = base
            result["delta"] = {
                "reward_mean": trained["reward_mean"] - base["reward_mean"],
                **({"strict_overall": trained["strict_overall"] - base["strict_overall"],
                    "correct_overall": trained["correct_overall"] - base["correct_overall"]} if "strict_overall" in base else {}),
            }
        if main:
            (self.out / "eval.json").write_text(json.dumps(result, indent=2))
        return result

    def _baseline_cache_file(self, eval_kw: dict[str, Any]) -> Path | None:
        """`<run.eval_baseline_cache>/<sha256>.json` for the initial model's final evaluation, or None (cache off,
        or several processes, whose weights may be sharded). The key hashes everything the evaluation depends on:
        the initial weights' bytes, the evaluation prompts and metadata, sampler settings, noise seed and reward."""
        if not self.cfg.run.eval_baseline_cache or self.dist.world_size > 1:
            return None
        h = hashlib.sha256()
        for k in sorted(self.initial_state):
            t = self.initial_state[k].detach().cpu().contiguous()
            h.update(k.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        settings = {k: v for k, v in eval_kw.items() if k != "reward"}
        h.update(json.dumps({"prompts": self.eval_prompts.prompts, "metadata": self.eval_prompts.metadata, "eval": settings,
                             "reward": dataclasses.asdict(self.cfg.reward), "model": dataclasses.asdict(self.cfg.model)},
                            sort_keys=True, default=str).encode())
        return Path(self.cfg.run.eval_baseline_cache) / f"{h.hexdigest()}.json"

    # ------------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            # under FSDP gathered to full tensors on rank 0 (collectives), the layout of an unsharded run
            "model": checkpoint.model_state(self.model.net),
            "optimizer": checkpoint.optimizer_state(self.model.net, self.opt, self.trainable_names),
            "ema": self._ema_state(),
            "model_config": dataclasses.asdict(self.model.cfg),
            "lora": getattr(self.model, "lora", None) if self.cfg.model.name == "tiny" else None,  # tiny: rebuild the adapter to load
            "credit_state": self.credit_state,
            "torch_rng": self.gen.get_state(),
            "global_torch_rng": torch.get_rng_state(),
            "rng_per_rank": self.dist.gather_object(rng_states()),  # every RNG of every rank (collective)
            "prompt_sampler": self.prompt_sampler.state_dict(),
            "faults": self.nonfinite.state_dict(),
            "harness": self.harness_state(),  # time-budget measurements, hacking-guard gold/alarm history
            "world_size": self.dist.world_size,
        }

    def harness_state(self) -> dict[str, Any]:
        """state_dict of every stateful harness object (the EMA weights travel as tensors under "ema")."""
        st: dict[str, Any] = {"budget": self.budget.state_dict()}
        if self.guard_ is not None:
            st["guard"] = self.guard_.state_dict()
        return st

    def load_harness_state(self, st: dict[str, Any]) -> None:
        if "budget" in st:
            self.budget.load_state_dict(st["budget"])
        if self.guard_ is not None and "guard" in st:
            self.guard_.load_state_dict(st["guard"])

    def _ema_state(self) -> dict[str, torch.Tensor] | None:
        """The EMA weights by parameter name; under FSDP (EMA sharded like the weights) gathered to rank 0."""
        if self.ema is None:
            return None
        if not self.dist.fsdp:
            return dict(zip(self.trainable_names, self.ema))
        full = checkpoint.full_tensors(self.ema, keep=self.dist.is_main)
        return dict(zip(self.trainable_names, full)) if full is not None else None

    def save_checkpoint(self) -> Path:
        """Rank 0 writes every state atomically as `checkpoints/iterNNNNNN/` (tensors.safetensors + state.json +
        manifest.json with sha256, `checkpoint.save`); keeps the two newest."""
        state = self.checkpoint_state()  # every rank takes part (RNG gather)
        path = self.out / "checkpoints" / f"iter{self.iteration:06d}"
        if self.dist.is_main:
            checkpoint.save(state, path, iteration=self.iteration, keep=2, fault=lambda phase: inject_point(phase, self.iteration))
        return path

    def latest_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies; a damaged one is skipped with a warning naming it and the one used.
        None for a fresh run folder; TrainingError (one line) when checkpoints exist but none is intact."""
        try:
            return checkpoint.find_latest(self.out / "checkpoints", warn=self.dist.is_main)
        except checkpoint.CheckpointError as e:
            raise TrainingError(f"cannot resume {self.out}: {e}") from None

    def load_checkpoint(self, path: Path) -> None:
        """Restore every state from checkpoint folder `path` (verified; never unpickles)."""
        try:
            st = checkpoint.load(path)
        except checkpoint.CheckpointError as e:
            raise TrainingError(str(e)) from None
        checkpoint.load_model_state(self.model.net, st["model"])  # FSDP: each rank keeps its shard
        checkpoint.load_optimizer_state(self.model.net, self.opt, self.trainable_names, st["optimizer"])
        if st["ema"] is not None and self.dist.fsdp:  # the EMA is sharded like the weights
            self.ema = checkpoint.shard_like([st["ema"][n] for n in self.trainable_names], self.trainable)
        else:
            self.ema = [st["ema"][n].to(self.device) for n in self.trainable_names] if st["ema"] is not None else None
        self.credit_state = st["credit_state"]
        self.gen.set_state(st["torch_rng"])
        torch.set_rng_state(st["global_torch_rng"])
        if st.get("rng_per_rank"):
            set_rng_states(st["rng_per_rank"][min(self.dist.rank, len(st["rng_per_rank"]) - 1)])
        self.prompt_sampler.load_state_dict(st["prompt_sampler"])
        self.nonfinite.load_state_dict(st.get("faults", {}))
        self.load_harness_state(st.get("harness", {}))
        self.iteration = st["iteration"]
