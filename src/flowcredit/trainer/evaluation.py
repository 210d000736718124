"""The evaluations of a training run: periodic (eval_curve.jsonl) and final (eval.json with the improvement).

Both go through `flowcredit.eval.evaluate` (the code path of `flowcredit eval`), with the EMA weights swapped in, the
same fixed noise (run.seed + 12345), ODE steps, CFG scale and time-grid shift. The final evaluation also scores the
initial model with the same noise, so eval.json holds the improvement; its result is cached under a hash of
everything it depends on (`baseline_cache_file`), so runs sharing the initial model evaluate it once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from .faults import inject_point


class RunEvaluation:
    """Periodic and final evaluation of one run. `initial_state` is the initial weights (None: no baseline)."""

    def __init__(
        self,
        cfg,
        model,
        reward_fn,
        eval_prompts,
        initial_state: dict[str, torch.Tensor] | None,
        dist,
        out: Path,
        ema_weights,
        trainable,
    ):
        self.cfg, self.model, self.reward_fn, self.prompts = cfg, model, reward_fn, eval_prompts
        self.initial_state, self.dist, self.out = initial_state, dist, out
        self.ema_weights, self.trainable = ema_weights, trainable

    def kwargs(self) -> dict[str, Any]:
        """Settings of every evaluation of a run: the reward, ODE steps, CFG scale, the fixed noise seed
        (run.seed + 12345) and the time-grid shift."""
        rc = self.cfg.run
        return {
            "reward": self.reward_fn,
            "steps": rc.eval_steps,
            "guidance": rc.eval_guidance,
            "seed": rc.seed + 12345,
            "shift": self.cfg.sampler.shift,
        }

    def forwards(self) -> int:
        """Model forward-images the final evaluation costs: every eval prompt line × ODE steps × (2 with CFG), for
        the trained model and, unless cached, the initial one."""
        rc = self.cfg.run
        if not (rc.eval_at_end and self.dist.evaluates):
            return 0
        per_model = len(self.prompts) * rc.eval_steps * (2 if rc.eval_guidance != 1.0 else 1)
        models = 1
        if self.initial_state is not None:
            cache = self.baseline_cache_file(self.kwargs())
            models += 0 if cache is not None and cache.is_file() else 1
        return per_model * models

    def periodic(self, iteration: int, loggers) -> None:
        """Evaluate on the tag-balanced run.eval_subset prompts → eval_curve.jsonl and the loggers."""
        from ..eval.evaluate import evaluate, tag_balanced_subset

        if not self.dist.evaluates:  # rank 0; under FSDP every rank (the forwards are collectives), rank 0 writes
            return
        # a subset as large as the split is the split itself, in its own order: the same lines with the same noise as
        # the final evaluation, so a periodic point and eval.json of the same weights are the same number
        n = self.cfg.run.eval_subset
        sub = self.prompts if n >= len(self.prompts) else tag_balanced_subset(self.prompts, n)
        self.model.eval()
        t0 = time.time()
        with self.ema_weights.swapped_in(self.trainable):
            s = evaluate(self.model, sub, **self.kwargs())
        rec = {"iteration": iteration, "eval_reward": s["reward_mean"], "eval_strict": s.get("strict_overall"),
               "eval_seconds": time.time() - t0}
        if self.dist.is_main:
            with open(self.out / "eval_curve.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        inject_point("eval", iteration)
        scalars = {"eval/reward": s["reward_mean"]}
        if s.get("strict_overall") is not None:
            scalars["eval/strict_overall"] = s["strict_overall"]
        for logger in loggers:
            logger.log_scalars(iteration, scalars)

    def final(self) -> dict[str, Any]:
        """eval.json: the trained model (EMA weights if on) and, with run.eval_baseline, the initial model, on the
        same prompts with the same noise; "delta" = trained − initial."""
        from ..eval.evaluate import evaluate

        kw = self.kwargs()
        self.model.eval()
        t0 = time.time()
        main = self.dist.is_main  # under FSDP every rank evaluates (collective forwards); rank 0 writes
        with self.ema_weights.swapped_in(self.trainable):
            trained = evaluate(
                self.model, self.prompts, out_dir=self.out / "eval" if main else None, write_samples=False, **kw
            )
        result: dict[str, Any] = {"trained": trained, "eval_seconds": time.time() - t0}
        if self.initial_state is not None:
            base = self._baseline(kw, main, result)
            result["base"] = base
            result["delta"] = {
                "reward_mean": trained["reward_mean"] - base["reward_mean"],
                **(
                    {
                        "strict_overall": trained["strict_overall"] - base["strict_overall"],
                        "correct_overall": trained["correct_overall"] - base["correct_overall"],
                    }
                    if "strict_overall" in base
                    else {}
                ),
            }
        if main:
            (self.out / "eval.json").write_text(json.dumps(result, indent=2))
        return result

    def warm_baseline(self) -> Path | None:
        """Evaluate the initial model into run.eval_baseline_cache now, unless it is there already; returns the
        cache file (None: no cache, or no initial model). `flowcredit compare` calls it (`train --warm-baseline`)
        before time-budgeted runs, so no arm pays for the shared baseline inside its own budget."""
        kw = self.kwargs()
        cache = self.baseline_cache_file(kw)
        if cache is not None and not cache.is_file():
            self._baseline(kw, self.dist.is_main, {})
        return cache

    def _baseline(self, kw: dict[str, Any], main: bool, result: dict[str, Any]) -> dict[str, Any]:
        from ..eval.evaluate import evaluate

        cache = self.baseline_cache_file(kw)
        if cache is not None and cache.is_file():
            result["base_cached"] = str(cache)
            return json.loads(cache.read_text())
        current = {k: v.detach().clone() for k, v in self.model.net.state_dict().items()}
        self.model.net.load_state_dict(self.initial_state)
        base = evaluate(
            self.model, self.prompts, out_dir=self.out / "eval_base" if main else None, write_samples=False, **kw
        )
        self.model.net.load_state_dict(current)
        if cache is not None and main:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(base))
            os.replace(tmp, cache)  # atomic: runs in parallel never read a half-written file
        return base

    def baseline_cache_file(self, eval_kw: dict[str, Any]) -> Path | None:
        """`<run.eval_baseline_cache>/<sha256>.json` for the initial model's final evaluation, or None (cache off,
        or several processes, whose weights may be sharded). The key hashes everything the evaluation depends on:
        the initial weights' bytes, the evaluation prompts and metadata, sampler settings, noise seed and reward."""
        if not self.cfg.run.eval_baseline_cache or self.dist.world_size > 1 or self.initial_state is None:
            return None
        h = hashlib.sha256()
        for k in sorted(self.initial_state):
            t = self.initial_state[k].detach().cpu().contiguous()
            h.update(k.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        settings = {k: v for k, v in eval_kw.items() if k != "reward"}
        h.update(
            json.dumps(
                {
                    "prompts": self.prompts.prompts,
                    "metadata": self.prompts.metadata,
                    "eval": settings,
                    "reward": dataclasses.asdict(self.cfg.reward),
                    "model": dataclasses.asdict(self.cfg.model),
                },
                sort_keys=True,
                default=str,
            ).encode()
        )
        return Path(self.cfg.run.eval_baseline_cache) / f"{h.hexdigest()}.json"


def guard_step(guard, iteration: int, metrics: dict[str, Any], cfg, model, ema_weights, trainable, gold_file: Path,
               is_main: bool) -> None:
    """One look of the hacking guard (`harness.HackingGuard`, run.gold_reward): it sees the training reward and
    diversity of `metrics` every iteration and the held-out gold reward, sampled with the EMA weights, every
    run.gold_every iterations; rank 0 appends its line to gold.jsonl and prints an alarm or warning on stderr."""
    import sys

    from ..eval.evaluate import generate

    rc = cfg.run

    def sample(prompts, metadata):
        model.eval()
        with ema_weights.swapped_in(trainable):
            return generate(model, prompts, steps=rc.eval_steps, guidance=rc.eval_guidance, seed=rc.seed + 999,
                            shift=cfg.sampler.shift)

    line = guard.step(iteration, metrics, sample)
    if line is None or not is_main:  # FSDP: the other ranks only joined the sharded forwards
        return
    with open(gold_file, "a") as f:
        f.write(json.dumps(line) + "\n")
    if line["alarm"]:
        print(f"warning: reward-hacking alarm at iteration {iteration}: {line['message']}", file=sys.stderr)
    elif line["warning"]:
        print(f"note: gold fell at iteration {iteration} (per-look test, no alarm): {line['message']}",
              file=sys.stderr)
