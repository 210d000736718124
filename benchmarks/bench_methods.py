"""Seconds per iteration of Flow-GRPO vs Stepwise-Flow-GRPO vs VGPO on the same batch (issue C.6), by phase,
with model NFEs and reward calls, and the ratio of each method's time to its NFE bound.

    python benchmarks/bench_methods.py [--iters 4] [--threads 2] [--checkpoint PATH]

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

METHODS = {"flow_grpo": "tiny_flow_grpo", "stepwise": "tiny_stepwise", "vgpo": "tiny_vgpo"}


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
        "nfe_rollout": med([r["nfe_rollout"] for r in rows]),
        "reward_calls": med([r["reward_calls"] for r in rows]),
        "pairs": med([r["pairs_trained"] for r in rows]),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides applied to every method")
    a = ap.parse_args()
    torch.manual_seed(0)
    res = {m: run(p, a.iters, a.threads, a.checkpoint, a.overrides) for m, p in METHODS.items()}
    base = res["flow_grpo"]
    per_nfe = base["phases"]["rollout"] / base["nfe_rollout"]
    per_call = base["phases"]["reward"] / base["reward_calls"]
    print(f"{'method':<10} {'s/iter':>7} {'NFE':>6} {'rewards':>7} {'pairs':>6} {'bound s':>8} {'ratio':>6}  phases (s)")
    for m, r in res.items():
        bound = base["seconds"] + (r["nfe"] - base["nfe"]) * per_nfe + (r["reward_calls"] - base["reward_calls"]) * per_call
        bound += (r["phases"].get("update", 0) - base["phases"].get("update", 0))  # trained-pair count differs by method
        ph = " ".join(f"{k}={v:.2f}" for k, v in r["phases"].items())
        print(f"{m:<10} {r['seconds']:7.2f} {r['nfe']:6.0f} {r['reward_calls']:7.0f} {r['pairs']:6.0f} {bound:8.2f} {r['seconds'] / bound:6.2f}  {ph}")
    print(f"(rollout {per_nfe * 1e3:.2f} ms/NFE, reward {per_call * 1e3:.2f} ms/call; ratio = s/iter ÷ NFE bound, goal ≤ 1.1)")


if __name__ == "__main__":
    main()
