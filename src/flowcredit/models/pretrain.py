"""Flow-matching pretraining of the tiny model on rendered shapes-world ground truth (`flowcredit pretrain`).

Objective (rectified flow, ALGORITHMS.md §1.1): x_t = (1 − t)·x0 + t·x1, target v = x1 − x0, MSE.
t ~ logit-normal(0, 1) followed by the SD3 shift (CALIBRATION.md: shift 3), prompt dropout → "" for CFG.
Data: an endless stream of fresh layouts of the train-split prompts (tags sampled uniformly, so the 4
single-object prompts are not drowned by the 640 color_attr ones), rendered on the fly (≈ 0.3 ms/image).
The run is seeded and resumable: `checkpoints/stepNNNNNN/` (safetensors + JSON + sha256 manifest,
`checkpoints.py`; the two newest are kept) holds weights, EMA, optimizer, step and every RNG; it is written
atomically (temp folder + rename) every `checkpoint_every` steps and when `max_minutes` runs out. A folder holding an
old pickle `state.pt` is refused (convert a trusted one: `flowcredit convert --trust state.pt`). The EMA weights are
what we evaluate and ship.

Devices: `device=auto` trains on CUDA when present, else on the CPU (same code; `precision=auto` picks bf16 autocast
where the device runs it fast, fp32 elsewhere). On an
accelerator the CPU renderer is the bottleneck, so `workers > 0` renders batches in that many DataLoader processes.
With `workers = 0` (the default) the data stream comes from one seeded generator and resume is bit-exact; with
workers each process draws from its own generator seeded by (seed, tag, start step, worker id), so a resumed run is
reproducible but not identical to an uninterrupted one.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import checkpoints as checkpoint
from ..shapes.prompts import load_prompts
from ..shapes.render import render_batch
from ..shapes.vocab import TAGS
from .precision import PRECISIONS, resolve_precision
from .tiny import TinyDiTConfig, TinyFlowModel


def _h(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass
class PretrainConfig:
    """Pretraining settings (every field but `model` is a CLI flag of `flowcredit pretrain`, with its help text)."""

    out_dir: str = _h(
        "pretrain_runs/tiny",
        "run folder (checkpoints/step*/, log.jsonl, ema/step*.safetensors); an existing one is resumed",
    )
    steps: int = _h(20000, "total optimizer steps of the run (the learning-rate schedule ends here)")
    batch_size: int = _h(64, "images per step")
    lr: float = _h(6e-4, "peak AdamW learning rate")
    warmup: int = _h(300, "linear warm-up steps")
    decay_start: int = _h(
        0, "> 0: decay the lr linearly from this step to lr_final at `steps`; 0: constant after warm-up"
    )
    lr_final: float = _h(6e-5, "learning rate at the last step when decay_start > 0")
    weight_decay: float = _h(0.0, "AdamW weight decay")
    grad_clip: float = _h(1.0, "clip the global gradient norm to this value")
    ema_decay: float = _h(0.999, "EMA decay of the weights that are snapshotted and shipped")
    prompt_dropout: float = _h(
        0.1, "probability of replacing a prompt by '' (trains the unconditional branch for CFG)"
    )
    time_shift: float = _h(
        3.0, "SD3 resolution shift of the logit-normal t density (3 early, 1 later; see the shipped JSON)"
    )
    seed: int = _h(0, "seed of the initial weights, the layouts, the noise and t")
    precision: str = _h(
        "auto",
        "autocast dtype of the forward/backward (weights and optimizer stay fp32): auto | fp32 | bf16; auto = bf16 "
        "on CUDA with bf16 and on CPUs with AVX-512 BF16/AMX, else fp32 (bf16 is emulated there, 4.4× slower; "
        "models/precision.py)",
    )
    threads: int = _h(2, "torch CPU threads")
    checkpoint_every: int = _h(500, "write a checkpoint (checkpoints/stepNNNNNN/) and an EMA snapshot every N steps")
    log_every: int = _h(50, "append the mean loss to log.jsonl every N steps")
    prompts: str = _h("shapes:train", "training prompts: shapes:train or a GenEval-style metadata .jsonl")
    init: str = _h("", "start from these tiny-model weights ('shipped' = the packaged model); '' = random init")
    device: str = _h("auto", "auto (CUDA if available, else CPU) | cpu | cuda | cuda:N")
    workers: int = _h(
        0, "render batches in N DataLoader processes (for accelerators; 0 = in-process, bit-exact resume)"
    )
    max_minutes: float = _h(
        0.0, "> 0: checkpoint and stop after this many minutes of training; rerun the same command to continue"
    )
    model: dict = field(default_factory=dict)  # TinyDiTConfig overrides


def sample_t(n: int, shift: float, gen: torch.Generator) -> torch.Tensor:
    """t = shift(σ(u)), u ~ N(0, 1): SD3's logit-normal training density with the resolution shift."""
    s = torch.sigmoid(torch.randn(n, generator=gen))
    return shift * s / (1 + (shift - 1) * s)


