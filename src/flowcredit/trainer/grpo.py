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
the gathered batch (`distributed.py`); checkpoints are atomic and verified (`flowcredit/checkpoints.py`); NaN/Inf
updates are skipped, failing rewards retried, SIGTERM checkpoints and exits (`faults.py`). Only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import checkpoints as checkpoint
from ..config.load import dump_yaml
from ..config.schema import TrainConfig
from ..credit.base import CreditInput
from ..credit.registry import assign_credit, needs_instant_rewards, needs_step_rewards
from ..objectives import LossContext, build_objective
from ..rewards.guards import group_diversity
from ..samplers.policy import nfe_per_sample
from ..samplers.rollout import rollout
from ..samplers.schedules import time_grid
from ..samplers.sde import SamplerParams
from ..types import Trajectory, cond_repeat
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
from .evaluation import RunEvaluation
from .faults import NonFiniteGuard, RetryingCall, StopSignal, first_nonfinite, inject_point
from .harness import EMAWeights, HackingGuard, PhaseTimer, TimeBudget
from .intermediate import intermediate_rewards
from .loggers import build_loggers, check_logger_names, save_grid, write_metrics
from .preflight import check_memory
from .state import CheckpointMixin, TrainingError


@contextlib.contextmanager
def _one_line(prefix: str = ""):
    """Bad input found while building the run (a ValueError) becomes one TrainingError line, prefixed with the key."""
    try:
        yield
    except ValueError as e:
        raise TrainingError(f"{prefix}{e}") from None


def sampler_params(cfg: TrainConfig) -> SamplerParams:
    s = cfg.sampler
    return SamplerParams(
        name=s.name, noise_level=s.noise_level, reduce=s.reduce, ddim_sigma=s.ddim_sigma, ddim_coef=s.ddim_coef
    )


