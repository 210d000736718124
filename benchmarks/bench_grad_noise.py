"""How much of one iteration's policy gradient is signal? (What limits the main job, issue B.)

    python benchmarks/bench_grad_noise.py [--iters 16] [--threads 2] [key=value ...]
    python benchmarks/bench_grad_noise.py --preset tiny_nft --iters 24 --pairs-per-sample 3 9

Runs K independent Flow-GRPO iterations (new prompts, new noise) of a preset at the SAME weights (the optimizer step
is replaced by a recorder, so nothing moves) and treats each iteration's gradient as g_i = s + n_i, where s is the
expected gradient and n_i its noise. Then (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", §2):

    |s|² ≈ mean_{i≠j} <g_i, g_j>                       (unbiased: the noises of two iterations are independent)
    ρ    = |s|² / mean_i |g_i|²                         signal fraction of one iteration's gradient energy
    B_noise = B · (1/ρ − 1)                             "simple noise scale", in samples (B = samples per iteration)

B_noise is roughly the batch at which one step's gradient is half signal; with B ≪ B_noise each Adam step is mostly
noise, the useful drift per step is ~ρ of its length, and a larger step size adds random-walk damage faster than
progress. The gradients are recorded after `optim.grad_clip` (the default's norms are far below it, so unclipped).
Prints ρ, B_noise and the mean cosine of one iteration's gradient with the mean of the others; one run, read ratios.

Where the noise comes from (forward-process objectives, `--pairs-per-sample K1 K2`): the same measurement at
sampler.train_steps_per_sample = K1 and K2. A sample's k pairs draw (ε, t) independently, so the noise energy of one
iteration, N(k) = (1 − ρ)·mean_i |g_i|², splits as

    N(k) = N_samples + N_forward / k                    (solved from the two k)

N_samples: which prompts and samples the rollout drew (their rewards and advantages); N_forward: the forward-process
draws (ε, t) of the pairs. In the noise-dominated regime the progress per second goes as |s|² / (N(k)·seconds(k)),
so the printed N·s per iteration (lower is better) says whether more pairs per sample pay for their update time.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from flowcredit.cli.main import PRESET_DIR
from flowcredit.config import load_config
from flowcredit.config.schema import TrainConfig
from flowcredit.trainer.loop import Trainer


def gradients(preset: str, iters: int, threads: int, overrides: list[str]) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """K flattened gradients (K, P) of `iters` iterations at the initial weights, the samples per iteration and the
    column indices of each parameter group (module path without layer indices: "blocks.qkv", "text", ...)."""
    with tempfile.TemporaryDirectory() as d:
        ov = [f"run.out_dir={d}", "run.eval_at_end=false", f"run.threads={threads}", "run.grid_every=0",
              "run.checkpoint_every=100000", "optim.inner_epochs=1", "optim.updates_per_epoch=1", *overrides]
        tr = Trainer(load_config(TrainConfig, preset, ov, preset_dirs=[PRESET_DIR]), preset)
        tr.setup()
        tr.ema_weights.shadow = None  # weights never move; keep the EMA out of it
        grads: list[torch.Tensor] = []

        def record(*_a, **_k):
            grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double() for p in tr.trainable]))

        tr.opt.step = record  # the optimizer step becomes a recorder: every iteration sees the same weights
        while len(grads) < iters:  # an iteration whose pairs all have zero advantage records nothing
            tr.train_step().metrics()
            tr.iteration += 1  # next iteration: new prompts and new noise
        B = tr.cfg.data.prompts_per_iter * tr.cfg.data.group_size
        net = getattr(tr.model, "net", None)
        name_of = {id(p): n for n, p in net.named_parameters()} if net is not None else {}
    spans: dict[str, list[torch.Tensor]] = {}
    off = 0
    for p in tr.trainable:  # the column order of `record`
        parts = [x for x in name_of.get(id(p), "other").split(".") if not x.isdigit()]
        key = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        spans.setdefault(key, []).append(torch.arange(off, off + p.numel()))
        off += p.numel()
    return torch.stack(grads), B, {k: torch.cat(v) for k, v in spans.items()}


def signal_fraction(G: torch.Tensor) -> float:
    """ρ = mean_{i≠j} <g_i, g_j> / mean_i |g_i|² of G: (K, P)."""
    K = G.shape[0]
    sq = (G * G).sum(1)  # (K,)
    tot = G.sum(0)
    cross = (tot @ tot - sq.sum()) / (K * (K - 1))
    return float(cross / sq.mean())


def noise_stats(G: torch.Tensor, B: int) -> dict[str, float]:
    """G: (K, P) gradients of K independent batches of B samples each. rho_se: jackknife standard error of ρ."""
    K = G.shape[0]
    sq = (G * G).sum(1)  # (K,)
    tot = G.sum(0)
    rho = signal_fraction(G)
    loo = torch.tensor([signal_fraction(torch.cat([G[:i], G[i + 1 :]])) for i in range(K)])
    rho_se = float(((K - 1) / K * ((loo - loo.mean()) ** 2).sum()).sqrt())
    cos_rest = []
    for i in range(K):
        rest = (tot - G[i]) / (K - 1)
        cos_rest.append(float(G[i] @ rest / (G[i].norm() * rest.norm() + 1e-30)))
    return {
        "K": K,
        "B": B,
        "grad_norm": float(sq.sqrt().mean()),
        "rho": rho,
        "rho_se": rho_se,
        "B_noise": B * (1 / rho - 1) if rho > 0 else float("inf"),
        "cos_with_rest": sum(cos_rest) / K,
    }


def noise_decomposition(k1: int, n1: float, k2: int, n2: float) -> tuple[float, float]:
    """(N_samples, N_forward) from the noise energies n1, n2 measured at k1 ≠ k2 pairs per sample: N = N_s + N_f/k."""
    if k1 == k2:
        raise ValueError("--pairs-per-sample needs two different values")
    n_f = (n1 - n2) / (1.0 / k1 - 1.0 / k2)
    return n1 - n_f / k1, n_f


def decompose(a: argparse.Namespace) -> None:
    rows = []
    for k in a.pairs_per_sample:
        t0 = time.perf_counter()
        G, B, _ = gradients(a.preset, a.iters, a.threads, [*a.overrides, f"sampler.train_steps_per_sample={k}"])
        sec = (time.perf_counter() - t0) / a.iters  # setup included: an upper bound, same for both
        s = noise_stats(G, B)
        g2 = float((G * G).sum(1).mean())
        rows.append((k, s, (1 - s["rho"]) * g2, s["rho"] * g2, sec))
    print(f"{a.preset} {' '.join(a.overrides)}: K={a.iters} iterations per setting")
    print(f"{'pairs/sample':>12} {'rho':>8} {'± se':>7} {'signal |s|²':>12} {'noise N':>10} {'s/iter':>7} {'N·s':>9}")
    for k, s, n, sig, sec in rows:
        print(f"{k:12d} {s['rho']:8.4f} {s['rho_se']:7.4f} {sig:12.3e} {n:10.3e} {sec:7.2f} {n * sec:9.3e}")
    (k1, _, n1, _, _), (k2, _, n2, _, _) = rows
    n_s, n_f = noise_decomposition(k1, n1, k2, n2)
    print(f"N = N_samples + N_forward/k: N_samples = {n_s:.3e}, N_forward = {n_f:.3e}; at k = {k1} the "
          f"forward-process draws are {n_f / k1 / n1:.0%} of the noise energy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny_flow_grpo")
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs-per-sample", type=int, nargs=2, metavar=("K1", "K2"),
                    help="decompose the noise at two sampler.train_steps_per_sample values (nft/awm presets)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the preset")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.pairs_per_sample:
        decompose(a)
        return
    G, B, groups = gradients(a.preset, a.iters, a.threads, a.overrides)
    s = noise_stats(G, B)
    print(f"{a.preset} {' '.join(a.overrides)}")
    print(f"K={s['K']} iterations × B={s['B']} samples, mean |g| = {s['grad_norm']:.3g}")
    print(f"signal fraction ρ = {s['rho']:.4f} ± {s['rho_se']:.4f}   noise scale B_noise ≈ {s['B_noise']:.0f} samples   "
          f"cos(g_i, mean of the others) = {s['cos_with_rest']:.3f}")

    if groups:
        total_signal = s["rho"] * float((G * G).sum(1).mean())
        print(f"{'parameter group':<18} {'params':>9} {'ρ':>8} {'± se':>7} {'share of |s|²':>13}")
        for k, idx in groups.items():
            g = noise_stats(G[:, idx], B)
            sig = g["rho"] * float((G[:, idx] ** 2).sum(1).mean())
            print(f"{k:<18} {len(idx):9d} {g['rho']:8.4f} {g['rho_se']:7.4f} {sig / total_signal if total_signal else float('nan'):13.2f}")


if __name__ == "__main__":
    main()
