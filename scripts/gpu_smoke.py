"""The first thing to run on a new GPU box: real-size SD3.5-Medium and FLUX.1-dev transformers, random weights, through
flowcredit's own trainer, with every number a first GPU run must confirm. Nothing is downloaded.

    python scripts/gpu_smoke.py                                  # real size on cuda, both families (≈ 3-5 min, H100)
    python scripts/gpu_smoke.py --families sd35m --out runs/smoke
    python scripts/gpu_smoke.py --small                          # tiny configs on CPU in seconds (the test suite's)

For each family the script writes a diffusers model folder in a temporary directory (random weights; the transformer
in bf16 from its real config; narrow random text encoders with the real OUTPUT widths and sequence lengths; the real
VAE), then runs ONE iteration (rollout → reward → credit → update) of `Trainer` for objective `grpo` and one for
`nft`, each from the family's recipe (configs/sd35m_flow_grpo, sd35m_nft, flux1dev_flow_grpo; FLUX.1 has no nft
recipe: flux1dev_flow_grpo with objective nft, the ODE rollout and DiffusionNFT's KL 1e-4) with LoRA and bf16 as the
recipe sets them (SD3.5-M r32/α64, FLUX.1 r64/α128), a small batch (1 prompt × G=2), the recipe's T (10 / 6) and
512 px. The reward is `imagestats` brightness (no model). It measures, and checks (PASS / FAIL / INFO):

  * memory: the preflight's prediction (`trainer.preflight.estimate_memory`, what `check_memory` compares with the
    free memory) vs the measured peak of the iteration (`torch.cuda.max_memory_allocated`; on CPU the sampled RSS,
    reported, not asserted): measured ≤ predicted × the preflight's margin (1.25);
  * seconds per phase of the iteration (the trainer's own `seconds`), the folder build and the trainer setup;
  * on-policy ratio: grpo's `ratio_mean` must be exactly 1 and `parity_max_abs_dlogp` (rollout log-probs vs the
    update's recomputation) ≤ --parity-tol; nft's `old_deviate` (v_θ vs v_old) must be 0;
  * the update ran: pairs trained, finite non-zero gradient norm, no skipped step, the LoRA weights changed;
  * bf16 vs fp32 log-probs: after the update, a fresh rollout (bf16 autocast, as trained) is scored again with the
    same weights and inputs in bf16 autocast and in fp32 (the transformer cast to fp32: bf16 → fp32 is exact, so only
    the arithmetic differs; TF32 off) at ≤ 4 trained steps × G samples: max |Δ log π| ≤ --logp-tol (default 1e-2).
    The log-probs are mean-reduced over the D latent dims with fp32 step math, so if bf16 moves the step's Gaussian
    mean by s of its std, Δ log π ≈ s²/2 + O(s/√D): 1e-2 allows s ≈ 0.14. Measured on the --small models (D = 1024):
    3% velocity error, s = 0.03–0.05, Δ = 1.8e-3–2.9e-3. Also reported: s, the relative velocity error, and the
    recorded rollout log-probs vs their recomputation on the same batch (asserted ≤ --parity-tol);
  * wall clock ≤ --budget-s (600 s; asserted on the real-size run only).

Results: a table on stdout and DIR/gpu_smoke.json (DIR = --out, default runs/gpu_smoke-<time>; the trainer's run
folders are DIR/runs/<family>-<objective>/, overwritten). Exit status 0 when every asserted check passes, 1 otherwise
(a family that crashes is a FAIL with its traceback in the JSON; the next family still runs), 2 on bad arguments.

Real-size cost (ESTIMATE, not measured: no GPU has been lent yet; docs/REAL_MODELS.md "First thing on a new GPU
box"): SD3.5-M ≈ 2.2B transformer parameters, 4.5 GB in bf16; FLUX.1-dev ≈ 11.9B, 24 GB (its folder is written once
and loaded once per objective: disk and host I/O dominate). The iterations are ≈ 290 SD3.5-M forward-equivalents
(≈ 6.6 TFLOP each at 512 px) and ≈ 120 FLUX.1 ones (≈ 38 TFLOP each), under a minute on an H100; with the folder
writes and loads the whole script is ≈ 3-5 minutes, inside the 10-minute budget. If it is not: --steps 4 or
--resolution 256 (documented there), or --families one at a time. Peak device memory by estimate ≈ 45 GB (SD3.5-M
grpo: micro-batch 8 pairs with CFG) and ≈ 55 GB (FLUX.1: the fp32 copy of the transformer in the log-prob check), so
a ≥ 80 GB card; the folder needs ≈ 25 GB of free disk under --work-dir (default: the system temp dir).

`--small` builds tiny configs of the same families (2-layer SD3.5-style MMDiT with dual attention and RMS qk-norm,
a 1+1-block FLUX with guidance embedding, 16 px, a one-block VAE) and runs the same code on CPU in seconds;
tests/scripts/test_gpu_smoke.py runs it.

Real configs, as in the hub repositories' transformer/config.json (stabilityai/stable-diffusion-3.5-medium and
black-forest-labs/FLUX.1-dev are gated; read from public copies of the same files, e.g. huggingface.co
Prgckwb/trpfrog-sd3.5-medium transformer/config.json, `_name_or_path` models--stabilityai--stable-diffusion-3.5-medium
snapshot b940f670, and markury/flux-fused-v19 transformer/config.json, models--black-forest-labs--FLUX.1-dev snapshot
0ef5fff; schedulers: frankjoshua/stable-diffusion-3.5-medium scheduler/scheduler_config.json, commit "SD3.5 Medium
Public Release" 94b13cc: shift 3.0, and reshamgaire/flux-dev-orignal scheduler/scheduler_config.json: dynamic shift
0.5–1.15; VAEs: the SD3 VAE of tests/models/tiny_diffusers.py, FLUX.1's scaling 0.3611 / shift 0.1159 as in the
FLUX.1-dev autoencoder parameters). The trainer uses its own time grid (sampler.grid / shift), not the scheduler's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

# ------------------------------------------------------------------------------------------------- the real configs

# stabilityai/stable-diffusion-3.5-medium transformer/config.json (SD3Transformer2DModel, ≈ 2.2B parameters)
SD35M_TRANSFORMER: dict[str, Any] = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm",
}
# black-forest-labs/FLUX.1-dev transformer/config.json (FluxTransformer2DModel, ≈ 11.9B parameters)
FLUX1_DEV_TRANSFORMER: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
# vae/config.json of both (AutoencoderKL, 16 latent channels, factor 8); they differ in scaling and shift only
SD3_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2,
    "latent_channels": 16, "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 1.5305,
    "shift_factor": 0.0609, "use_quant_conv": False, "use_post_quant_conv": False,
}
FLUX1_VAE: dict[str, Any] = {**SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
# scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler)
SD3_SCHEDULER: dict[str, Any] = {"shift": 3.0}
FLUX1_SCHEDULER: dict[str, Any] = {
    "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# --small: the same families at toy size (CPU, seconds); SD3.5's dual attention and qk-norm, FLUX's guidance embedding
SMALL_RESOLUTION = 16
SD35M_SMALL: dict[str, Any] = {
    "sample_size": SMALL_RESOLUTION, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
    "num_attention_heads": 4, "joint_attention_dim": 64, "caption_projection_dim": 32, "pooled_projection_dim": 64,
    "out_channels": 4, "dual_attention_layers": (0,), "qk_norm": "rms_norm",
}
FLUX1_SMALL: dict[str, Any] = {
    "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
    "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32, "guidance_embeds": True,
    "axes_dims_rope": (4, 6, 6),
}
SMALL_VAE: dict[str, Any] = {  # one block: no downsampling, latent 4 × 16 × 16
    "sample_size": SMALL_RESOLUTION, "in_channels": 3, "out_channels": 3, "block_out_channels": (4,),
    "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 1, "use_quant_conv": False,
    "use_post_quant_conv": False,
}

# family → (recipe of objective grpo, recipe of objective nft, the nft recipe's extra overrides)
FAMILIES: dict[str, dict[str, Any]] = {
    "sd35m": {"model": "sd3", "presets": {"grpo": ("sd35m_flow_grpo", []), "nft": ("sd35m_nft", [])}},
    "flux1": {
        "model": "flux",
        "presets": {
            "grpo": ("flux1dev_flow_grpo", []),
            # no FLUX.1 nft recipe: DiffusionNFT's setting on the FLUX recipe (CFG-free ODE rollout, KL 1e-4)
            "nft": ("flux1dev_flow_grpo", ["objective.name=nft", "sampler.name=ode", "optim.kl_beta=1e-4"]),
        },
    },
}
OBJECTIVES = ("grpo", "nft")

# the checks' limits (docstring)
RATIO_TOL = 1e-6  # on-policy ratio_mean is exp(0) = 1 exactly; 1e-6 only absorbs the mean's float rounding
PARITY_TOL = 1e-4  # = the recipes' clip range: beyond it an off-policy epoch would clip on numerics alone
LOGP_TOL = 1e-2  # nats of the mean-reduced log-prob: Δ ≈ s²/2 + O(s/√D) allows a mean shift s ≈ 0.14 std (docstring)
BUDGET_S = 600.0
MAX_CHECK_STEPS = 4

GB = 1e9

# ------------------------------------------------------------------------------------------ tokenizers (no files)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte → printable unicode table (the standard byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def clip_tokenizer(max_length: int):
    """Byte-level CLIP tokenizer without merges: 256 characters, their </w> forms and the two specials (514)."""
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[], model_max_length=max_length)


def t5_tokenizer(max_length: int):
    """Unigram T5 tokenizer over single characters (no sentencepiece model file needed)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"]
    pieces += [("▁" + c, -2.5) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


# ------------------------------------------------------------------------------------------------ model folders


def _clip(tok, hidden: int, projection: int | None, positions: int):
    """A narrow random CLIP text encoder: `hidden` = its hidden width (FLUX's pooled output), `projection` = the
    width of its projection (SD3's pooled halves), None for a plain CLIPTextModel."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    n = len(tok)
    cfg = CLIPTextConfig(
        bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1, hidden_size=hidden, intermediate_size=64,
        num_attention_heads=2, num_hidden_layers=2, vocab_size=n, hidden_act="gelu", layer_norm_eps=1e-5,
        projection_dim=projection or hidden, max_position_embeddings=positions,
    )
    return CLIPTextModelWithProjection(cfg) if projection else CLIPTextModel(cfg)


def _t5(tok, width: int):
    """A one-layer random T5 encoder of model width `width` (= the transformer's joint_attention_dim)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(
        d_model=width, d_ff=64, d_kv=32, num_heads=2, num_layers=1, vocab_size=len(tok), pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0,
    ))


