"""The harness around the training loop: small stateful objects, each with `state_dict` / `load_state_dict`.

The loop (`trainer/loop.py`) is rollout → reward → credit → objective loss → optimizer step → log → checkpoint; what
decides *when* to stop, *which* weights are evaluated and *whether* the reward is being hacked lives here:

    PhaseTimer    wall seconds per phase of one iteration (and the test-only fault-injection points)
    RunLoop       whether the loop goes on: run.iterations, run.max_minutes, the time budget, SIGTERM/SIGINT; the bar
    TimeBudget    run.budget_minutes: stop before one more iteration + the final evaluation would not fit
    EMAWeights    optim.ema_decay: the EMA of the trainable weights, swapped in for every evaluation
    SoftOldPolicy nft's old_policy=soft: DiffusionNFT's soft-updated π_old, swapped in for the rollout and for v_old
    HackingGuard  run.gold_reward: held-out gold reward + the train-up/gold-down alarm (rewards/guards.py)
    DistPadding   dist.fsdp: every rank runs as many micro-batch passes as the busiest one (zero-weight padding)

The trainer saves `{name: obj.state_dict()}` of the stateful ones (TimeBudget, HackingGuard; the EMA weights travel
as tensors) in every checkpoint, so a resumed run continues with the same measured rates, EMA and gold/alarm history.
PhaseTimer, RunLoop and DistPadding hold nothing that outlives an iteration or a job, so they have no state_dict.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .faults import StopSignal, inject_point


@dataclass
class PhaseTimer:
    """Wall-clock seconds per phase of one iteration: `with timer("rollout"): ...`."""

    seconds: dict[str, float] = field(default_factory=dict)
    iteration: int = 0  # the iteration in progress (1-based), for the test-only fault-injection points

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        inject_point(name, self.iteration)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


class TimeBudget:
    """run.budget_minutes: True from `over()` when one more iteration plus the final evaluation would not fit.

    The iteration time is the median of the measured ones; the evaluation time is its forward count over the median
    forward-images/s of the rollouts (the evaluation samples with the same model at the same batch size), plus 10% and
    10 s for rewards and writing. Measured (2-core AVX2 CPU, fp32, shared): the two evaluations took 140-178 s where
    the rollout rate alone predicted 148-169 s, so the 10% is needed. Before the first iteration nothing is predicted
    (the first one always runs).
    """

    def __init__(self, minutes: float, t_created: float, eval_forwards: Callable[[], int]):
        """minutes: the budget (0 = none); t_created: when the job started (setup counts); eval_forwards: the model
        forward-images the final evaluation will cost (called once, lazily)."""
        self.budget_s = 60.0 * minutes
        self.t_created = t_created
        self._eval_forwards_fn = eval_forwards
        self._eval_forwards: int | None = None
        self.iter_seconds: list[float] = []  # wall seconds per iteration (logging, grids and checkpoints included)
        self.fwd_rates: list[float] = []  # model forward-images per second measured in the rollout phase

    def record(self, iter_seconds: float, nfe_rollout: float, rollout_seconds: float) -> None:
        self.iter_seconds.append(iter_seconds)
        if rollout_seconds > 0:
            self.fwd_rates.append(nfe_rollout / rollout_seconds)

    def predicted_eval_seconds(self) -> float:
        if self._eval_forwards is None:
            self._eval_forwards = self._eval_forwards_fn()
        return 1.1 * self._eval_forwards / statistics.median(self.fwd_rates) + 10.0

    def over(self) -> bool:
        if self.budget_s <= 0 or not self.iter_seconds or not self.fwd_rates:
            return False
        elapsed = time.time() - self.t_created
        return elapsed + statistics.median(self.iter_seconds) + self.predicted_eval_seconds() > self.budget_s

    def iterations_left(self, now: float | None = None) -> int | None:
        """How many more iterations `over()` will let start: n with elapsed + n·(median iteration) + predicted
        evaluation ≤ budget (the same arithmetic, so the count is what the loop will do if the rates hold); None
        without a budget or before the first measurement."""
        if self.budget_s <= 0 or not self.iter_seconds or not self.fwd_rates:
            return None
        elapsed = (time.time() if now is None else now) - self.t_created
        room = self.budget_s - self.predicted_eval_seconds() - elapsed
        return max(0, math.floor(room / max(statistics.median(self.iter_seconds), 1e-9)))

    def progress(self) -> float:
        """Fraction in [0, 1] of the training time used: elapsed / (budget − predicted evaluation); 0 without a
        budget or before the first measurement. The learning-rate schedule reads it (`LRSchedule`)."""
        if self.budget_s <= 0 or not self.iter_seconds or not self.fwd_rates:
            return 0.0
        train_s = max(self.budget_s - self.predicted_eval_seconds(), 1e-6)
        return min(1.0, max(0.0, (time.time() - self.t_created) / train_s))

    def state_dict(self) -> dict[str, Any]:
        return {"iter_seconds": list(self.iter_seconds), "fwd_rates": list(self.fwd_rates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # the measured rates carry over; the clock is the resumed job's own (budget_minutes counts from its start)
        self.iter_seconds = [float(x) for x in state.get("iter_seconds", [])]
        self.fwd_rates = [float(x) for x in state.get("fwd_rates", [])]


class LRSchedule:
    """optim.lr_schedule: lr(p) over the run's progress p = max(iteration / N, budget progress), N = `iterations`
    (min(run.iterations, optim.lr_decay_iterations if > 0)); p is capped at 1, so past N the rate stays final.

        constant: lr;  cosine: lr·[f + (1 − f)·(1 + cos πp)/2];  linear: lr·[1 − (1 − f)·p]     f = optim.lr_final
        warm-up:  × min(1, (iteration + 1) / warmup_iters)

    Reading the budget's progress as well as the iteration count makes a time-limited job decay its step size within
    the time it has, whatever the CPU: on a slow machine the budget ends the run long before run.iterations.
    Stateless (the iteration and the budget's measurements are in the checkpoint already).
    """

    def __init__(self, lr: float, schedule: str, final: float, warmup: int, iterations: int):
        self.lr, self.schedule, self.final, self.warmup, self.iterations = lr, schedule, final, warmup, iterations

    def apply(self, opt: Any, iteration: int, budget_progress: Callable[[], float]) -> float | None:
        """Set the optimizer's lr for this iteration's update and return it; None (nothing touched) for a constant
        schedule without warm-up, so such runs are bit-identical to a run without a schedule."""
        if self.schedule == "constant" and self.warmup <= 0:
            return None
        lr = self(iteration, budget_progress())
        for group in opt.param_groups:
            group["lr"] = lr
        return lr

    def __call__(self, iteration: int, budget_progress: float = 0.0) -> float:
        """The learning rate of the update of iteration `iteration` (0-based count of finished iterations)."""
        p = max(iteration / max(self.iterations, 1), budget_progress)
        p = min(max(p, 0.0), 1.0)
        f = self.final
        if self.schedule == "cosine":
            scale = f + (1.0 - f) * 0.5 * (1.0 + math.cos(math.pi * p))
        elif self.schedule == "linear":
            scale = 1.0 - (1.0 - f) * p
        else:
            scale = 1.0
        if self.warmup > 0:
            scale *= min(1.0, (iteration + 1) / self.warmup)
        return self.lr * scale


class EMAWeights:
    """optim.ema_decay: e ← decay·e + (1 − decay)·θ after every optimizer step; evaluations use the EMA weights.

    `shadow` is a list of tensors in the order of the trainable parameters (under FSDP sharded like them).
    """

    def __init__(self, params: Sequence[torch.Tensor], decay: float):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in params] if decay > 0 else None

    @property
    def enabled(self) -> bool:
        return self.shadow is not None

    @torch.no_grad()
    def update(self, params: Sequence[torch.Tensor]) -> None:
        if self.shadow is None:
            return
        for e, p in zip(self.shadow, params):
            e.lerp_(p.detach(), 1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """Within the block the parameters hold the EMA weights (no-op when off); restored afterwards."""
        if self.shadow is None:
            yield
            return
        with weights_swapped_in(params, self.shadow):
            yield


@contextlib.contextmanager
def weights_swapped_in(params: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Within the block the parameters hold `tensors` (same order and placement); restored bit-exactly afterwards."""
    backup = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, tensors):
            p.copy_(e)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)


