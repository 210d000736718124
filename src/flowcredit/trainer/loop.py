"""THE training loop of every method: credit (Flow-GRPO, Stepwise-Flow-GRPO, VGPO) × objective (grpo, nft, awm).

`train()` + `train_step()` read as the pseudocode of one iteration:

    prompts, groups = shard.draw(P, G)
    traj    = rollout(policy, prompts, sampler)                      # no grad, records log π_old
    rewards = reward(decode(x_T))                                    # (B,)
    if the credit requires them: ρ_j = reward(decode(x̂0(x^(j))))     # (B, T+1), Stepwise §4.1 / VGPO §5.2
    adv     = assign_credit(cfg.credit, rewards, ρ, groups)          # (B, T)
    for every optimizer step, over its trained (sample, step) pairs:
        loss = Σ objective.loss(pair, adv) / N_pairs                 # grpo: PPO-clip + β·KL; nft; awm
        backward → Σ over ranks → clip → optimizer step → EMA
    log → checkpoint

The phases return typed records (`records.py`); what a checkpoint holds is `state.TrainState`; the harness (time
budget, EMA, hacking guard, FSDP padding, stop conditions) is `harness.py`. On-policy, θ_old = θ and the ratio is
exactly 1; the rollout's log-probs are compared with the recomputed ones every iteration (`parity_max_abs_dlogp`).
Scale and faults: docs/SCALING.md; only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, cast

import torch

from ..config.schema import TrainConfig
from ..credit.base import CreditInput
from ..credit.registry import assign_credit, estimated_states, needs_instant_rewards, needs_step_rewards
from ..models.factory import build_model, set_trainable  # (also: the model registry is known to the config)
from ..objectives import LossContext
from ..rewards.guards import group_diversity
from ..samplers.policy import nfe_per_sample
from ..samplers.rollout import rollout
from ..samplers.schedules import rollout_grid
from ..types import Trajectory, cond_repeat
from .data import load_run_inputs
from .distributed import (
    Chunk,
    Dist,
    Shard,
    layout_noise,
    plan_update,
    seed_global_rngs,
    step_draw_window,
    update_pairs,
)
from .evaluation import RunEvaluation, guard_step
from .faults import NonFiniteGuard, RetryingCall, first_nonfinite, inject_point, one_line
from .fsdp import apply_fsdp, clip_grad_norm
from .harness import (
    DistPadding,
    EMAWeights,
    HackingGuard,
    LRSchedule,
    MovingReference,
    PhaseTimer,
    RunLoop,
    SoftOldPolicy,
    TimeBudget,
)
from .intermediate import drawn_mask, intermediate_rewards
from .loggers import check_logger_names, save_grid, write_metrics
from .memory import (
    KLReferences,
    ReferenceOffload,
    build_optimizer,
    enable_gradient_checkpointing,
    keep_freed_host_memory,
)
from .preflight import check_memory
from .records import Credit, Iteration, Rollout, Scores, UpdatePlan, UpdateStats
from .state import TrainState, open_run_folder, save_checkpoint


class Trainer:
    """The trainer of every credit × objective pair. `setup()` builds everything and validates inputs before
    anything is written; `train()` runs the loop; `self.state` (`TrainState`) is what a checkpoint holds."""

    def __init__(self, cfg: TrainConfig, preset_name: str = "custom"):
        self.cfg = cfg
        self.preset_name = preset_name
        self.t_created = time.time()  # run.budget_minutes counts from here (setup included)

    # ------------------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        """Build everything; inputs are checked first, so bad input writes nothing (one TrainingError line)."""
        cfg = self.cfg
        seed_global_rngs(cfg.run.seed)  # before anything is built: the same weights in every run and on every rank

        # validate inputs first: nothing is written to the run folder on bad input (one line naming the key)
        inputs = load_run_inputs(cfg)
        self.train_prompts, self.eval_prompts = inputs.train_prompts, inputs.eval_prompts
        self.prompt_sampler, self.reward_fn, self.objective = inputs.prompt_sampler, inputs.reward_fn, inputs.objective

        self._build_model()
        self._build_harness()
        self._open_run()

    def _build_model(self) -> None:
        """Processes, the model and its trainable set, KL references, memory preflight, FSDP sharding."""
        cfg = self.cfg
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        if cfg.run.keep_freed_memory:
            keep_freed_host_memory()
        self.dist = Dist.create(cfg.dist.enabled, cfg.run.device)  # accelerate when launched on N processes
        with one_line():
            dist = self.dist
            d = cfg.data
            self.shard = Shard.create(d.prompts_per_iter, d.group_size, dist.rank, dist.world_size,
                                      cfg.dist.split_groups)
        self.device = torch.device(self.dist.device)
        self.model = build_model(cfg.model, str(self.device))
        self.trainable = set_trainable(self.model, cfg.model.trainable)
        self.trainable_names = [n for n, p in self.model.net.named_parameters() if p.requires_grad]
        self.model.train()
        self.refs = KLReferences(self.model, cfg.optim.kl_beta, cfg.optim.kl_reference == "ema",
                                 cfg.optim.kl_base_beta)  # π_ref (and the base of kl_base_beta): copies or LoRA off
        self.ref_model, self.base_model = self.refs.ref_model, self.refs.base_model
        self.ref_offload = ReferenceOffload(self.ref_model, self.device, cfg.optim.offload_reference)
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        with one_line():  # a batch too large for memory fails here, before anything is written (trainer/preflight.py)
            has_ref = self.ref_model is not None
            check_memory(cfg, self.model, self.device, self.dist.world_size, reference_loaded=has_ref)
            check_logger_names(cfg.run.loggers)
        if cfg.dist.fsdp:  # shard the network (and the reference copy unless it is offloaded) over the processes
            with one_line():
                sharded = apply_fsdp(self.dist, self.model, None if self.ref_offload.enabled else self.ref_model,
                                     groups_per_rank_even=cfg.data.prompts_per_iter % self.dist.world_size == 0,
                                     more_refs=[self.base_model] if self.base_model is not None else [])
            self.trainable = sharded if sharded is not None else self.trainable

    def _build_harness(self) -> None:
        """Optimizer, EMA, moving reference, soft π_old, hacking guard, time budget, lr schedule, time grid."""
        from ..rewards.registry import build_reward

        cfg = self.cfg
        self.initial_state = None
        if cfg.run.eval_baseline and cfg.run.eval_at_end:
            self.initial_state = {k: v.detach().clone() for k, v in self.model.net.state_dict().items()}
        oc = cfg.optim
        self.opt = build_optimizer(self.trainable, oc.offload_optimizer, lr=oc.lr, betas=tuple(oc.betas),
                                   weight_decay=oc.weight_decay, eps=oc.eps)
        # the harness (trainer/harness.py): EMA of the weights, hacking guard, time budget; all saved in checkpoints
        self.ema_weights = EMAWeights(self.trainable, cfg.optim.ema_decay)
        self.moving_ref = None
        if self.ref_model is not None and oc.kl_reference == "ema":
            self.moving_ref = MovingReference(self.ref_model.net, self.trainable_names, oc.kl_reference_decay,
                                              oc.kl_reference_decay_rate)
        # nft's old_policy=soft (optional Objective attribute `old_policy_decay`, objectives/base.py): π_old is a
        # soft-updated copy of the trainable weights that samples the rollouts and gives v_old (DiffusionNFT)
        old_decay = getattr(self.objective, "old_policy_decay", None)
        self.old_policy = SoftOldPolicy(self.trainable, *old_decay) if old_decay is not None else None
        self.guard_ = HackingGuard.from_config(cfg.run, build_reward)
        self.budget = TimeBudget(cfg.run.budget_minutes, self.t_created, self.eval_forwards)
        decay_iters = min(cfg.run.iterations, oc.lr_decay_iterations or cfg.run.iterations)
        self.lr_schedule = LRSchedule(oc.lr, oc.lr_schedule, oc.lr_final, oc.warmup_iters, decay_iters)
        seed_global_rngs(cfg.run.seed, self.dist.rank)  # built: later global draws (a plugin's dropout) per rank
        with one_line():
            self.timesteps = rollout_grid(cfg.sampler, self.model, cfg.model.name)
        self.params = cfg.sampler  # the step parameters (config.schema.SamplerParams is SamplerCfg's base)
        self.nonfinite = NonFiniteGuard(cfg.faults.max_nonfinite, self.dist.is_main)
        self.padding = DistPadding(self.dist, cfg.optim.micro_batch)  # FSDP: equal micro-batch passes on every rank
        fc = cfg.faults
        self.call_reward = RetryingCall(fc.reward_retries, fc.reward_backoff, fc.reward_timeout)
        self.uncond1 = self.model.encode_prompts([""]) if cfg.sampler.guidance_scale != 1.0 else None


    def _open_run(self) -> None:
        """The run folder: its evaluations, the TrainState, config.yaml, resume, metrics.jsonl and loggers."""
        cfg = self.cfg
        out = cfg.run.out_dir or f"runs/{self.preset_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.out = Path(self.dist.broadcast_object(out))  # rank 0 writes; every rank reads the checkpoint
        self.evaluation = None
        if cfg.run.eval_at_end or cfg.run.eval_every:
            self.evaluation = RunEvaluation(cfg, self.model, self.reward_fn, self.eval_prompts, self.initial_state,
                                            self.dist, self.out, self.ema_weights, self.trainable)
        # what a checkpoint holds (trainer/state.py); the trainer updates these objects as it trains
        self.state = TrainState(
            model=self.model, model_name=cfg.model.name, opt=self.opt, trainable=self.trainable,
            trainable_names=self.trainable_names, dist=self.dist, prompt_sampler=self.prompt_sampler,
            nonfinite=self.nonfinite, budget=self.budget, ema_weights=self.ema_weights, guard=self.guard_,
            moving_ref=self.moving_ref, old_policy=self.old_policy,
        )
        self.metrics_f, self.loggers = open_run_folder(self.out, cfg, self.state)  # resumes from the newest intact
        # checkpoint; metrics.jsonl and the loggers on rank 0

    @property
    def iteration(self) -> int:
        """Iterations done (`TrainState.iteration`)."""
        return self.state.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.state.iteration = value

    @property
    def credit_state(self) -> dict[str, torch.Tensor]:
        """The credit estimator's cross-iteration state (`TrainState.credit_state`, e.g. the Stepwise EMA)."""
        return self.state.credit_state

    @credit_state.setter
    def credit_state(self, value: dict[str, torch.Tensor]) -> None:
        self.state.credit_state = value

    def save_checkpoint(self) -> Path:
        """`checkpoints/iterNNNNNN/` of the current state (`state.save_checkpoint`; collective)."""
        return save_checkpoint(self.out, self.state)

    # -------------------------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, Any]:
        """THE loop: rollout → reward → credit → objective loss → optimizer step (`train_step`) → log → checkpoint,
        until run.iterations, a time limit or a signal (`harness.RunLoop`); then the final evaluation."""
        cfg = self.cfg
        with RunLoop(cfg, self.dist, self.budget, self.iteration) as loop:
            if cfg.run.eval_every and self.iteration == 0 and self.dist.evaluates:
                self.periodic_eval()  # the curve starts at the initial model
            while loop.running(self.iteration):
                t_iter = time.time()
                it = self.train_step()  # rollout → reward → credit → objective loss → optimizer step
                self.iteration += 1
                # ---------------------------------------------------------------- LOG
                metrics = it.metrics()
                if self.iteration % cfg.run.log_every == 0:
                    self.log(metrics)
                if cfg.run.grid_every and self.iteration % cfg.run.grid_every == 0:
                    self.save_grid(it.scores.images, it.rollout.prompts)
                if cfg.run.eval_every and self.iteration % cfg.run.eval_every == 0:
                    self.periodic_eval()
                self.guard(metrics)
                # ---------------------------------------------------------------- CHECKPOINT
                every = cfg.run.checkpoint_every
                if (every and self.iteration % every == 0) or self.iteration == cfg.run.iterations:
                    self.save_checkpoint()
                if not loop.end_iteration(metrics, time.time() - t_iter):
                    break
            loop.close_bar()
            self.save_checkpoint()
        result = loop.result(self.iteration)
        if not loop.stopped and cfg.run.eval_at_end and self.dist.evaluates:
            result["eval"] = self.final_eval()
        self.close()
        return result

    def train_step(self) -> Iteration:
        """One iteration of the algorithm: rollout → reward → credit → objective loss → optimizer steps.

        On N processes this rank rolls out and scores its B/N rows of the global batch; the rewards are gathered so
        the credit (and every statistic) sees the global batch, and the rank keeps its rows' advantages.
        """
        timer = PhaseTimer(iteration=self.iteration + 1)
        with timer("rollout"):  # no grad: latents, log π_old of every step, the trained-step mask
            ro = self.rollout()
        with timer("reward"):  # R(x0) of the decoded final images, retried per `faults`
            scores = self.reward(ro)
        scores = self.step_rewards(ro, scores, timer)  # ρ_j / I_j of the x̂0 estimates, if the credit needs them
        with timer("credit"):  # advantages (B, T) from the gathered global batch; None on NaN/Inf input
            credit = self.credit(ro, scores)
        with timer("update"):  # objective loss over the trained (sample, step) pairs → optimizer steps
            plan = self.plan_update(ro, credit)
            for chunk in plan.steps():  # one optimizer step: Σ pair losses / N → backward → Σ ranks → clip → step
                self.optimizer_step(plan, chunk)
            update = self.finish_update(plan)
        counts = {"nfe_rollout": ro.nfe, "reward_calls": scores.reward_calls, "nfe_update": update.nfe}
        if scores.nfe_estimates is not None:
            counts["nfe_estimates"] = scores.nfe_estimates
        counts = dict(zip(counts, (int(v) for v in self.dist.sum(list(counts.values())))))  # Σ over ranks
        return Iteration(ro, scores, credit, update, timer.seconds, counts)

    # ---------------------------------------------------------------------------------- the phases of train_step
    def rollout(self) -> Rollout:
        """This rank's rows: prompts, conditioning and the SDE/ODE trajectory (noise seeded per (seed, iteration,
        group), so the samples are the same on 1 or N processes); the objective marks the trained steps."""
        cfg, model = self.cfg, self.model
        prompts, meta, gids = self.shard.draw(self.prompt_sampler)  # this rank's rows; group ids are global
        B = len(prompts)
        guidance = cfg.sampler.guidance_scale
        model.eval()
        cond = model.encode_prompts(prompts)
        uncond = cond_repeat(self.uncond1, B) if self.uncond1 is not None else None
        T, it = len(self.timesteps) - 1, self.iteration + 1
        init, noise = layout_noise(cfg.run.seed, it, self.shard, model.latent_shape, T, cfg.shared_noise)
        with self._old_weights():  # nft old_policy=soft: π_old samples the rollouts (DiffusionNFT)
            traj = rollout(
                model, prompts, meta, gids, timesteps=self.timesteps, sampler=self.params, guidance_scale=guidance,
                generator=None, init_noise=init, step_noise=noise, cond=cond, uncond=uncond,
                keep_velocities=needs_step_rewards(cfg.credit) or needs_instant_rewards(cfg.credit),
                train_fraction=cfg.sampler.timestep_fraction, ode_untrained=cfg.sampler.ode_untrained,
            )
        # grpo trains the stochastic steps inside timestep_fraction; forward-process objectives the first
        # int(T·fraction) steps whatever the rollout SDE (an ODE rollout has no σ > 0 step), or every step with
        # sampler.train_step_draw=nft (`distributed.step_draw_window`)
        s = cfg.sampler
        fraction, _ = step_draw_window(s.train_step_draw, T, s.timestep_fraction, s.train_steps_per_sample)
        traj.step_mask = self.objective.trained_steps(traj, fraction)
        nfe = B * traj.num_steps * nfe_per_sample(self.uncond1, guidance)
        return Rollout(prompts, meta, gids, cond, uncond, traj, nfe)

    def reward(self, ro: Rollout) -> Scores:
        """R(x0) of the decoded images (gathered (B_global,)), reward statistics and the within-group diversity."""
        images = self.model.decode(ro.traj.latents[:, -1])
        out = self.call_reward(self.reward_fn, images, ro.prompts, ro.meta, group_ids=ro.gids)  # retried per `faults`
        ro.traj.rewards = out.scores.float()
        rewards = self._gathered(ro.traj.rewards)  # (B_global,)
        stats = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
                 # hacking guard: within-group diversity (mean pairwise RMS pixel distance); collapse = mode collapse
                 "diversity": float(self._gathered(group_diversity(images, ro.gids)).mean())}  # every rank's groups
        for k, v in out.components.items():
            stats[f"{k}_mean"] = float(self._gathered(v.float()).mean())
        return Scores(images, rewards, None, None, len(ro.prompts), None, stats)

    def step_rewards(self, ro: Rollout, scores: Scores, timer: PhaseTimer) -> Scores:
        """`scores` with ρ_j / I_j of the x̂0 estimates when the credit method requires them (Stepwise §4.1, VGPO
        §5.2; `intermediate.py`); with a soft-updated π_old (nft old_policy=soft) the estimates follow the policy
        that sampled the trajectory."""
        if not (needs_step_rewards(self.cfg.credit) or needs_instant_rewards(self.cfg.credit)):
            return scores
        gain_mask = states = None
        if estimated_states(self.cfg.credit) == "drawn":  # only the states the drawn pairs' gains need
            gain_mask, states = drawn_mask(self._draw_pairs(ro.traj), self.shard.global_batch, ro.traj.num_steps)
            states = states[self.shard.rows]
        with self._old_weights():
            step_rewards, instant, est = intermediate_rewards(
                self.model, self._score, ro.traj, ro.cond, ro.uncond, self.cfg, ro.prompts, ro.meta, ro.gids, timer,
                states,
            )
        return dataclasses.replace(scores, step_rewards=step_rewards, instant=instant, gain_mask=gain_mask,
                                   reward_calls=scores.reward_calls + est.calls, nfe_estimates=est.nfe)

    def _draw_pairs(self, traj: Trajectory) -> list[tuple[int, int]]:
        """The (global row, step) pairs this iteration's update may train (`distributed.update_pairs`), drawn
        before the credit when it estimates only their states (states=drawn) and planned by `plan_update`."""
        crn = getattr(self.objective, "shares_steps_in_group", False)  # optional Objective attribute
        groups = self._gathered(traj.group_ids).tolist() if crn else None
        return update_pairs(self.cfg.sampler, traj.step_mask, self.shard.global_batch, self.cfg.run.seed,
                            self.iteration + 1, groups)

    def credit(self, ro: Rollout, scores: Scores) -> Credit:
        """This rank's advantages (B, T) from `assign_credit` on the global batch, or what was non-finite. The
        estimator's cross-iteration state (e.g. the Stepwise EMA baseline) is kept on success."""
        step_rewards, instant = self.dist.gather(scores.step_rewards), self.dist.gather(scores.instant)
        bad = first_nonfinite(rewards=scores.rewards, step_rewards=step_rewards, instant_rewards=instant)
        if bad is not None:
            return Credit(None, bad, {})
        cin = CreditInput(rewards=scores.rewards, group_ids=self._gathered(ro.gids), step_mask=ro.traj.step_mask,
                          step_rewards=step_rewards, instant_rewards=instant, gain_mask=scores.gain_mask,
                          state=self.credit_state)
        cout = assign_credit(self.cfg.credit, cin)
        bad = first_nonfinite(advantages=cout.advantages)
        if bad is not None:
            return Credit(None, bad, {})
        self.credit_state = cout.state
        return Credit(cout.advantages.float()[self.shard.rows], None, dict(cout.stats))  # (B, T): this rank's rows

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """`Dist.gather` of a tensor present on every rank: (B_local, ...) → (B_global, ...)."""
        return cast(torch.Tensor, self.dist.gather(t))

    def _score(self, images: torch.Tensor, prompts: list, meta: list) -> torch.Tensor:
        """(n,) rewards of decoded images, retried per `faults` (the intermediate rewards' reward call)."""
        return self.call_reward(self.reward_fn, images, prompts, meta).scores.float()

    def plan_update(self, ro: Rollout, credit: Credit) -> UpdatePlan:
        """The (sample, step) pairs of every optimizer step, planned on the global batch (`distributed.plan_update`;
        zero-advantage pairs skipped when their gradient is exactly zero). A step's loss is Σ pair losses / N_pairs
        (the GLOBAL count) over micro-batches of `optim.micro_batch` pairs; a non-finite credit plans no step."""
        cfg, obj, oc, traj = self.cfg, self.objective, self.cfg.optim, ro.traj
        if credit.advantages is None:  # NaN/Inf: skip and count; stops the run after faults.max_nonfinite in a row
            skip = self.nonfinite.skip(credit.nonfinite or "credit", self.iteration + 1)
            return UpdatePlan(None, torch.zeros(0), [], 0, 0, None, skipped=1, nonfinite=skip)
        adv = credit.advantages
        on_policy = oc.inner_epochs == 1 and oc.updates_per_epoch == 1
        lr = self.lr_schedule.apply(self.opt, self.iteration, self.budget.progress)  # None: constant, untouched
        n_pairs, n_computed, epochs = plan_update(
            self._gathered(adv), traj.step_mask, self.shard, seed=cfg.run.seed, iteration=self.iteration + 1,
            inner_epochs=oc.inner_epochs, updates_per_epoch=oc.updates_per_epoch, pairs=self._draw_pairs(traj),
            skip_zero_adv=obj.skip_zero_advantage(on_policy, oc.kl_beta + oc.kl_base_beta), loss_mean=oc.loss_mean,
        )
        if not any(epochs):
            return UpdatePlan(None, adv, [], n_pairs, n_computed, lr)
        ctx = LossContext(
            model=self.model, traj=traj, cond=ro.cond, uncond=ro.uncond, guidance=cfg.sampler.guidance_scale,
            params=self.params, reference=self.refs.reference, on_policy=on_policy, seed=cfg.run.seed,
            iteration=self.iteration + 1, kl_beta=oc.kl_beta, micro_batch=oc.micro_batch, ref_offload=self.ref_offload,
            row_start=self.shard.start, batch_global=self.shard.global_batch,
            old_policy=self._old_weights if self.old_policy is not None else None,
            kl_base_beta=oc.kl_base_beta, base_reference=self.refs.base if oc.kl_base_beta > 0 else None,
        )
        self.model.train()
        plan = UpdatePlan(ctx, adv, epochs, n_pairs, n_computed, lr)
        plan.nfe += obj.prepare(ctx, [p for chunk in plan.steps() for p in chunk.mine])
        return plan

    def optimizer_step(self, plan: UpdatePlan, chunk: Chunk) -> None:
        """One optimizer step on this rank's pairs `chunk.mine` (loss / the global normaliser `chunk.n_norm`):
        accumulate over micro-batches (FSDP-padded, `harness.DistPadding`), Σ gradients over ranks, clip, skip
        non-finite, step, EMA. Adds its statistics and NFEs to `plan`."""
        obj, ctx = self.objective, plan.ctx
        assert ctx is not None, "plan_update plans no step without a loss context"
        nfe_pair = nfe_per_sample(ctx.uncond, ctx.guidance)
        start_step = getattr(obj, "start_step", None)  # optional hook: per-step draws over the global pairs
        if start_step is not None:
            start_step(ctx, chunk.pairs)
        self.opt.zero_grad(set_to_none=True)
        nonfinite_loss = False
        for mb, pad in self.padding.chunks(chunk.mine, ctx.traj.step_mask):
            bi = torch.tensor([p[0] for p in mb])
            ji = torch.tensor([p[1] for p in mb])
            lo = obj.loss(ctx, bi, ji, plan.adv[bi, ji])
            mb_loss = lo.loss.sum() / chunk.n_norm
            if pad:
                self.padding.backward_padding(mb_loss)
                continue
            plan.nfe += lo.nfe
            nonfinite_loss |= not bool(torch.isfinite(mb_loss))
            mb_loss.backward()
            plan.nfe += len(mb) * nfe_pair * 2  # forward + backward ≈ counted as 2 NFE-equivalents
            for k, val in (*lo.sums.items(), ("loss", float(lo.loss.detach().sum())), *lo.maxes.items()):
                plan.add(k, val)
        nonfinite_loss = self.dist.sync_grads(self.trainable, nonfinite_loss)  # Σ over ranks
        gn = clip_grad_norm(self.trainable, self.cfg.optim.grad_clip)  # the global norm, also of FSDP shards
        if nonfinite_loss or not torch.isfinite(gn):  # skip and count; stops after faults.max_nonfinite in a row
            self.opt.zero_grad(set_to_none=True)
            plan.skipped += 1
            plan.nonfinite = self.nonfinite.skip("loss" if nonfinite_loss else "gradients", self.iteration + 1)
            return
        self.nonfinite.ok()
        self.opt.step()
        if self.old_policy is not None:
            self.old_policy.steps += 1  # DiffusionNFT's global_step: the decay ramp counts optimizer steps
        plan.add("grad_norm", float(gn))
        self.ema_weights.update(self.trainable)
        if self.moving_ref is not None:  # optim.kl_reference=ema
            self.moving_ref.update(self.trainable)

    def finish_update(self, plan: UpdatePlan) -> UpdateStats:
        """The update's statistics (Σ / max over ranks); nft old_policy=soft: θ_old ← d·θ_old + (1 − d)·θ at the end
        of every epoch (DiffusionNFT)."""
        obj = self.objective
        if plan.ctx is None and plan.nonfinite:  # skipped for a non-finite credit: nothing was measured
            out = UpdateStats(pairs_trained=0, skipped_update=1, nonfinite=plan.nonfinite)
        else:
            out = plan.summary(self.dist.sum, self.dist.max, tuple(obj.sum_keys), tuple(obj.max_keys),
                               self.cfg.optim.inner_epochs)
        if self.old_policy is not None:
            out.old_policy_decay = self.old_policy.update(self.trainable)
        return out

    def guard(self, metrics: dict[str, Any]) -> None:
        """Hacking guard (run.gold_reward, `evaluation.guard_step`): the training reward and diversity every
        iteration, the held-out gold reward of the EMA weights every run.gold_every iterations → gold.jsonl."""
        if self.guard_ is not None and self.dist.evaluates:
            guard_step(self.guard_, self.iteration, metrics, self.cfg, self.model, self.ema_weights, self.trainable,
                       self.out / "gold.jsonl", self.dist.is_main)

    def _old_weights(self):
        """Context in which the model holds π_old's weights: the soft-updated copy of nft's old_policy=soft
        (`harness.SoftOldPolicy`), else the current weights (a no-op)."""
        if self.old_policy is None:
            return contextlib.nullcontext()
        return self.old_policy.swapped_in(self.trainable)

    # ------------------------------------------------------------------------------------------- logging / io
    def log(self, stats: dict[str, Any]) -> None:
        if self.metrics_f is not None:  # rank 0
            inject_point("log", self.iteration)
            write_metrics(self.metrics_f, self.loggers, self.iteration, stats)

    def save_grid(self, images: torch.Tensor, prompts: list[str]) -> None:
        if self.dist.is_main:
            save_grid(images, prompts, self.cfg.data.group_size, self.out / "grids", self.iteration)

    def periodic_eval(self) -> None:
        assert self.evaluation is not None, "run.eval_every builds the evaluation in setup()"
        self.evaluation.reward_fn = self.reward_fn  # the reward may be replaced after setup (tests, plugins)
        self.evaluation.periodic(self.iteration, self.loggers)

    def final_eval(self) -> dict[str, Any]:
        assert self.evaluation is not None, "run.eval_at_end builds the evaluation in setup()"
        self.evaluation.reward_fn = self.reward_fn
        return self.evaluation.final()

    def eval_forwards(self) -> int:
        """Model forward-images the final evaluation will cost (`evaluation.RunEvaluation.forwards`)."""
        return self.evaluation.forwards() if self.evaluation is not None else 0

    def close(self) -> None:
        """Close metrics.jsonl, the loggers and the process group."""
        if self.metrics_f is not None:
            self.metrics_f.close()
        for logger in self.loggers:
            logger.close()
        self.dist.close()
