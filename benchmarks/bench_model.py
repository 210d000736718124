"""Throughput of the tiny model: pure forward images/s vs rollout images/s on the same batch (issue B), and the
model forward rate of the pretrained checkpoint (issue A).

    python benchmarks/bench_model.py [--batch 64] [--steps 10] [--repeats 7] [--threads 2]

Prints medians over repeats, measured in one run. The rollout ratio compares "model forwards per second inside a
rollout" (B·T / rollout seconds) with "forwards per second of the bare model" (B / forward seconds): 1.0 means the
sampler, log-prob and bookkeeping cost nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flowcredit.models.tiny import TinyFlowModel
from flowcredit.samplers.rollout import make_initial_noise, rollout
from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import SamplerParams
from flowcredit.shapes.prompts import load_prompts


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = TinyFlowModel.load(a.checkpoint)
    ps = load_prompts("shapes:train")
    prompts = [ps.prompts[i % len(ps)] for i in range(a.batch)]
    meta = [ps.metadata[i % len(ps)] for i in range(a.batch)]
    gids = torch.arange(a.batch) // 8
    grid = time_grid(a.steps, 3.0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(a.batch, *model.latent_shape, generator=gen)
    t = torch.full((a.batch,), 0.5)
    cond = model.encode_prompts(prompts)
    print(f"tiny model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, batch {a.batch}, {a.threads} threads")
    for prec in ("fp32", "bf16"):
        model.compute_dtype = torch.bfloat16 if prec == "bf16" else torch.float32
        with torch.no_grad():
            t_fwd = median_time(lambda: model.velocity(x, t, cond), a.repeats)
        params = SamplerParams(name="flow_sde")
        t_roll = median_time(
            lambda: rollout(model, prompts, meta, gids, timesteps=grid, sampler=params, guidance_scale=1.0, generator=gen,
                            init_noise=make_initial_noise(a.batch, model.latent_shape, gids, False, gen), keep_velocities=False,
                            cond=cond),
            max(3, a.repeats // 2),
        )
        fwd_ips = a.batch / t_fwd
        roll_fwd_ips = a.batch * a.steps / t_roll
        print(
            f"[{prec}] model forward: {fwd_ips:8.1f} images/s ({1e3 * t_fwd:.1f} ms/batch) | rollout ({a.steps} flow_sde steps): "
            f"{a.batch / t_roll:7.1f} images/s = {roll_fwd_ips:8.1f} forward-images/s | ratio rollout/forward = {roll_fwd_ips / fwd_ips:.3f}"
        )


if __name__ == "__main__":
    main()