def soft_update_decay(step: int, rate: float, cap: float, flat: int = 0) -> float:
    """DiffusionNFT's decay of the old adapter after `step` optimizer steps: 0 before `flat` steps, then
    min(rate·(step − flat), cap) (NVlabs/DiffusionNFT `scripts/train_nft_sd3.py` @ 24af555, `return_decay`:
    decay_type 1 (GenEval, PickScore) is rate 0.001, cap 0.5, flat 0; decay_type 2 (OCR) 0.0075, 0.999, 75)."""
    if step < flat:
        return 0.0
    return min((step - flat) * rate, cap)


class SoftOldPolicy:
    """nft's objective.options.old_policy = soft: DiffusionNFT's π_old, a soft-updated copy of the trainable weights
    that samples the rollouts and gives v_old of the implicit policies v± (docs/ALGORITHMS.md §9.2):

        θ_old ← d·θ_old + (1 − d)·θ      once per iteration, after its update, d = soft_update_decay(k, ...)

    k being the optimizer steps taken so far (`steps`; DiffusionNFT's `global_step`: the update runs at the end of
    each epoch with the step count of that moment, `scripts/train_nft_sd3.py` @ 24af555). θ_old starts at the initial
    weights. `shadow` is a list of tensors in the order of the trainable parameters (under FSDP sharded like them, as
    EMAWeights), swapped into the live model where π_old acts (`swapped_in`: the rollout, the v_old pass of the
    update), so only the trainable weights are kept twice (a LoRA run keeps a second adapter, as DiffusionNFT does).
    The trainer saves `shadow` in checkpoints (`old_policy`) and `state_dict` (the step count) in the harness state.
    """

    def __init__(self, params: Sequence[torch.Tensor], rate: float, cap: float, flat: int = 0):
        self.rate, self.cap, self.flat = rate, cap, flat
        self.shadow = [p.detach().clone() for p in params]
        self.steps = 0  # optimizer steps taken so far
        self.last_decay = 0.0  # the d of the last update (logged as old_policy_decay)

    def swapped_in(self, params: Sequence[torch.Tensor]):
        """Context: the parameters hold θ_old within the block, θ afterwards."""
        return weights_swapped_in(params, self.shadow)

    @torch.no_grad()
    def update(self, params: Sequence[torch.Tensor]) -> float:
        """θ_old ← d·θ_old + (1 − d)·θ with d = soft_update_decay(steps); params: the trainable weights. Returns d."""
        d = soft_update_decay(self.steps, self.rate, self.cap, self.flat)
        for e, p in zip(self.shadow, params):
            e.copy_(e * d + p.detach() * (1.0 - d))
        self.last_decay = d
        return d

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))