def resolve_device(name: str) -> torch.device:
    """'auto' → cuda when available, else cpu; anything else is passed to torch.device (clear error if unusable)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: '{name}' asked for but CUDA is not available here; use device=cpu or device=auto")
    return dev


def _group_by_tag(metadata: list[dict]) -> tuple[dict[str, list[int]], list[str]]:
    by_tag: dict[str, list[int]] = {}
    for i, m in enumerate(metadata):
        by_tag.setdefault(m.get("tag", "plain"), []).append(i)
    return by_tag, [t for t in TAGS if t in by_tag] or list(by_tag)


def make_batch(
    data,
    by_tag: dict[str, list[int]],
    tags: list[str],
    batch_size: int,
    prompt_dropout: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, list[str]]:
    """One training batch from `rng`: a tag uniformly, a prompt of that tag, a fresh random layout of it.

    Returns:
        images: (batch_size, 32, 32, 3) uint8 renders; prompts: batch_size strings ("" where dropped for CFG).
    """
    idx = [by_tag[tags[k]][rng.integers(len(by_tag[tags[k]]))] for k in rng.integers(len(tags), size=batch_size)]
    imgs = render_batch([data.metadata[i] for i in idx], rng)
    prompts = [data.prompts[i] if rng.random() >= prompt_dropout else "" for i in idx]
    return imgs, prompts


_WORKER_STREAM_TAG = 0x5EED0F


class _RenderStream(torch.utils.data.IterableDataset):
    """Endless batches rendered in DataLoader worker processes; worker w draws from rng(seed, tag, start step, w)."""

    def __init__(self, cfg: PretrainConfig, start_step: int):
        self.cfg, self.start_step = cfg, start_step

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info is not None else 0
        # The non-zero tag keeps this stream apart from default_rng(seed) of the in-process path: numpy's SeedSequence
        # pads short entropy with zeros, so [seed, 0, 0] would collide with [seed].
        rng = np.random.default_rng([self.cfg.seed, _WORKER_STREAM_TAG, self.start_step, wid])
        data = load_prompts(self.cfg.prompts)
        by_tag, tags = _group_by_tag(data.metadata)
        while True:
            imgs, prompts = make_batch(data, by_tag, tags, self.cfg.batch_size, self.cfg.prompt_dropout, rng)
            yield torch.from_numpy(imgs), prompts


def validate(cfg: PretrainConfig) -> torch.device:
    """Check the settings before anything is written; returns the device. Raises ValueError / FileNotFoundError."""
    for name in ("steps", "batch_size", "checkpoint_every", "log_every", "threads"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}: must be >= 1 (got {getattr(cfg, name)})")
    if cfg.workers < 0:
        raise ValueError(f"workers: must be >= 0 (got {cfg.workers}); 0 renders in the training process")
    if cfg.max_minutes < 0:
        raise ValueError(f"max_minutes: must be >= 0 (got {cfg.max_minutes}); 0 means no time limit")
    if cfg.init and cfg.init != "shipped" and not Path(cfg.init).exists():
        raise FileNotFoundError(f"init: '{cfg.init}' not found; pass a tiny-model .safetensors, 'shipped' or ''")
    if cfg.precision not in PRECISIONS:
        raise ValueError(
            f"precision: {cfg.precision!r} is not one of {', '.join(PRECISIONS)}; pass --precision auto, fp32 or bf16"
        )
    return resolve_device(cfg.device)


def _build_model(cfg: PretrainConfig, device: torch.device, precision: str) -> tuple[TinyFlowModel, TinyDiTConfig]:
    """A fresh model from cfg.model seeded by cfg.seed, or cfg.init's weights (and architecture), on `device`."""
    model_cfg = TinyDiTConfig(**cfg.model)
    torch.manual_seed(cfg.seed)  # the initial weights come from cfg.seed, not from whatever the global RNG holds
    model = TinyFlowModel(model_cfg)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model.compute_dtype = dtype
    if cfg.init:  # continue from given weights (a fresh optimizer); the architecture comes from their JSON
        init = TinyFlowModel.load(None if cfg.init == "shipped" else cfg.init)
        model_cfg = init.cfg
        model = TinyFlowModel(model_cfg)
        model.net.load_state_dict(init.net.state_dict())
        model.compute_dtype = dtype
    return model.to(device), model_cfg


