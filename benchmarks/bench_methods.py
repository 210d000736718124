"""Seconds per iteration of Flow-GRPO vs Stepwise-Flow-GRPO vs VGPO on the same batch (issue C.6), by phase,
with model NFEs and reward calls, and the ratio of each method's time to its NFE bound.

    python benchmarks/bench_methods.py [--iters 8] [--threads 2] [--checkpoint PATH] [--arms flow_grpo stepwise ...]

NFE bound of a method = Flow-GRPO's measured iteration time + (extra NFEs) × (rollout seconds per NFE) + (extra
reward calls) × (reward seconds per call) + (its update-phase difference, since methods train different numbers
of (sample, step) pairs), i.e. what the method would cost if its extra work ran at the rollout's
and the reward's own per-unit speed. Goal: ratio ≤ 1.1. Medians over iterations after one warm-up, one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from flowcredit.cli.main import PRESET_DIR
from flowcredit.config import load_config
from flowcredit.config.schema import TrainConfig
from flowcredit.trainer.loop import Trainer

# arm → (preset, overrides): the presets' recipes; stepwise at T′ = 1 (the rollout velocities reused: 0 extra NFEs
# for the estimates) and with the pairs drawn first (credit.options.states=drawn: only the drawn pairs' states)
METHODS = {
    "flow_grpo": ("tiny_flow_grpo", []),
    "stepwise": ("tiny_stepwise", []),
    "stepwise_T1": ("tiny_stepwise", ["estimate.substeps=1"]),
    "stepwise_drawn": ("tiny_stepwise", ["credit.options.states=drawn"]),
    "stepwise_T1_drawn": ("tiny_stepwise", ["estimate.substeps=1", "credit.options.states=drawn"]),
    "vgpo": ("tiny_vgpo", []),
}


def run(preset: str, iters: int, threads: int, checkpoint: str | None, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        ov = [f"run.out_dir={d}", "run.eval_at_end=false", f"run.threads={threads}", "run.grid_every=0", "run.checkpoint_every=100000", *extra]
        if checkpoint:
            ov.append(f"model.path={checkpoint}")
        tr = Trainer(load_config(TrainConfig, preset, ov, preset_dirs=[PRESET_DIR]), preset)
        tr.setup()
        rows = [tr.train_step().metrics() for _ in range(iters + 1)][1:]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    phases = sorted({k for r in rows for k in r["seconds"]})
    return {
        "seconds": med([r["seconds_total"] for r in rows]),
        "phases": {p: med([r["seconds"].get(p, 0.0) for r in rows]) for p in phases},
        "nfe": med([r["nfe_rollout"] + r.get("nfe_estimates", 0) for r in rows]),
        # every model evaluation of an iteration: rollout + estimates + update (forward + backward counted as 2)
        "nfe_total": med([r["nfe_rollout"] + r.get("nfe_estimates", 0) + r["nfe_update"] for r in rows]),
        "nfe_rollout": med([r["nfe_rollout"] for r in rows]),
        "reward_calls": med([r["reward_calls"] for r in rows]),
        "pairs": med([r["pairs_trained"] for r in rows]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--arms", nargs="*", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides applied to every method")
    a = ap.parse_args()
    torch.manual_seed(0)
    res = {m: run(METHODS[m][0], a.iters, a.threads, a.checkpoint, [*METHODS[m][1], *a.overrides])
           for m in dict.fromkeys(["flow_grpo", *a.arms])}
    base = res["flow_grpo"]
    per_nfe = base["phases"]["rollout"] / base["nfe_rollout"]
    per_call = base["phases"]["reward"] / base["reward_calls"]
    print(f"{'method':<17} {'s/iter':>7} {'NFE':>6} {'NFE all':>8} {'×NFE':>5} {'×time':>6} {'rewards':>7} {'pairs':>6} "
          f"{'bound s':>8} {'ratio':>6}  phases (s)")
    for m, r in res.items():
        bound = base["seconds"] + (r["nfe"] - base["nfe"]) * per_nfe + (r["reward_calls"] - base["reward_calls"]) * per_call
        bound += (r["phases"].get("update", 0) - base["phases"].get("update", 0))  # trained-pair count differs by method
        ph = " ".join(f"{k}={v:.2f}" for k, v in r["phases"].items())
        x_nfe, x_time = r["nfe_total"] / base["nfe_total"], r["seconds"] / base["seconds"]
        print(f"{m:<17} {r['seconds']:7.2f} {r['nfe']:6.0f} {r['nfe_total']:8.0f} {x_nfe:5.2f} {x_time:6.2f} "
              f"{r['reward_calls']:7.0f} {r['pairs']:6.0f} {bound:8.2f} {r['seconds'] / bound:6.2f}  {ph}")
    print(f"(rollout {per_nfe * 1e3:.2f} ms/NFE, reward {per_call * 1e3:.2f} ms/call; ratio = s/iter ÷ NFE bound, goal ≤ 1.1; "
          "×NFE / ×time: every NFE of an iteration / its seconds, over flow_grpo's)")


if __name__ == "__main__":
    main()