class MovingReference:
    """optim.kl_reference = ema: the KL reference π_ref follows the policy as a slow EMA of its trainable weights,

        ref ← d·ref + (1 − d)·θ      after every optimizer step, d = optim.kl_reference_decay (docs/ALGORITHMS.md §9.4)

    or, with optim.kl_reference_decay_rate r > 0, d_k = min(r·k, optim.kl_reference_decay) at the k-th optimizer step
    (AWM's `kl_ema_decay_type=linear`, min(0.001·k, 0.3) in its released recipe, §9.3; `steps` counts k and is saved
    in the harness state).

    `ref_net` is the reference copy's network (`ref_model.net`, a deep copy of the policy's, under FSDP sharded like
    it); `names` are the trainable parameter names, in the order of the trainable parameters. The frozen weights
    (a LoRA model's base) stay those of the initial model. The parameters are looked up by name on every call, so a
    reference that `ReferenceOffload` moves between devices is still found; the policy's weights are copied to the
    reference's device for the update.
    """

    def __init__(self, ref_net: torch.nn.Module, names: Sequence[str], decay: float, rate: float = 0.0):
        self.net, self.names, self.decay, self.rate = ref_net, list(names), decay, rate
        self.steps = 0  # optimizer steps taken so far (the ramp's k)
        missing = set(self.names) - {n for n, _ in ref_net.named_parameters()}
        if missing:  # a programming error: the copy was made from another network
            raise RuntimeError(f"the KL reference copy lacks trainable parameters {sorted(missing)[:3]}")

    def tensors(self) -> list[torch.Tensor]:
        """The reference's trainable weights, in the order of `names` (the live parameters, not copies)."""
        named = dict(self.net.named_parameters())
        return [named[n] for n in self.names]

    @torch.no_grad()
    def update(self, params: Sequence[torch.Tensor]) -> None:
        """params: the policy's trainable weights after the optimizer step, in the order of `names`."""
        self.steps += 1
        decay = self.decay if self.rate <= 0 else min(self.rate * self.steps, self.decay)
        for r, p in zip(self.tensors(), params):
            r.lerp_(p.detach().to(r.device), 1 - decay)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))

    @torch.no_grad()
    def load(self, tensors: Sequence[torch.Tensor]) -> None:
        """Restore the reference from a checkpoint: tensors placed like the reference's weights (`shard_like`)."""
        for r, t in zip(self.tensors(), tensors):
            r.copy_(t)


