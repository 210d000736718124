"""The `run`, `dist` and `faults` sections of the training config: the run folder, budget, logging, checkpoints,
evaluation and hacking guard; many processes; what a run survives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .fields import _h

if TYPE_CHECKING:
    from .schema import ModelCfg, OptimCfg


@dataclass
class RunCfg:
    out_dir: str | None = _h(None, "Run folder; null = runs/<preset>-<timestamp>.")
    seed: int = _h(0, "Global seed: prompt order, noise, update order, and the torch / numpy / random global RNGs, "
        "seeded before anything is built (LoRA init included; every rank alike).", ge=0)
    iterations: int = _h(100, "Training iterations (rollout → reward → credit → update).", ge=0)
    max_minutes: float = _h(0.0, "Stop training after this many minutes (0 = no limit); evaluation still runs.", ge=0)
    budget_minutes: float = _h(0.0, "Wall-clock budget of the whole job, final evaluation included (0 = none): "
        "training stops before the next iteration would leave less time than the final evaluation is predicted to "
        "take (from the rollout's measured forward rate).", ge=0)
    threads: int = _h(0, "torch threads (0 = leave torch's default).", ge=0)
    keep_freed_memory: bool = _h(True, "Linux/glibc: reuse freed host memory instead of unmapping it after every step "
        "(trainer/memory.py: no page faults per temporary, ≈ 6–7% per iteration).")
    device: str = _h("cpu", "Device for the tiny model (real models: accelerate decides).")
    plugins: list[str] = _h(list, "Python modules imported before the rest of the config is checked, e.g. "
        "[my_plugins]: each may register credit methods, objectives, samplers, model families or rewards (the folder "
        "you run from is importable, as with `python -m`).")
    log_every: int = _h(1, "Write metrics every N iterations.", ge=1)
    loggers: list[str] | None = _h(None, "Where metrics go besides metrics.jsonl: tensorboard, wandb (optional extra; "
        "WANDB_MODE=offline works without network); null = [tensorboard].")
    grid_every: int = _h(25, "Save a sample grid every N iterations (0 = never).", ge=0)
    checkpoint_every: int = _h(50, "Checkpoint every N iterations and at the end (0 = only at the end).", ge=0)
    eval_at_end: bool = _h(True, "Evaluate on eval_prompts at the end (same code path as `flowcredit eval`) → "
        "eval.json.")
    eval_baseline: bool = _h(True, "Also evaluate the initial model with the same noise, so eval.json holds the "
        "improvement.")
    eval_baseline_cache: str | None = _h(None, "Folder caching the initial model's final evaluation under a hash of "
        "its weights, the prompts, noise seed, sampler and reward, so runs that share them evaluate the initial model "
        "once (`flowcredit compare` sets it per study); null = off.")
    eval_prompts: str = _h("shapes:test", "Held-out prompts for the final evaluation.")
    eval_steps: int = _h(40, "ODE steps of the evaluation sampler.", ge=1)
    eval_guidance: float = _h(1.0, "CFG scale of the evaluation.", ge=0)
    eval_every: int = _h(0, "Also evaluate every N iterations on eval_subset prompts (0 = never).", ge=0)
    eval_subset: int = _h(96, "Prompts of the periodic evaluation (a fixed, tag-balanced subset of eval_prompts; at "
        "least their number = all of them in file order, with the final evaluation's noise).", ge=1)
    gold_reward: str | None = _h(None, "Hacking guard: a held-out 'gold' reward the policy is NOT trained on, scored "
        "on gold_prompts every gold_every iterations; null = off.")
    gold_prompts: str = _h("shapes:test_unique", "Fixed prompts of the gold reward.")
    gold_every: int = _h(10, "Gold-reward interval in iterations (0 = never due).", ge=0)
    gold_limit: int = _h(32, "Number of gold prompts used.", ge=1)
    alarm_window: int = _h(5, "Hacking alarm: fires when over the last N gold evaluations the training reward rose "
        "while gold (or diversity) fell.", ge=2)
    alarm_gold_drop: float = _h(0.0, "Hacking alarm: gold must fall by more than this (absolute, in gold-reward "
        "units, fitted change over the window) for the alarm to fire; the noise threshold below applies too (the "
        "larger wins).", ge=0)
    alarm_noise_z: float = _h(2.0, "Hacking alarm: gold must fall by more than z standard errors of its fitted change "
        "(the paired one: each gold image's own fitted change, the prompts and noise being fixed) at every look, when "
        "alarm_alpha is 0; 0 = any fall fires.", ge=0)
    alarm_alpha: float = _h(0.05, "Hacking alarm: the run's false-alarm budget, spent over its looks as "
        "alpha/(k(k+1)) at the k-th gold check (z_k = Phi^-1(1 - alpha/(k(k+1))): 1.96 at the first, 3.32 at the "
        "tenth), so a run whose gold does not fall fires with probability <= alpha however long it runs; 0 = the "
        "fixed alarm_noise_z at every look (about 2% of looks of a healthy run fire: 13-15% of healthy 60-minute "
        "runs, simulated; still reported as 'warning').", ge=0, lt=1)


@dataclass
class DistCfg:
    enabled: bool | None = _h(None, "Multi-process training through accelerate; null = on when launched with "
        "WORLD_SIZE > 1 (torchrun / accelerate launch).")
    split_groups: bool = _h(False, "Allow a prompt group to span two processes when data.prompts_per_iter is not a "
        "multiple of the process count (statistics are global either way).")
    fsdp: bool = _h(False, "Full fine-tunes on N > 1 processes: shard the trainable network's weights, gradients, "
        "AdamW moments and EMA over the processes with PyTorch FSDP2 (per transformer block, then the whole network); "
        "same arithmetic as without. One process: ignored with a warning. Not with LoRA (docs/SCALING.md).")

    def check(self, model: ModelCfg, optim: OptimCfg) -> None:
        """Cross-section checks of ``fsdp`` (called by TrainConfig)."""
        if not self.fsdp:
            return
        if model.trainable == "lora":
            raise ValueError(
                "dist.fsdp=true does not support model.trainable=lora; LoRA adapters are small, so use plain data "
                "parallel (dist.fsdp=false), or model.trainable=all for a sharded full fine-tune"
            )
        if optim.offload_optimizer:
            raise ValueError(
                "dist.fsdp=true already shards AdamW's moments over the processes; set optim.offload_optimizer=false"
            )


@dataclass
class FaultsCfg:
    max_nonfinite: int = _h(3, "Stop (error, exit non-zero, last checkpoint intact) after this many CONSECUTIVE "
        "updates skipped for NaN/Inf rewards, advantages, loss or grads; 0 = never.", ge=0)
    reward_retries: int = _h(2, "Retries of a reward call that raises or times out, before the run stops with an "
        "error.", ge=0)
    reward_backoff: float = _h(2.0, "Seconds before the first reward retry; doubled after each further failure.", ge=0)
    reward_timeout: float = _h(0.0, "Seconds one reward call may take before it counts as failed (0 = no "
        "limit).", ge=0)
    handle_signals: bool = _h(True, "On SIGTERM/SIGINT: finish the iteration, write a checkpoint and exit 0.")