class GRPOTrainer(CheckpointMixin):
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
        from ..shapes.prompts import load_prompts
        from .data import PromptSampler

        # --- validate inputs first: nothing is written to the run folder on bad input -----------------------
        with _one_line("data.train_prompts: "):
            self.train_prompts = load_prompts(cfg.data.train_prompts)
        with _one_line():
            d = cfg.data
            self.prompt_sampler = PromptSampler(self.train_prompts, cfg.run.seed, d.balance_tags, d.tag_weights)
            self.reward_fn = self._build_reward(build_reward)
            self.objective = build_objective(cfg.objective.name, cfg.objective.options, cfg)
        check = getattr(self.reward_fn, "check_prompts", None)  # a reward may require prompt metadata (shapes)
        if callable(check):
            with _one_line("data.train_prompts: "):
                check(self.train_prompts.metadata, self.train_prompts.source)
        if cfg.run.eval_at_end or cfg.run.eval_every:
            with _one_line("run.eval_prompts: "):
                self.eval_prompts = load_prompts(cfg.run.eval_prompts)

        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.dist = Dist.create(cfg.dist.enabled, cfg.run.device)  # accelerate when launched on N processes
        with _one_line():
            dist = self.dist
            self.shard = Shard.create(d.prompts_per_iter, d.group_size, dist.rank, dist.world_size,
                                      cfg.dist.split_groups)
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
        with _one_line():  # a batch too large for memory fails here, before anything is written (trainer/preflight.py)
            has_ref = self.ref_model is not None
            check_memory(cfg, self.model, self.device, self.dist.world_size, reference_loaded=has_ref)
            check_logger_names(cfg.run.loggers)
        if cfg.dist.fsdp:  # shard the network (and the reference copy unless it is offloaded) over the processes
            with _one_line():
                sharded = apply_fsdp(self.dist, self.model, None if self.ref_offload.enabled else self.ref_model,
                                     groups_per_rank_even=cfg.data.prompts_per_iter % self.dist.world_size == 0)
            self.trainable = sharded if sharded is not None else self.trainable
        self.initial_state = None
        if cfg.run.eval_baseline and cfg.run.eval_at_end:
            self.initial_state = {k: v.detach().clone() for k, v in self.model.net.state_dict().items()}
        oc = cfg.optim
        self.opt = build_optimizer(self.trainable, oc.offload_optimizer, lr=oc.lr, betas=tuple(oc.betas),
                                   weight_decay=oc.weight_decay, eps=oc.eps)
        # the harness (trainer/harness.py): EMA of the weights, hacking guard, time budget; all saved in checkpoints
        self.ema_weights = EMAWeights(self.trainable, cfg.optim.ema_decay)
        self.guard_ = HackingGuard.from_config(cfg.run, build_reward)
        self.budget = TimeBudget(cfg.run.budget_minutes, self.t_created, self.eval_forwards)
        self.gen = torch.Generator(device="cpu").manual_seed(cfg.run.seed)
        self.timesteps = time_grid(cfg.sampler.num_steps, cfg.sampler.shift, cfg.sampler.grid)
        self.params = sampler_params(cfg)
        self.credit_state: dict[str, torch.Tensor] = {}
        self.iteration = 0
        self.nonfinite = NonFiniteGuard(cfg.faults.max_nonfinite, self.dist.is_main)
        fc = cfg.faults
        self.call_reward = RetryingCall(fc.reward_retries, fc.reward_backoff, fc.reward_timeout)
        self.uncond1 = self.model.encode_prompts([""]) if cfg.sampler.guidance_scale != 1.0 else None

        # --- the run folder ---------------------------------------------------------------------------------
        out = cfg.run.out_dir or f"runs/{self.preset_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.out = Path(self.dist.broadcast_object(out))  # rank 0 writes; every rank reads the checkpoint
        self.evaluation = None
        if cfg.run.eval_at_end or cfg.run.eval_every:
            self.evaluation = RunEvaluation(
                cfg,
                self.model,
                self.reward_fn,
                self.eval_prompts,
                self.initial_state,
                self.dist,
                self.out,
                self.ema_weights,
                self.trainable,
            )
        # before anything is written: a run folder without an intact checkpoint stays as it is
        ckpt = self.latest_checkpoint()
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "checkpoints").mkdir(exist_ok=True)
            (self.out / "grids").mkdir(exist_ok=True)
            # the resolved config; a resumed run keeps its original config.yaml and records the new one beside it
            dump_yaml(
                cfg, self.out / ("config.yaml" if not (self.out / "config.yaml").exists() else "config.resumed.yaml")
            )
        self.dist.barrier()
        if ckpt is not None:
            self.load_checkpoint(ckpt)
            if self.dist.is_main:
                print(f"resuming from {ckpt} (iteration {self.iteration})", file=sys.stderr, flush=True)
        self.metrics_f, self.loggers = None, []  # rank 0 only: metrics.jsonl + run.loggers (trainer/loggers.py)
        if self.dist.is_main:
            # a resumed run redoes later iterations
            for log_file in ("metrics.jsonl", "eval_curve.jsonl", "gold.jsonl"):
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

            bar = tqdm(
                total=cfg.run.iterations,
                initial=self.iteration,
                desc=f"train[{cfg.method}/{cfg.objective.name}]",
                dynamic_ncols=True,
                disable=not self.dist.is_main,
            )
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
                ckpt_every = cfg.run.checkpoint_every
                if (ckpt_every and self.iteration % ckpt_every == 0) or self.iteration == cfg.run.iterations:
                    self.save_checkpoint()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(
                        reward=f"{stats['reward_mean']:.3f}", strict=f"{stats.get('strict_mean', float('nan')):.2f}"
                    )
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

    def eval_forwards(self) -> int:
        """Model forward-images the final evaluation will cost (`evaluation.RunEvaluation.forwards`)."""
        return self.evaluation.forwards() if self.evaluation is not None else 0

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
            T = len(self.timesteps) - 1
            it = self.iteration + 1
            init, noise = layout_noise(cfg.run.seed, it, self.shard, model.latent_shape, T, cfg.shared_noise)
            traj = rollout(
                model, prompts, meta, gids, timesteps=self.timesteps, sampler=self.params, guidance_scale=guidance,
                generator=None, init_noise=init, step_noise=noise, cond=cond, uncond=uncond,
                keep_velocities=needs_step_rewards(cfg.credit) or needs_instant_rewards(cfg.credit),
                train_fraction=cfg.sampler.timestep_fraction, ode_untrained=cfg.sampler.ode_untrained,
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
        rewards = self._gathered(traj.rewards)  # (B_global,)
        stats["reward_calls"] = B
        stats["reward_mean"] = float(rewards.mean())
        stats["reward_std"] = float(rewards.std(unbiased=False))
        # hacking guard: within-group diversity (mean pairwise RMS pixel distance); collapse = mode collapse
        stats["diversity"] = float(group_diversity(images, gids).mean())
        for k, v in ro.components.items():
            stats[f"{k}_mean"] = float(self._gathered(v.float()).mean())

        # ---------------------------------------------------------------- INTERMEDIATE REWARDS (Stepwise / VGPO)
        step_rewards, instant, istats = intermediate_rewards(
            model, self._score, traj, cond, uncond, cfg, prompts, meta, gids, timer
        )
        stats["reward_calls"] += istats.pop("reward_calls")
        stats.update(istats)

        # ---------------------------------------------------------------- CREDIT (on the gathered global batch)
        with timer("credit"):
            step_rewards, instant = self.dist.gather(step_rewards), self.dist.gather(instant)
            bad = first_nonfinite(rewards=rewards, step_rewards=step_rewards, instant_rewards=instant)
            if bad is None:
                cin = CreditInput(
                    rewards=rewards,
                    group_ids=self._gathered(gids),
                    step_mask=traj.step_mask,
                    step_rewards=step_rewards,
                    instant_rewards=instant,
                    state=self.credit_state,
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
                ustats = {
                    "pairs_trained": 0,
                    "skipped_update": 1,
                    "_nfe": 0,
                    **self.nonfinite.skip(bad, self.iteration + 1),
                }
        stats.update(ustats)
        stats["nfe_update"] = ustats.pop("_nfe")
        counts = [k for k in ("nfe_rollout", "reward_calls", "nfe_estimates", "nfe_update") if k in stats]
        stats.update(zip(counts, (int(v) for v in self.dist.sum([stats[k] for k in counts]))))  # over all ranks
        stats["seconds"] = timer.seconds
        stats["seconds_total"] = sum(timer.seconds.values())
        stats["_images"] = images
        stats["_prompts"] = prompts
        return stats

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """`Dist.gather` of a tensor that is present on every rank: (B_local, ...) → (B_global, ...)."""
        out = self.dist.gather(t)
        assert out is not None
        return out

    def _score(self, images: torch.Tensor, prompts: list, meta: list) -> torch.Tensor:
        """(n,) rewards of decoded images, retried per `faults` (the intermediate rewards' reward call)."""
        return self.call_reward(self.reward_fn, images, prompts, meta).scores.float()

    def update(self, traj: Trajectory, adv: torch.Tensor, cond, uncond) -> dict[str, Any]:
        """Gradient steps on the objective's loss over (sample, step) pairs with gradient accumulation.

        The loss of one optimizer step is Σ_pairs objective.loss(pair) / N_pairs, accumulated over micro-batches of
        `optim.micro_batch` pairs, so micro-batch size never changes the gradient. The pairs and their order are
        planned on the global batch (`distributed.plan_update`; zero-advantage pairs are skipped when the objective
        says their gradient is exactly zero); each rank trains its rows with N_pairs the GLOBAL count and the gradients
        are summed over ranks. The objective (grpo / nft / awm, `flowcredit.objectives`) says what the loss of a pair
        is.
        """
        cfg, model, obj = self.cfg, self.model, self.objective
        oc = cfg.optim
        on_policy = oc.inner_epochs == 1 and oc.updates_per_epoch == 1
        n_pairs, epochs = plan_update(
            self._gathered(adv),
            traj.step_mask,
            self.shard,
            seed=cfg.run.seed,
            iteration=self.iteration + 1,
            inner_epochs=oc.inner_epochs,
            updates_per_epoch=oc.updates_per_epoch,
            steps_per_sample=cfg.sampler.train_steps_per_sample,
            skip_zero_adv=obj.skip_zero_advantage(on_policy, oc.kl_beta),
            step_groups=self._gathered(traj.group_ids).tolist() if getattr(obj, "shares_steps_in_group", 0) else None,
        )
        out: dict[str, Any] = {"pairs_trained": n_pairs, "_nfe": 0}
        if not n_pairs:
            out.update(loss=0.0, grad_norm=0.0, skipped_update=1, **dict.fromkeys(obj.sum_keys + obj.max_keys, 0.0))
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
                    # FSDP only: this rank is out of pairs; a zero-weight pass joins the others' collectives
                    pad = not mb
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
                # skip and count; stops after faults.max_nonfinite in a row
                if nonfinite_loss or not torch.isfinite(gn):
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
                return generate(
                    self.model,
                    prompts,
                    steps=rc.eval_steps,
                    guidance=rc.eval_guidance,
                    seed=rc.seed + 999,
                    shift=self.cfg.sampler.shift,
                )

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
        if self.metrics_f is not None:  # rank 0
            inject_point("log", self.iteration)
            write_metrics(self.metrics_f, self.loggers, self.iteration, stats)

    def save_grid(self, images: torch.Tensor, prompts: list[str]) -> None:
        if self.dist.is_main:
            save_grid(images, prompts, self.cfg.data.group_size, self.out / "grids", self.iteration)

    @property
    def ema(self) -> list[torch.Tensor] | None:
        """The EMA weights in the order of `self.trainable` (None when optim.ema_decay = 0)."""
        return self.ema_weights.shadow

    @ema.setter
    def ema(self, tensors: list[torch.Tensor] | None) -> None:
        self.ema_weights.shadow = tensors

    def periodic_eval(self) -> None:
        assert self.evaluation is not None, "run.eval_every builds the evaluation in setup()"
        self.evaluation.reward_fn = self.reward_fn  # the reward may be replaced after setup (tests, plugins)
        self.evaluation.periodic(self.iteration, self.loggers)

    def final_eval(self) -> dict[str, Any]:
        assert self.evaluation is not None, "run.eval_at_end builds the evaluation in setup()"
        self.evaluation.reward_fn = self.reward_fn
        return self.evaluation.final()
