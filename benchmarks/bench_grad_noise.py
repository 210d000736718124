"""How much of one iteration's policy gradient is signal? (What limits the main job, issue B.)

    python benchmarks/bench_grad_noise.py [--iters 16] [--threads 2] [key=value ...]

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
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from flowcredit.cli.main import PRESET_DIR
from flowcredit.config import load_config
from flowcredit.config.schema import TrainConfig
from flowcredit.trainer.grpo import GRPOTrainer


def gradients(preset: str, iters: int, threads: int, overrides: list[str]) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """K flattened gradients (K, P) of `iters` iterations at the initial weights, the samples per iteration and the
    column indices of each parameter group (module path without layer indices: "blocks.qkv", "text", ...)."""
    with tempfile.TemporaryDirectory() as d:
        ov = [f"run.out_dir={d}", "run.eval_at_end=false", f"run.threads={threads}", "run.grid_every=0",
              "run.checkpoint_every=100000", "optim.inner_epochs=1", "optim.updates_per_epoch=1", *overrides]
        tr = GRPOTrainer(load_config(TrainConfig, preset, ov, preset_dirs=[PRESET_DIR]), preset)
        tr.setup()
        tr.ema = None  # weights never move; keep the EMA out of it
        grads: list[torch.Tensor] = []

        def record(*_a, **_k):
            grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double() for p in tr.trainable]))

        tr.opt.step = record  # the optimizer step becomes a recorder: every iteration sees the same weights
        while len(grads) < iters:  # an iteration whose pairs all have zero advantage records nothing
            tr.train_step()
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny_flow_grpo")
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the preset")
    a = ap.parse_args()
    torch.manual_seed(0)
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