def _resume(out: Path, model: TinyFlowModel, ema: torch.nn.Module, opt, gen: torch.Generator, rng) -> int:
    """Load the newest intact checkpoint of `out` into the objects (damaged ones are warned about and skipped);
    returns its step (0 without one). An old pickle state.pt is refused with one line."""
    state_path = checkpoint.find_latest(out / "checkpoints", prefix="step")
    if state_path is None and (out / "state.pt").exists():
        raise checkpoint.CheckpointError(checkpoint.legacy_hint(out / "state.pt"))
    if state_path is None:
        return 0
    st = checkpoint.load(state_path)  # tensors on the CPU (the RNG states must stay there)
    model.net.load_state_dict(st["model"])
    ema.load_state_dict(st["ema"])
    opt.load_state_dict(st["opt"])
    gen.set_state(st["torch_gen"])
    rng.bit_generator.state = st["np_rng"]
    print(f"resumed from {state_path} at step {st['step']}")
    return int(st["step"])


def _lr_at(cfg: PretrainConfig, s: int) -> float:
    """Linear warm-up over cfg.warmup steps, then constant, then linear to cfg.lr_final from cfg.decay_start."""
    lr = cfg.lr * min(1.0, (s + 1) / cfg.warmup)
    if cfg.decay_start and s >= cfg.decay_start:
        frac = min(1.0, (s - cfg.decay_start) / max(1, cfg.steps - cfg.decay_start))
        lr = cfg.lr + frac * (cfg.lr_final - cfg.lr)
    return lr


def _flow_matching_step(cfg: PretrainConfig, model: TinyFlowModel, ema: torch.nn.Module, opt, imgs_u8: torch.Tensor,
                        prompts: list[str], gen: torch.Generator, step: int,
                        device: torch.device) -> tuple[float, float]:
    """One optimizer step of the flow-matching loss |v(x_t, t) − (x1 − x0)|² on a batch (imgs_u8: (N, H, W, 3)
    uint8), then the EMA; returns (loss, gradient norm)."""
    imgs = imgs_u8.to(device, non_blocking=True).permute(0, 3, 1, 2).float() / 255.0
    x0 = model.encode_images(imgs)
    cond = model.encode_prompts(prompts)
    x1 = torch.randn(x0.shape, generator=gen).to(device)  # noise and t from the CPU generator on every device
    t = sample_t(cfg.batch_size, cfg.time_shift, gen).to(device)
    tb = t[:, None, None, None]
    x_t = (1 - tb) * x0 + tb * x1
    for g in opt.param_groups:
        g["lr"] = _lr_at(cfg, step)
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
    return loss.item(), float(gn)