def _transformer(cls, config: dict[str, Any], device: str):
    """`cls(**config)` built directly in bf16 on `device` (FLUX.1 in fp32 first would need 48 GB)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            net = cls(**config)
    finally:
        torch.set_default_dtype(prev)
    return net.to(torch.bfloat16).eval()


def _small_vae(real: dict[str, Any]) -> dict[str, Any]:
    return dict(SMALL_VAE, scaling_factor=real["scaling_factor"], shift_factor=real["shift_factor"])


def with_layers(config: dict[str, Any], layers: int | None) -> dict[str, Any]:
    """`config` with `layers` transformer blocks (FLUX: that many double and single blocks; SD3.5: dual attention
    kept on the first min(13, layers)); every width stays the real one. None: unchanged."""
    if not layers:
        return config
    cfg = dict(config, num_layers=layers)
    if "num_single_layers" in cfg:
        cfg["num_single_layers"] = layers
    if cfg.get("dual_attention_layers"):
        cfg["dual_attention_layers"] = tuple(i for i in cfg["dual_attention_layers"] if i < layers)
    return cfg


def build_model_folder(family: str, directory: Path, *, small: bool, device: str, seed: int = 0,
                       layers: int | None = None) -> dict[str, Any]:
    """Write a random-init `family` pipeline folder (the hub layout) to `directory`; return what was built.

    Real size: the transformer from its real config in bf16, the real VAE (fp32), narrow 2-layer CLIPs and a 1-layer
    T5 with the real OUTPUT widths (SD3: CLIP projections 768 + 1280 = pooled 2048, T5 width 4096, 77 + 256 tokens;
    FLUX.1: CLIP width 768 = pooled, T5 width 4096, 512 tokens). The adapters cache prompt embeddings, so narrow
    encoders change nothing per iteration; only the weights' total (and so absolute memory) is smaller than the real
    pipeline's (T5-XXL alone is ≈ 9.5 GB in bf16)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    torch.manual_seed(seed)
    t0 = time.perf_counter()
    clip_len = 16 if small else 77
    pipe: Any
    vae: Any
    if family == "sd35m":
        cfg = SD35M_SMALL if small else with_layers(SD35M_TRANSFORMER, layers)
        t5_len, widths = (16, (32, 32)) if small else (256, (768, 1280))
        tok, t5tok = clip_tokenizer(clip_len), t5_tokenizer(t5_len)
        with torch.device(device):
            transformer = _transformer(SD3Transformer2DModel, cfg, device)
            vae = AutoencoderKL(**(_small_vae(SD3_VAE) if small else SD3_VAE))
            te1 = _clip(tok, 32 if small else 64, widths[0], clip_len)
            te2 = _clip(tok, 32 if small else 64, widths[1], clip_len)
            te3 = _t5(t5tok, cfg["joint_attention_dim"])
        pipe = StableDiffusion3Pipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER), transformer=transformer, vae=vae,
            text_encoder=te1, tokenizer=tok, text_encoder_2=te2, tokenizer_2=tok, text_encoder_3=te3,
            tokenizer_3=t5tok,
        )
    elif family == "flux1":
        cfg = FLUX1_SMALL if small else with_layers(FLUX1_DEV_TRANSFORMER, layers)
        t5_len = 16 if small else 512
        tok, t5tok = clip_tokenizer(clip_len), t5_tokenizer(t5_len)
        with torch.device(device):
            transformer = _transformer(FluxTransformer2DModel, cfg, device)
            vae = AutoencoderKL(**(_small_vae(FLUX1_VAE) if small else FLUX1_VAE))
            te1 = _clip(tok, cfg["pooled_projection_dim"], None, clip_len)
            te2 = _t5(t5tok, cfg["joint_attention_dim"])
        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**FLUX1_SCHEDULER), transformer=transformer, vae=vae,
            text_encoder=te1, tokenizer=tok, text_encoder_2=te2, tokenizer_2=t5tok,
        )
    else:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    if small:  # as tests/models/tiny_diffusers.py: an output layer with O(1) velocities for the checks to see
        with torch.no_grad():
            for p in transformer.proj_out.parameters():
                p.normal_(0.0, 0.2)
    for m in (transformer, vae, pipe.text_encoder):
        m.eval()
    n_params = sum(p.numel() for p in transformer.parameters())
    t_build = time.perf_counter() - t0
    pipe.save_pretrained(str(directory))
    t_save = time.perf_counter() - t0 - t_build
    del pipe, transformer, vae
    _free(device)
    return {"transformer_config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
            "transformer_params": n_params, "build_s": t_build, "save_s": t_save,
            "folder_gb": _folder_bytes(directory) / GB}


