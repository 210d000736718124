"""Throughput of the tiny model: pure forward images/s vs rollout images/s on the same batch (issue B), and the
model forward rate of the pretrained checkpoint (issue A).

    python benchmarks/bench_model.py [--batch 64] [--steps 10] [--repeats 7] [--threads 2]
    python benchmarks/bench_model.py --kernels [--batch 64] [--repeats 7] [--threads 2]

--kernels times one forward (no grad, as in rollouts) and one forward + backward (gradients for the conditioning
path only, as the default job trains) of the shipped model under each attention kernel (PyTorch's
scaled_dot_product_attention vs models/tiny.attention, which takes an explicit path in bf16 on CPU) and each GELU
(the pretrained tanh approximation vs exact erf, `model.options.gelu`), in fp32 and bf16; the variants are timed
interleaved, round by round, so machine noise hits them alike.

Prints medians over repeats, measured in one run. The rollout ratio compares "model forwards per second inside a
rollout" (B·T / rollout seconds) with "forwards per second of the bare model" (B / forward seconds): 1.0 means the
sampler, log-prob and bookkeeping cost nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from flowcredit.models import tiny
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


def kernels(a) -> None:
    """Attention and GELU variants of the shipped model: medians over interleaved rounds (ms per batch)."""
    model = TinyFlowModel.load(a.checkpoint)
    for name, p in model.net.named_parameters():  # model.trainable=modulation
        p.requires_grad_(name.startswith(("t_mlp", "pool_mlp", "ada_out")) or ".ada." in name)
    ps = load_prompts("shapes:train")
    cond = model.encode_prompts([ps.prompts[i % len(ps)] for i in range(a.batch)])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(a.batch, *model.latent_shape, generator=gen)
    t = torch.rand(a.batch, generator=gen)
    explicit = tiny.attention

    def sdpa(q, k, v, attn_mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    def forward():
        with torch.no_grad():
            model.velocity(x, t, cond)

    def forward_backward():
        model.velocity(x, t, cond).square().mean().backward()

    print(f"batch {a.batch}, {a.threads} threads; ms per batch, median of {a.repeats} interleaved rounds")
    for prec in ("fp32", "bf16"):
        model.compute_dtype = torch.bfloat16 if prec == "bf16" else torch.float32
        variants = [(att, gelu) for att in ("sdpa", "tiny.attention") for gelu in ("tanh", "exact")]
        times: dict[tuple[str, str, str], list[float]] = {}
        for r in range(a.repeats + 1):  # round 0 warms up
            for att, gelu in variants:
                tiny.attention = sdpa if att == "sdpa" else explicit
                model.set_gelu(gelu)
                for what, fn in (("forward", forward), ("forward+backward", forward_backward)):
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times.setdefault((att, gelu, what), []).append(1e3 * (time.perf_counter() - t0))
        tiny.attention = explicit
        model.set_gelu("tanh")
        base = {w: statistics.median(times[("sdpa", "tanh", w)]) for w in ("forward", "forward+backward")}
        for att, gelu in variants:
            cells = []
            for w in ("forward", "forward+backward"):
                m = statistics.median(times[(att, gelu, w)])
                cells.append(f"{w} {m:7.1f} ms ({base[w] / m:.2f}x)")
            print(f"[{prec}] attention={att:15s} gelu={gelu:6s} " + " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--kernels", action="store_true", help="time the attention and GELU variants (see the docstring)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.kernels:
        kernels(a)
        return
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
