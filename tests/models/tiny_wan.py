"""Tiny Wan pipelines built from config, offline, saved as local diffusers folders (test fixtures for test_wan.py).

Nothing is downloaded: the tokenizer is tiny_diffusers' in-memory unigram T5 tokenizer (UMT5 uses a T5 tokenizer),
every network is built from a config with a fixed seed and put in eval mode. The folders have the layout of the hub
repositories (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/), so
`WanPipeline.from_pretrained(dir)` and flowcredit's adapter load the same weights.

Two layouts:
  * "wan21": Wan 2.1 T2V (AutoencoderKLWan with the real factors: temporal 4, spatial 8; z_dim 4), and the hub's
    scheduler, `UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0)`, which the adapter replaces by the
    Euler flow-matching scheduler of the same shift;
  * "wan22_5b": Wan 2.2 TI2V-5B (the residual VAE with 2×2 patching: spatial 16; `expand_timesteps=True`: per-token
    timesteps), with a FlowMatchEulerDiscreteScheduler(shift=5.0).

Sizes (CPU test speed): clips of NUM_FRAMES=5 frames (2 latent frames) of HEIGHT×WIDTH = 32×48 px (non-square,
so a height/width mix-up fails), a 2-layer transformer of width 24, a 2-layer UMT5 of width 32, MAX_SEQ text tokens.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_diffusers as td  # offline environment variables, tokenizer, quiet, BrightnessReward

HEIGHT, WIDTH, NUM_FRAMES = 32, 48, 5
WIDTH_5B = 64  # TI2V-5B: the width must be a multiple of 32 (VAE factor 16 × patch 2)
MAX_SEQ = td.MAX_SEQ
LAYOUTS = ("wan21", "wan22_5b")


def _umt5(tok):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(
        UMT5Config(d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2, vocab_size=len(tok), pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0)
    )


def build_wan_pipeline(layout: str = "wan21", seed: int = 0):
    """A WanPipeline of tiny random components (all in eval mode)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    torch.manual_seed(seed)
    tok = td.t5_tokenizer()
    z = 4
    mean, std = [0.1, -0.2, 0.3, 0.0], [1.5, 0.8, 2.0, 1.2]
    if layout == "wan21":
        vae = AutoencoderKLWan(base_dim=4, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std)
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
        extra = {}
    elif layout == "wan22_5b":
        vae = AutoencoderKLWan(base_dim=4, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                               out_channels=12, patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
                               latents_mean=mean, latents_std=std)
        sched = FlowMatchEulerDiscreteScheduler(shift=5.0)
        extra = {"expand_timesteps": True}
    else:
        raise ValueError(f"layout {layout!r}; valid: {LAYOUTS}")
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z, out_channels=z, text_dim=32,
        freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    # A zero-initialised output projection would make every velocity 0 and every test trivial: perturb it.
    with torch.no_grad():
        for p in transformer.proj_out.parameters():
            p.normal_(0.0, 0.2)
    te = _umt5(tok)
    for m in (transformer, te, vae):
        m.eval()
    pipe = WanPipeline(tokenizer=tok, text_encoder=te, vae=vae, scheduler=sched, transformer=transformer, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


_DIRS: dict[str, Path] = {}


def tiny_model_dir(layout: str = "wan21") -> Path:
    """The tiny `layout` folder, built once per test process in a temporary directory (removed at exit)."""
    if layout not in _DIRS:
        td.quiet()
        root = Path(tempfile.mkdtemp(prefix=f"flowcredit-tiny-{layout}-"))
        atexit.register(shutil.rmtree, root, True)
        build_wan_pipeline(layout).save_pretrained(str(root / layout))
        _DIRS[layout] = root / layout
    return _DIRS[layout]


def load_pipeline(layout: str = "wan21", model=None):
    """The stock WanPipeline of a tiny folder (what a user deploys); with `model`, its Euler scheduler set."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(tiny_model_dir(layout)), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if model is not None:
        pipe.scheduler = model.euler_scheduler()
    return pipe


def load_adapter(layout: str = "wan21", precision: str = "fp32", trainable: str = "all", **kw):
    """flowcredit's adapter for the tiny `layout` folder at the tiny clip size (fp32 by default)."""
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.wan import WanFlowModel

    cfg = ModelCfg(name="wan", precision=precision, trainable=trainable, lora_rank=kw.pop("lora_rank", 4),
                   lora_alpha=kw.pop("lora_alpha", 8.0),
                   gradient_checkpointing=kw.pop("gradient_checkpointing", False))
    size = {"height": HEIGHT, "width": WIDTH if layout == "wan21" else WIDTH_5B, "num_frames": NUM_FRAMES}
    model = WanFlowModel.from_pretrained(tiny_model_dir(layout), cfg, **{**size, **kw})
    if trainable:
        model.configure_trainable(trainable)
    return model


def train_config(method: str, out_dir: str | Path, *overrides: str, layout: str = "wan21"):
    """A TrainConfig running `method` on the tiny Wan model with LoRA (r4, α8): 1 prompt × G=2, T=3, CPU, scored
    frame by frame by tiny_diffusers' BrightnessReward through FrameMeanReward."""
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    args = [
        f"method={method}", "model.name=wan", f"model.path={tiny_model_dir(layout)}", "model.precision=fp32",
        "model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8", "sampler.num_steps=3",
        "sampler.grid=diffusers", f"sampler.shift={3.0 if layout == 'wan21' else 5.0}", "sampler.guidance_scale=4.5",
        "data.prompts_per_iter=1", "data.group_size=2", "reward.name=flowcredit.models.wan:FrameMeanReward",
        "run.eval_at_end=false", "run.iterations=2", "run.grid_every=0", "run.checkpoint_every=100",
        "estimate.substeps=2", "optim.kl_beta=0.04", "optim.lr=1e-2", "run.threads=1", f"run.out_dir={out_dir}",
        *overrides,
    ]
    cfg = load_config(TrainConfig, None, args)
    cfg.reward.options = {"reward": "tiny_diffusers:BrightnessReward", "frame_stride": 2}
    cfg.model.options = {"height": HEIGHT, "width": WIDTH, "num_frames": NUM_FRAMES, "max_sequence_length": MAX_SEQ}
    return cfg