def _folder_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- measuring


def _rss_bytes() -> int | None:
    """Resident set size of this process (Linux /proc/self/statm), None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class PeakMemory:
    """Peak memory of a block: CUDA `max_memory_allocated` (after `reset_peak_memory_stats`), else the process RSS
    sampled every 2 ms by a thread. `base` is the memory at entry, `peak` the maximum inside (bytes, or None)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.device = torch.device(device)
        self.base: int | None = None
        self.peak: int | None = None
        self.reserved: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            r = _rss_bytes()
            if r is not None and (self.peak is None or r > self.peak):
                self.peak = r

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = self.peak = _rss_bytes()
            if self.base is not None:
                self._thread = threading.Thread(target=self._sample, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.reserved = torch.cuda.max_memory_reserved(self.device)
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            r = _rss_bytes()
            if r is not None and self.peak is not None:
                self.peak = max(self.peak, r)


def _fingerprint(params: Sequence[torch.Tensor]) -> float:
    """Σ ‖p‖² in float64: changes when an optimizer step moved any trainable weight."""
    with torch.no_grad():
        return float(sum(p.detach().double().pow(2).sum().item() for p in params))


@contextlib.contextmanager
def fp32_compute(model) -> Iterator[None]:
    """The adapter's transformer in fp32 without autocast (TF32 off), restored afterwards bit for bit: its bf16
    weights become fp32 copies of the same values (bf16 → fp32 is exact), so only the arithmetic changes."""
    net = model.net
    saved_p = [(p, p.dtype) for p in net.parameters() if p.dtype != torch.float32]
    saved_b = [(m, k, b.dtype) for m in net.modules() for k, b in m._buffers.items()
               if b is not None and b.is_floating_point() and b.dtype != torch.float32]
    prev_dtype = model.compute_dtype
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        for p, _ in saved_p:
            p.data = p.data.float()
        for m, k, _ in saved_b:
            m._buffers[k] = m._buffers[k].float()
        model.compute_dtype = torch.float32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        for p, dt in saved_p:
            p.data = p.data.to(dt)
        for m, k, dt in saved_b:
            m._buffers[k] = m._buffers[k].to(dt)
        model.compute_dtype = prev_dtype
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _float_cond(cond):
    return None if cond is None else {k: v.float() if v.is_floating_point() else v for k, v in cond.items()}


def logp_precision_check(tr, max_steps: int = MAX_CHECK_STEPS) -> dict[str, Any]:
    """bf16 vs fp32 log-probs of the same steps on the same inputs (module docstring), after the update.

    A fresh rollout of the trainer (bf16 autocast, as trained) records x^(j) → x^(j+1) and log π; ≤ `max_steps` of its
    trained steps are scored again with the whole batch in bf16 autocast and in fp32."""
    from flowcredit.samplers.policy import policy_velocity
    from flowcredit.samplers.sde import sampler_step

    t0 = time.perf_counter()
    model, cfg = tr.model, tr.cfg
    model.eval()
    with torch.no_grad():
        ro = tr.rollout()
        traj = ro.traj
        steps = [j for j in range(traj.num_steps) if bool(traj.step_mask[j])]
        if len(steps) > max_steps:
            steps = [steps[round(i * (len(steps) - 1) / (max_steps - 1))] for i in range(max_steps)]
        B, w = traj.batch_size, cfg.sampler.guidance_scale

        def score(cond, uncond) -> list[tuple[torch.Tensor, Any]]:
            out = []
            for j in steps:
                x_t, x_next = traj.latents[:, j], traj.latents[:, j + 1]
                t, t_next = traj.timesteps[j].expand(B), traj.timesteps[j + 1].expand(B)
                v = policy_velocity(model, x_t, t, cond, uncond, w)
                out.append((v, sampler_step(tr.params, x_t, v, t, t_next, x_next=x_next)))
            return out

        bf16 = score(ro.cond, ro.uncond)
        with fp32_compute(model):
            fp32 = score(_float_cond(ro.cond), _float_cond(ro.uncond))
    lp16 = torch.stack([st.log_prob for _, st in bf16], 1)  # (B, steps)
    lp32 = torch.stack([st.log_prob for _, st in fp32], 1)
    recorded = traj.log_probs[:, steps]
    dv = math.sqrt(sum(float((a - b).pow(2).sum()) for (a, _), (b, _) in zip(bf16, fp32)))
    vn = math.sqrt(sum(float(b.pow(2).sum()) for b, _ in fp32))
    # how far bf16 moves the step's Gaussian mean, in units of its std: rms_d(Δmean)/std per (sample, step); the
    # per-dimension KL between the two step distributions is half its square
    shift = max(float(((a.mean - b.mean).flatten(1).pow(2).mean(1).sqrt() / b.std.clamp_min(1e-30)).max())
                for (_, a), (_, b) in zip(bf16, fp32))
    return {
        "steps": steps, "samples": B, "latent_dims": math.prod(model.latent_shape),
        "seconds": time.perf_counter() - t0,
        "max_abs_dlogp_bf16_vs_fp32": float((lp16 - lp32).abs().max()),
        "max_abs_dlogp_rollout_vs_recomputed": float((lp16 - recorded).abs().max()),
        "logp_fp32_range": [float(lp32.min()), float(lp32.max())],
        "max_mean_shift_in_std_bf16_vs_fp32": shift,
        "velocity_rel_err_bf16_vs_fp32": dv / max(vn, 1e-30),
        "velocity_rms_fp32": vn / math.sqrt(max(1, sum(b.numel() for b, _ in fp32))),
    }


# -------------------------------------------------------------------------------------------------- one run


def run_config(family: str, objective: str, model_dir: Path, run_dir: Path, args) -> Any:
    """The TrainConfig of one smoke iteration: the family's recipe + the smoke's overrides."""
    from flowcredit.config.load import load_config
    from flowcredit.config.resolve import PRESET_DIR
    from flowcredit.config.schema import TrainConfig

    preset, extra = FAMILIES[family]["presets"][objective]
    overrides = [
        f"model.path={model_dir}", "model.precision=bf16", f"model.options.resolution={args.resolution}",
        "data.train_prompts=shapes:train", "data.prompts_per_iter=1", f"data.group_size={args.group_size}",
        "reward.name=imagestats", "reward.options={stat: brightness}", "run.iterations=1", "run.grid_every=0",
        "run.checkpoint_every=0", "run.eval_at_end=false", "run.eval_every=0", "run.budget_minutes=0",
        "run.loggers=[]", f"run.device={args.device}", f"run.out_dir={run_dir}", *extra,
    ]
    if args.steps:
        overrides.append(f"sampler.num_steps={args.steps}")
    if args.micro_batch:
        overrides.append(f"optim.micro_batch={args.micro_batch}")
    if args.small:
        overrides.append("run.threads=1")
    overrides += list(args.override)
    return load_config(TrainConfig, preset, overrides, preset_dirs=[PRESET_DIR]), preset, overrides


def run_objective(family: str, objective: str, model_dir: Path, out: Path, args) -> dict[str, Any]:
    """Setup + one `train_step` of Trainer; the prediction, the measurements and (grpo) the log-prob check."""
    from flowcredit.trainer.loop import Trainer
    from flowcredit.trainer.preflight import DEFAULT_MARGIN, estimate_memory

    run_dir = out / "runs" / f"{family}-{objective}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg, preset, overrides = run_config(family, objective, model_dir, run_dir, args)
    tr = Trainer(cfg, preset_name=f"gpu_smoke-{family}-{objective}")
    t0 = time.perf_counter()
    tr.setup()
    setup_s = time.perf_counter() - t0
    try:
        est = estimate_memory(cfg, tr.model, tr.device, tr.dist.world_size, reference_loaded=tr.ref_model is not None)
        before = _fingerprint(tr.trainable)
        with PeakMemory(str(tr.device)) as mem:
            t1 = time.perf_counter()
            stats = tr.train_step().metrics()
            step_s = time.perf_counter() - t1
        tr.iteration += 1
        tr.log(stats)  # the run folder's metrics.jsonl, as `flowcredit train` writes it
        after = _fingerprint(tr.trainable)
        keys = ("loss", "grad_norm", "pairs_trained", "pairs_planned", "skipped_update", "ratio_mean",
                "parity_max_abs_dlogp", "clipfrac", "approx_kl", "kl", "nft_r", "fm_mse", "old_deviate", "reward_mean",
                "nfe_rollout", "nfe_update")
        res: dict[str, Any] = {
            "preset": preset, "overrides": overrides, "run_dir": str(run_dir), "setup_s": setup_s, "step_s": step_s,
            "seconds": dict(stats["seconds"]), "seconds_total": stats["seconds_total"],
            "stats": {k: _plain(stats[k]) for k in keys if k in stats},
            "trainable_params": sum(p.numel() for p in tr.trainable),
            "latent_shape": list(tr.model.latent_shape), "num_steps": cfg.sampler.num_steps,
            "guidance_scale": cfg.sampler.guidance_scale, "micro_batch": cfg.optim.micro_batch,
            "lora": [cfg.model.lora_rank, cfg.model.lora_alpha],
            "gradient_checkpointing": cfg.model.gradient_checkpointing,
            "weights_fingerprint": [before, after],
            "memory": {
                "kind": "cuda max_memory_allocated" if mem.cuda else "process RSS (sampled)",
                "margin": DEFAULT_MARGIN,
                "predicted_weights_gb": est.weights / GB,
                "predicted_added_gb": est.needed / GB,
                "predicted_peak_gb": (est.weights + est.needed) / GB,
                "predicted_parts_gb": {k: getattr(est, k) / GB for k in ("grads", "adam", "copies", "rollout",
                                                                       "activations")},
                "predicted_micro_batch": est.micro_batch, "predicted_per_pair_mb": est.per_pair / 1e6,
                "measured_base_gb": None if mem.base is None else mem.base / GB,
                "measured_peak_gb": None if mem.peak is None else mem.peak / GB,
                "measured_added_gb": None if mem.peak is None or mem.base is None else (mem.peak - mem.base) / GB,
                "measured_reserved_gb": None if mem.reserved is None else mem.reserved / GB,
            },
        }
        if objective == "grpo" and not args.no_logp_check:
            _free(args.device)
            res["logp_check"] = logp_precision_check(tr)
        return res
    finally:
        tr.close()
        del tr
        _free(args.device)


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


# ------------------------------------------------------------------------------------------------------ checks


def _check(name: str, ok: bool, value: Any, limit: str, asserted: bool = True) -> dict[str, Any]:
    return {"name": name, "status": ("PASS" if ok else "FAIL") if asserted else "INFO", "value": value, "limit": limit}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def evaluate_run(family: str, objective: str, r: dict[str, Any], *, cuda: bool, parity_tol: float = PARITY_TOL,
                 logp_tol: float = LOGP_TOL) -> list[dict[str, Any]]:
    """The checks of one (family, objective) result of `run_objective`."""
    p, s = f"{family}/{objective}", r["stats"]
    out = []
    gn = s.get("grad_norm")
    ok = (s.get("pairs_trained", 0) > 0 and _finite(gn) and gn > 0 and not s.get("skipped_update")
          and _finite(s.get("loss")))
    shown = {k: s.get(k) for k in ("pairs_trained", "grad_norm", "loss", "skipped_update")}
    out.append(_check(f"{p}/update", ok, shown, "pairs_trained > 0, finite grad_norm > 0, finite loss, no skip"))
    before, after = r["weights_fingerprint"]
    out.append(_check(f"{p}/weights_changed", before != after, after - before, "Σ‖θ_trainable‖² changed"))
    if objective == "grpo":
        ratio = s.get("ratio_mean")
        out.append(_check(f"{p}/on_policy_ratio", _finite(ratio) and abs(ratio - 1.0) <= RATIO_TOL, ratio,
                          f"ratio_mean == 1 (±{RATIO_TOL:g})"))
        par = s.get("parity_max_abs_dlogp")
        out.append(_check(f"{p}/logp_parity", _finite(par) and par <= parity_tol, par,
                          f"parity_max_abs_dlogp ≤ {parity_tol:g} (rollout vs the update's recomputation)"))
    else:
        dev = s.get("old_deviate")
        out.append(_check(f"{p}/on_policy", _finite(dev) and dev == 0.0, dev, "old_deviate == 0 (v_old = sg(v_θ))"))
    m = r["memory"]
    meas, pred = m["measured_peak_gb"], m["predicted_peak_gb"]
    ok = meas is not None and meas <= pred * m["margin"]
    lim = f"measured peak ≤ predicted × {m['margin']:g}" + ("" if cuda else " (CPU RSS: reported, not asserted)")
    out.append(_check(f"{p}/memory", ok, {"predicted_peak_gb": pred, "measured_peak_gb": meas,
                                          "predicted_added_gb": m["predicted_added_gb"],
                                          "measured_added_gb": m["measured_added_gb"]}, lim, asserted=cuda))
    lc = r.get("logp_check")
    if lc is not None:
        d = lc["max_abs_dlogp_bf16_vs_fp32"]
        out.append(_check(f"{family}/logp_bf16_vs_fp32", _finite(d) and d <= logp_tol, d,
                          f"max |log π_bf16 − log π_fp32| ≤ {logp_tol:g} over steps {lc['steps']} × {lc['samples']}"))
        d = lc["max_abs_dlogp_rollout_vs_recomputed"]
        out.append(_check(f"{family}/logp_rollout_recomputed", _finite(d) and d <= parity_tol, d,
                          f"recorded rollout log π vs recomputed on the same batch ≤ {parity_tol:g}"))
        out.append(_check(f"{family}/velocity_bf16_vs_fp32", True,
                          {"rel_err": lc["velocity_rel_err_bf16_vs_fp32"],
                           "mean_shift_std": lc["max_mean_shift_in_std_bf16_vs_fp32"]},
                          "‖v_bf16 − v_fp32‖ / ‖v_fp32‖ and the step mean's shift in stds (reported)", asserted=False))
    return out


def exit_code(checks: Sequence[dict[str, Any]]) -> int:
    """0 when no check FAILed, else 1."""
    return 1 if any(c["status"] == "FAIL" for c in checks) else 0


# -------------------------------------------------------------------------------------------------------- main


def _environment(device: str) -> dict[str, Any]:
    import diffusers

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "diffusers": diffusers.__version__, "host": platform.node(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu=props.name, gpu_memory_gb=props.total_memory / GB, cuda=torch.version.cuda)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny configs (CPU, seconds): the test suite's version")
    ap.add_argument("--device", default=None, help="cuda (default when available) | cpu | cuda:N")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    ap.add_argument("--out", default=None, help="results folder (default runs/gpu_smoke-<time>)")
    ap.add_argument("--work-dir", default=None, help="where the model folders are written (default: system temp)")
    ap.add_argument("--keep-models", action="store_true", help="keep the model folders (under --work-dir)")
    ap.add_argument("--resolution", type=int, default=None, help="image side in px (default 512; --small 16)")
    ap.add_argument("--steps", type=int, default=None, help="sampler.num_steps (default: the recipe's, 10 / 6)")
    ap.add_argument("--group-size", type=int, default=2, help="data.group_size G (1 prompt per iteration)")
    ap.add_argument("--layers", type=int, default=None,
                    help="real widths, N transformer blocks (a quick dry run, not the real size's checks)")
    ap.add_argument("--micro-batch", type=int, default=None, help="optim.micro_batch (default: the recipe's)")
    ap.add_argument("--parity-tol", type=float, default=PARITY_TOL)
    ap.add_argument("--logp-tol", type=float, default=LOGP_TOL, help="bf16-vs-fp32 max |Δ log π|")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall-clock budget (asserted at real size)")
    ap.add_argument("--no-logp-check", action="store_true", help="skip the bf16-vs-fp32 log-prob check")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="one more trainer config override (repeatable), e.g. model.gradient_checkpointing=true")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.small or not torch.cuda.is_available() else "cuda"
    if args.resolution is None:
        args.resolution = SMALL_RESOLUTION if args.small else 512
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.small and args.layers:
        print("error: --layers sets the depth of the real-width configs; --small has its own", file=sys.stderr)
        return 2
    if not args.small and not args.layers and not args.device.startswith("cuda"):
        print(f"error: the real-size smoke needs a CUDA device (got --device {args.device}); use --small on CPU "
              "(or --layers N for a shallow dry run of the real widths)", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()

    t_start = time.perf_counter()
    out = Path(args.out or f"runs/gpu_smoke-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="flowcredit-gpu-smoke-", dir=args.work_dir))
    cuda = args.device.startswith("cuda")
    report: dict[str, Any] = {
        "script": "scripts/gpu_smoke.py",
        "mode": "small" if args.small else ("real-size" if not args.layers else f"real widths, {args.layers} layers"),
        "argv": list(argv) if argv is not None else sys.argv[1:], "environment": _environment(args.device),
        "settings": {"resolution": args.resolution, "group_size": args.group_size, "prompts_per_iter": 1,
                     "steps": args.steps or "recipe", "parity_tol": args.parity_tol, "logp_tol": args.logp_tol,
                     "budget_s": args.budget_s},
        "families": {},
    }
    checks: list[dict[str, Any]] = []
    try:
        for fam in args.families:
            fam_res: dict[str, Any] = {"runs": {}}
            report["families"][fam] = fam_res
            model_dir = work / fam
            try:
                print(f"[{fam}] building the model folder ...", flush=True)
                fam_res["folder"] = build_model_folder(fam, model_dir, small=args.small, device=args.device,
                                                       layers=args.layers)
                fam_res["folder"]["path"] = str(model_dir)
                for obj in args.objectives:
                    print(f"[{fam}] one iteration of objective {obj} ...", flush=True)
                    r = run_objective(fam, obj, model_dir, out, args)
                    fam_res["runs"][obj] = r
                    checks += evaluate_run(fam, obj, r, cuda=cuda, parity_tol=args.parity_tol,
                                           logp_tol=args.logp_tol)
            except Exception as e:  # noqa: BLE001  a crash is a FAIL of that family; the next one still runs
                fam_res["error"] = traceback.format_exc()
                checks.append(_check(f"{fam}/error", False, f"{type(e).__name__}: {e}", "no exception"))
                print(fam_res["error"], file=sys.stderr)
            finally:
                if not args.keep_models:
                    shutil.rmtree(model_dir, ignore_errors=True)
                _free(args.device)
    finally:
        if not args.keep_models:
            shutil.rmtree(work, ignore_errors=True)
    wall = time.perf_counter() - t_start
    real = not args.small and not args.layers
    checks.append(_check("wall_clock", wall <= args.budget_s, wall, f"≤ {args.budget_s:g} s"
                         + ("" if real else " (asserted at real size only)"), asserted=real))
    code = exit_code(checks)
    report.update(wall_clock_s=wall, checks=checks, passed=code == 0, exit_code=code)
    (out / "gpu_smoke.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print_summary(report)
    print(f"{'PASSED' if code == 0 else 'FAILED'}: {out / 'gpu_smoke.json'}", flush=True)
    return code


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def print_summary(report: dict[str, Any]) -> None:
    env = report["environment"]
    print(f"\ngpu_smoke ({report['mode']}) on {env.get('gpu') or env.get('cpu')}, torch {env['torch']}, "
          f"diffusers {env['diffusers']}")
    for fam, fr in report["families"].items():
        f = fr.get("folder", {})
        if f:
            print(f"{fam}: transformer {f['transformer_params'] / 1e9:.2f}B params, folder {f['folder_gb']:.1f} GB "
                  f"(build {f['build_s']:.1f} s, save {f['save_s']:.1f} s)")
        for obj, r in fr["runs"].items():
            m = r["memory"]
            sec = "  ".join(f"{k} {v:.2f}" for k, v in r["seconds"].items())
            meas = "?" if m["measured_peak_gb"] is None else f"{m['measured_peak_gb']:.2f}"
            print(f"  {obj:<4} setup {r['setup_s']:.1f} s | iteration {r['seconds_total']:.2f} s: {sec} | "
                  f"peak GB predicted {m['predicted_peak_gb']:.2f} measured {meas} ({m['kind']})")
    for c in report["checks"]:
        print(f"{c['status']:<4} {c['name']:<34} {_fmt(c['value'])}   [{c['limit']}]")
    print(f"wall clock {report['wall_clock_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