class HackingGuard:
    """run.gold_reward: the held-out gold reward every gold_every iterations and the hacking alarm (issue G.6).

    `step` feeds the alarm with the training reward and diversity every iteration; when the gold reward is due it
    calls `sample_fn(prompts, metadata) -> images` (the trainer samples with the EMA weights) and returns the
    gold.jsonl line (with the alarm state), else None. Each gold point carries its standard error std / sqrt(prompts)
    (`gold_se`); the alarm gets the point's per-image scores too, and gold must fall by more than
    max(run.alarm_gold_drop, z paired standard errors of its fitted change) (`gold_threshold`), z being the
    alpha-spending z of the look (run.alarm_alpha, `rewards.guards.spending_z`) or, with alarm_alpha 0, the fixed
    run.alarm_noise_z.
    """

    def __init__(self, gold: Any, alarm: Any):
        self.gold, self.alarm = gold, alarm

    @classmethod
    def from_config(cls, run_cfg: Any, build_reward: Callable[[str], Any]) -> HackingGuard | None:
        if not run_cfg.gold_reward:
            return None
        from ..rewards.guards import GoldMonitor

        gold = GoldMonitor.from_prompts(
            build_reward(run_cfg.gold_reward), run_cfg.gold_prompts, every=run_cfg.gold_every, limit=run_cfg.gold_limit
        )
        return cls(gold, cls.alarm_from_config(run_cfg))

    @staticmethod
    def alarm_from_config(run_cfg: Any) -> Any:
        """The `HackingAlarm` of the run.alarm_* settings (also used to replay a finished run's alarm)."""
        from ..rewards.guards import HackingAlarm

        return HackingAlarm(
            window=run_cfg.alarm_window,
            gold_drop=run_cfg.alarm_gold_drop,
            noise_z=run_cfg.alarm_noise_z,
            alpha=run_cfg.alarm_alpha or None,
        )

    def step(self, iteration: int, stats: dict[str, Any], sample_fn: Callable) -> dict[str, Any] | None:
        self.alarm.update_train(iteration, stats["reward_mean"])
        self.alarm.update_diversity(iteration, stats["diversity"])
        if not self.gold.due(iteration):
            return None
        rec = self.gold.run(iteration, sample_fn)
        self.alarm.update_gold(iteration, rec.mean, se=rec.se, scores=rec.scores)
        state = self.alarm.check()
        return {
            "iteration": iteration,
            "gold": rec.mean,
            "gold_se": rec.se,  # of this point: std / sqrt(prompts)
            "gold_threshold": state.gold_threshold,  # the fitted gold change had to be below minus this to fire
            "gold_z": state.z,  # the z of this look (run.alarm_noise_z, or the alpha-spending z of look `look`)
            "look": state.look,
            "warning": state.warning,  # the per-look test at run.alarm_noise_z (not error-controlled over the run)
            "train_reward": stats["reward_mean"],
            "diversity": stats["diversity"],
            "alarm": state.fired,
            "message": state.message,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"gold": self.gold.state_dict(), "alarm": self.alarm.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gold.load_state_dict(state.get("gold", {}))
        self.alarm.load_state_dict(state.get("alarm", {}))


class RunLoop:
    """Whether the training loop goes on, and its progress bar (rank 0).

    The loop stops before an iteration when run.iterations are done, run.max_minutes have passed or the time budget
    says the next iteration and the final evaluation would not fit (`TimeBudget.over`), and after an iteration when
    SIGTERM/SIGINT asked (`faults.StopSignal`: finish the iteration, checkpoint, exit 0). Every rank decides the same
    (`Dist.any`), so all stop at the same iteration. Use as a context manager around the loop.
    """

    def __init__(self, cfg: Any, dist: Any, budget: TimeBudget, iteration: int):
        self.cfg, self.dist, self.budget = cfg, dist, budget
        self.t_start = time.time()
        self.signals = StopSignal(cfg.faults.handle_signals)
        self.stopped: str | None = None  # the signal that stopped the run
        self.stopped_by_budget = False
        self.bar = None
        try:
            from tqdm import tqdm

            desc = f"train[{cfg.credit.name}/{cfg.objective.name}]"
            self.bar = tqdm(total=cfg.run.iterations, initial=iteration, desc=desc, dynamic_ncols=True,
                            disable=not dist.is_main)
        except ImportError:
            pass

    def __enter__(self) -> RunLoop:
        self.signals.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        return self.signals.__exit__(*exc)

    def running(self, iteration: int) -> bool:
        """True when iteration `iteration + 1` may start."""
        run = self.cfg.run
        if iteration >= run.iterations:
            return False
        if self.dist.any(bool(run.max_minutes) and (time.time() - self.t_start) > 60 * run.max_minutes):
            return False
        if self.dist.any(self.budget.over()):
            self.stopped_by_budget = True
            return False
        return True

    def expected_total(self, done: int, now: float | None = None) -> tuple[int, str]:
        """(the iteration the run is expected to end at, the limit that ends it: "iterations", "budget" or
        "max_minutes"), from the measured iteration times: the bar's total, so its ETA is that of the first limit."""
        run = self.cfg.run
        now = time.time() if now is None else now
        ends = [(run.iterations, "iterations")]
        left = self.budget.iterations_left(now)
        if left is not None:
            ends.append((done + left, "budget"))
        if run.max_minutes and self.budget.iter_seconds:  # `running` lets an iteration start until max_minutes
            room = 60 * run.max_minutes - (now - self.t_start)
            ends.append((done + max(0, math.ceil(room / max(statistics.median(self.budget.iter_seconds), 1e-9))),
                         "max_minutes"))
        total, limit = min(ends, key=lambda e: e[0])
        return max(total, done), limit

    def end_iteration(self, stats: dict[str, Any], iter_seconds: float) -> bool:
        """Record one finished iteration (bar, budget measurements); False when a signal asks to stop now."""
        self.budget.record(iter_seconds, stats["nfe_rollout"], stats["seconds"].get("rollout", 0.0))
        if self.bar is not None:
            self.bar.update(1)
            total, limit = self.expected_total(int(self.bar.n))
            if total != self.bar.total:
                self.bar.total = total  # the ETA tqdm shows is then the first limit's
            post = {"reward": f"{stats['reward_mean']:.3f}", "strict": f"{stats.get('strict_mean', float('nan')):.2f}"}
            if limit != "iterations":
                post["ends"] = limit
            self.bar.set_postfix(post)
        if self.dist.any(self.signals.requested is not None):  # every rank stops at the same iteration
            self.stopped = self.signals.requested or "signal"
            return False
        return True

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def result(self, iteration: int) -> dict[str, Any]:
        out: dict[str, Any] = {"iterations": iteration, "train_seconds": time.time() - self.t_start}
        if self.stopped_by_budget:
            out["stopped_by_budget"] = True
        if self.stopped:
            out["stopped"] = self.stopped
        return out


Pair = tuple[int, int]  # (row b, rollout step j)


class DistPadding:
    """Micro-batches of one optimizer step, padded for FSDP (dist.fsdp).

    Under FSDP every forward/backward of the sharded network is a collective, so every rank must run as many
    micro-batch passes as the busiest rank (`Dist.micro_batches`: the max over ranks). A rank that is out of pairs
    runs a zero-weight pass on a placeholder pair (row 0, the first trained step): it joins the others' collectives
    and adds exactly 0 to the gradient. Without FSDP nothing is padded. No state: nothing outlives the update.
    """

    def __init__(self, dist: Any, micro_batch: int):
        self.dist, self.micro_batch = dist, micro_batch

    def chunks(self, pairs: list[Pair], step_mask: torch.Tensor) -> Iterator[tuple[list[Pair], bool]]:
        """(micro-batch of pairs, is_padding) for this rank's `pairs`; a padding pass's loss must be scaled by 0."""
        mb = self.micro_batch
        for s in range(0, self.dist.micro_batches(len(pairs), mb) * mb, mb):
            chunk = pairs[s : s + mb]
            if chunk:
                yield chunk, False
            else:
                yield [(0, int(step_mask.nonzero()[0]))], True

    @staticmethod
    def backward_padding(loss: torch.Tensor) -> None:
        """The zero-weight backward of a padding pass (joins the collectives, contributes nothing)."""
        (loss * 0.0).backward()
