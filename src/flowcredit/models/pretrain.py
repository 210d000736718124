"""Flow-matching pretraining of the tiny model on rendered shapes-world ground truth (`flowcredit pretrain`).

Objective (rectified flow, ALGORITHMS.md §1.1): x_t = (1 − t)·x0 + t·x1, target v = x1 − x0, MSE.
t ~ logit-normal(0, 1) followed by the SD3 shift (CALIBRATION.md: shift 3), prompt dropout → "" for CFG.
Data: an endless stream of fresh layouts of the train-split prompts (tags sampled uniformly, so the 4
single-object prompts are not drowned by the 640 color_attr ones), rendered on the fly (≈ 0.3 ms/image).
The run is seeded and resumable: `state.pt` holds weights, EMA, optimizer, step and every RNG; it is written
atomically (temp file + rename) every `checkpoint_every` steps. The EMA weights are what we evaluate and ship.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..shapes.prompts import load_prompts
from ..shapes.render import render_batch
from ..shapes.vocab import TAGS
from .tiny import TinyDiTConfig, TinyFlowModel


@dataclass
class PretrainConfig:
    """Pretraining settings (every field has a CLI flag in `flowcredit pretrain`)."""

    out_dir: str = "pretrain_runs/tiny"
    steps: int = 20000
    batch_size: int = 64
    lr: float = 6e-4
    warmup: int = 300
    decay_start: int = 0  # > 0: lr decays linearly from `lr` at this step to `lr_final` at `steps`
    lr_final: float = 6e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    prompt_dropout: float = 0.1
    time_shift: float = 3.0
    seed: int = 0
    bf16: bool = True
    threads: int = 2
    checkpoint_every: int = 500
    log_every: int = 50
    prompts: str = "shapes:train"
    init: str = ""  # start (model and EMA) from these tiny-model weights, e.g. the shipped checkpoint; "" = random
    model: dict = field(default_factory=dict)  # TinyDiTConfig overrides


def sample_t(n: int, shift: float, gen: torch.Generator) -> torch.Tensor:
    """t = shift(σ(u)), u ~ N(0, 1): SD3's logit-normal training density with the resolution shift."""
    s = torch.sigmoid(torch.randn(n, generator=gen))
    return shift * s / (1 + (shift - 1) * s)


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def pretrain(cfg: PretrainConfig, progress: bool = True) -> Path:
    """Run (or resume) pretraining. Returns the run directory."""
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    model_cfg = TinyDiTConfig(**cfg.model)
    torch.manual_seed(cfg.seed)  # the initial weights come from cfg.seed, not from whatever the global RNG holds
    model = TinyFlowModel(model_cfg)
    model.compute_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    if cfg.init:  # continue from given weights (a fresh optimizer); the architecture comes from their JSON
        init = TinyFlowModel.load(None if cfg.init == "shipped" else cfg.init)
        model_cfg = init.cfg
        model = TinyFlowModel(model_cfg)
        model.net.load_state_dict(init.net.state_dict())
        model.compute_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    ema = copy.deepcopy(model.net).requires_grad_(False)
    opt = torch.optim.AdamW(model.net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    step = 0
    state_path = out / "state.pt"
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.net.load_state_dict(st["model"])
        ema.load_state_dict(st["ema"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["torch_gen"])
        rng.bit_generator.state = st["np_rng"]
        step = st["step"]
        print(f"resumed from {state_path} at step {step}")

    data = load_prompts(cfg.prompts)
    by_tag: dict[str, list[int]] = {}
    for i, m in enumerate(data.metadata):
        by_tag.setdefault(m.get("tag", "plain"), []).append(i)
    tags = [t for t in TAGS if t in by_tag] or list(by_tag)

    def lr_at(s: int) -> float:
        lr = cfg.lr * min(1.0, (s + 1) / cfg.warmup)
        if cfg.decay_start and s >= cfg.decay_start:
            frac = min(1.0, (s - cfg.decay_start) / max(1, cfg.steps - cfg.decay_start))
            lr = cfg.lr + frac * (cfg.lr_final - cfg.lr)
        return lr

    log_f = open(out / "log.jsonl", "a")
    t0 = time.time()
    losses: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="pretrain", dynamic_ncols=True)
    while step < cfg.steps:
        idx = [by_tag[tags[k]][rng.integers(len(by_tag[tags[k]]))] for k in rng.integers(len(tags), size=cfg.batch_size)]
        recs = [data.metadata[i] for i in idx]
        imgs = torch.from_numpy(render_batch(recs, rng)).permute(0, 3, 1, 2).float() / 255.0
        x0 = model.encode_images(imgs)
        prompts = [data.prompts[i] if rng.random() >= cfg.prompt_dropout else "" for i in idx]
        cond = model.encode_prompts(prompts)
        x1 = torch.randn(x0.shape, generator=gen)
        t = sample_t(cfg.batch_size, cfg.time_shift, gen)
        tb = t[:, None, None, None]
        x_t = (1 - tb) * x0 + tb * x1
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        model.net.train()
        v = model.velocity(x_t, t, cond)
        loss = (v - (x1 - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.net.parameters(), cfg.grad_clip)
        opt.step()
        with torch.no_grad():
            d = min(cfg.ema_decay, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.net.parameters()):
                pe.lerp_(pm, 1 - d)
        step += 1
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
        if step % cfg.log_every == 0:
            rec = {"step": step, "loss": float(np.mean(losses)), "grad_norm": float(gn), "lr": lr_at(step - 1), "elapsed_s": time.time() - t0}
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.4f}")
            losses = []
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _atomic_save(
                {"model": model.net.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(), "step": step,
                 "torch_gen": gen.get_state(), "np_rng": rng.bit_generator.state},
                state_path,
            )
            snap = TinyFlowModel(model_cfg)
            snap.net.load_state_dict(ema.state_dict())
            snap.save(out / "ema", name=f"step{step:06d}", extra={"step": step, "pretrain": asdict(cfg)})
    if bar is not None:
        bar.close()
    log_f.close()
    return out


def main_from_args(args) -> None:  # used by the CLI
    cfg = PretrainConfig(**{k: v for k, v in vars(args).items() if k in PretrainConfig.__dataclass_fields__ and v is not None})
    pretrain(cfg)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="pretrain the tiny flow model")
    for f_name, f in PretrainConfig.__dataclass_fields__.items():
        if f_name == "model":
            continue
        typ = type(f.default) if f.default is not None else str
        if typ is bool:
            ap.add_argument(f"--{f_name}", type=lambda s: s.lower() in ("1", "true", "yes"), default=None)
        else:
            ap.add_argument(f"--{f_name}", type=typ, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--depth", type=int, default=None)
    a = ap.parse_args()
    cfg = PretrainConfig(**{k: v for k, v in vars(a).items() if k in PretrainConfig.__dataclass_fields__ and v is not None})
    if a.width:
        cfg.model["width"] = a.width
    if a.depth:
        cfg.model["depth"] = a.depth
    pretrain(cfg)