def _save(cfg: PretrainConfig, out: Path, model: TinyFlowModel, model_cfg: TinyDiTConfig, ema: torch.nn.Module, opt,
          step: int, gen: torch.Generator, rng) -> None:
    """checkpoints/stepNNNNNN (every state, safetensors + JSON; the two newest kept) and the EMA weights as a tiny
    model file ema/stepNNNNNN."""
    checkpoint.save(
        {
            "model": model.net.state_dict(),
            "ema": ema.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "torch_gen": gen.get_state(),
            "np_rng": rng.bit_generator.state,
        },
        out / "checkpoints" / f"step{step:06d}",
        iteration=step,
        keep=2,
    )
    snap = TinyFlowModel(model_cfg)
    snap.net.load_state_dict(ema.state_dict())
    snap.save(out / "ema", name=f"step{step:06d}", extra={"step": step, "pretrain": asdict(cfg)})


def _batches(cfg: PretrainConfig, step: int, device: torch.device, rng):
    """A function returning the next (uint8 images (N, H, W, 3), prompts) batch: rendered in this process with the
    numpy generator `rng` (saved in the checkpoints), or by cfg.workers DataLoader workers."""
    data = load_prompts(cfg.prompts)
    by_tag, tags = _group_by_tag(data.metadata)
    if cfg.workers <= 0:
        def local():
            imgs_np, prompts = make_batch(data, by_tag, tags, cfg.batch_size, cfg.prompt_dropout, rng)
            return torch.from_numpy(imgs_np), prompts

        return local
    stream = iter(torch.utils.data.DataLoader(_RenderStream(cfg, step), batch_size=None, num_workers=cfg.workers,
                                              prefetch_factor=4, persistent_workers=True,
                                              pin_memory=device.type == "cuda"))
    return lambda: next(stream)


def pretrain(cfg: PretrainConfig, progress: bool = True) -> Path:
    """Run (or resume) pretraining. Returns the run directory."""
    device = validate(cfg)
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(cfg.precision, device)  # 'auto' → bf16 / fp32 for this device
    (out / "config.json").write_text(json.dumps({**asdict(cfg), "resolved_precision": precision}, indent=2))
    model, model_cfg = _build_model(cfg, device, precision)
    ema = copy.deepcopy(model.net).requires_grad_(False)
    opt = torch.optim.AdamW(model.net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    step = _resume(out, model, ema, opt, gen, rng)
    next_batch = _batches(cfg, step, device, rng)
    log_f = open(out / "log.jsonl", "a")
    t0 = time.time()
    losses: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="pretrain", dynamic_ncols=True)
    stopped_early = False
    while step < cfg.steps:
        imgs_u8, prompts = next_batch()
        loss, gn = _flow_matching_step(cfg, model, ema, opt, imgs_u8, prompts, gen, step, device)
        step += 1
        losses.append(loss)
        out_of_time = cfg.max_minutes > 0 and time.time() - t0 > 60.0 * cfg.max_minutes and step < cfg.steps
        if bar is not None:
            bar.update(1)
        if step % cfg.log_every == 0:
            rec = {"step": step, "loss": float(np.mean(losses)), "grad_norm": gn, "lr": _lr_at(cfg, step - 1),
                   "elapsed_s": time.time() - t0}
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.4f}")
            losses = []
        if step % cfg.checkpoint_every == 0 or step == cfg.steps or out_of_time:
            _save(cfg, out, model, model_cfg, ema, opt, step, gen, rng)
        if out_of_time:
            stopped_early = True
            break
    if bar is not None:
        bar.close()
    log_f.close()
    if stopped_early:
        print(
            f"max_minutes={cfg.max_minutes} reached: stopped at step {step} of {cfg.steps} with a checkpoint; "
            f"rerun the same command to continue"
        )
    return out
