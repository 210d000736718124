"""Tiny SD3 and FLUX.1 pipelines built from config, offline, saved as local diffusers folders (test fixtures).

Nothing is downloaded: tokenizers come from in-memory byte-level vocabularies (../shared/docs/ENVIRONMENT.md §2),
every network is built from a config with a fixed seed and put in eval mode (T5 has dropout 0.1 by default).
The folders have the exact layout of the hub repositories (model_index.json, transformer/, vae/, text_encoder/, ...),
so `StableDiffusion3Pipeline.from_pretrained(dir)` and flowcredit's adapters load the same weights.

Sizes (chosen for CPU test speed): 16×16 images, a one-block VAE (no downsampling, latent 4×16×16), 2-layer text
encoders of width 32, CLIP sequences of 16 tokens, T5 sequences of MAX_SEQ tokens.

Also defines `BrightnessReward`, a reward usable as `reward.name=tiny_diffusers:BrightnessReward`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

RESOLUTION = 16
MAX_SEQ = 16  # T5 tokens (the pipelines' max_sequence_length for these tiny models)
CLIP_LEN = 16


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte → printable unicode table (the standard byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def clip_tokenizer():
    """Byte-level CLIP tokenizer without merges: 256 characters, their </w> forms and the two specials (514)."""
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[], model_max_length=CLIP_LEN)


def t5_tokenizer():
    """Unigram T5 tokenizer over single characters (no sentencepiece model file needed)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"]
    pieces += [("▁" + c, -2.5) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_SEQ)


def _clip_config(tok, with_projection: bool):
    from transformers import CLIPTextConfig

    n = len(tok)
    return CLIPTextConfig(
        bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1, hidden_size=32, intermediate_size=37,
        layer_norm_eps=1e-5, num_attention_heads=4, num_hidden_layers=2, vocab_size=n, hidden_act="gelu",
        projection_dim=32, max_position_embeddings=CLIP_LEN,
    )


def _t5(tok):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(d_model=32, d_ff=37, d_kv=8, num_heads=4, num_layers=2, vocab_size=len(tok), pad_token_id=0,
                 eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0)
    )


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        sample_size=RESOLUTION, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )


def build_sd3_pipeline(seed: int = 0):
    """A StableDiffusion3Pipeline of tiny random components (all in eval mode)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tok, t5tok = clip_tokenizer(), t5_tokenizer()
    transformer = SD3Transformer2DModel(
        sample_size=RESOLUTION, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64, out_channels=4,
    )
    # Zero-initialised output layers would make every velocity 0 and every test trivial: perturb them.
    with torch.no_grad():
        for p in transformer.proj_out.parameters():
            p.normal_(0.0, 0.2)
        for blk in transformer.transformer_blocks:
            for p in blk.norm1.linear.parameters():
                p.normal_(0.0, 0.05)
    te1 = CLIPTextModelWithProjection(_clip_config(tok, True))
    te2 = CLIPTextModelWithProjection(_clip_config(tok, True))
    te3 = _t5(t5tok)
    vae = _vae()
    for m in (transformer, te1, te2, te3, vae):
        m.eval()
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer, vae=vae, text_encoder=te1,
        tokenizer=tok, text_encoder_2=te2, tokenizer_2=tok, text_encoder_3=te3, tokenizer_3=t5tok,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_flux_pipeline(seed: int = 0, guidance_embeds: bool = True):
    """A FluxPipeline of tiny random components (FLUX.1-dev layout: guidance embedding, dynamic shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    torch.manual_seed(seed)
    tok, t5tok = clip_tokenizer(), t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
    )
    with torch.no_grad():
        for p in transformer.proj_out.parameters():
            p.normal_(0.0, 0.2)
    te1 = CLIPTextModel(_clip_config(tok, False))
    te2 = _t5(t5tok)
    vae = _vae()
    for m in (transformer, te1, te2, vae):
        m.eval()
    # FLUX.1-dev's scheduler config: resolution-dependent ("dynamic") shift.
    sched = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipe = FluxPipeline(
        scheduler=sched, transformer=transformer, vae=vae, text_encoder=te1, tokenizer=tok, text_encoder_2=te2,
        tokenizer_2=t5tok,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny(kind: str, directory: str | Path, seed: int = 0) -> Path:
    """Build the tiny `kind` ("sd3" | "flux") pipeline and save it as a diffusers folder. Returns the folder."""
    d = Path(directory)
    pipe = build_sd3_pipeline(seed) if kind == "sd3" else build_flux_pipeline(seed)
    pipe.save_pretrained(str(d))
    return d


def load_pipeline(kind: str, directory: str | Path):
    """Load a saved tiny folder with the stock diffusers pipeline class (what a user deploys)."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    cls = StableDiffusion3Pipeline if kind == "sd3" else FluxPipeline
    pipe = cls.from_pretrained(str(directory), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def quiet() -> None:
    """Silence the libraries' truncation warnings and progress bars (tiny tokenizers truncate every prompt)."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


_DIRS: dict[str, Path] = {}


def tiny_model_dir(kind: str) -> Path:
    """The tiny `kind` folder, built once per test process in a temporary directory (removed at exit)."""
    if kind not in _DIRS:
        quiet()
        root = Path(tempfile.mkdtemp(prefix=f"flowcredit-tiny-{kind}-"))
        atexit.register(shutil.rmtree, root, True)
        _DIRS[kind] = save_tiny(kind, root / kind)
    return _DIRS[kind]


def load_adapter(kind: str, precision: str = "fp32", trainable: str = "all", **kw):
    """flowcredit's adapter for the tiny `kind` folder (fp32 by default: parity tests compare bit for bit)."""
    from flowcredit.config.schema import ModelCfg

    cfg = ModelCfg(name=kind, precision=precision, trainable=trainable, lora_rank=kw.pop("lora_rank", 4),
                   lora_alpha=kw.pop("lora_alpha", 8.0), gradient_checkpointing=kw.pop("gradient_checkpointing", False))
    if kind == "sd3":
        from flowcredit.models.sd3 import SD3FlowModel

        model = SD3FlowModel.from_pretrained(tiny_model_dir(kind), cfg, **kw)
    else:
        from flowcredit.models.flux import FluxFlowModel

        model = FluxFlowModel.from_pretrained(tiny_model_dir(kind), cfg, resolution=RESOLUTION, **kw)
    if trainable:
        model.configure_trainable(trainable)
    return model


def train_config(kind: str, method: str, out_dir: str | Path, *overrides: str):
    """A TrainConfig running `method` on the tiny `kind` model with LoRA (r4, α8): 1 prompt × G=2, T=3, CPU."""
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    args = [
        f"method={method}", f"model.name={kind}", f"model.path={tiny_model_dir(kind)}", "model.precision=fp32",
        "model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8", "sampler.num_steps=3",
        f"sampler.guidance_scale={4.5 if kind == 'sd3' else 1.0}", "data.prompts_per_iter=1", "data.group_size=2",
        "reward.name=tiny_diffusers:BrightnessReward", "run.eval_at_end=false", "run.iterations=2", "run.grid_every=0",
        "run.checkpoint_every=100", "estimate.substeps=2", "optim.kl_beta=0.04", "optim.lr=1e-2", "run.threads=1",
        f"run.out_dir={out_dir}", *overrides,
    ]
    cfg = load_config(TrainConfig, None, args)
    cfg.model.options = {"resolution": RESOLUTION}  # the diffusers families' option (FLUX would default to 128 px)
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# GPU benchmark: an SD3.5-Medium-sized random-init transformer (issue F "Must show", run only where a GPU is lent)
# ---------------------------------------------------------------------------------------------------------------

# stabilityai/stable-diffusion-3.5-medium transformer/config.json (≈ 2.5B parameters)
SD35M_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
# the SD3 VAE (16 latent channels, factor 8)
SD3_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, norm_num_groups=32,
    sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)


def save_sd35m_sized(directory: str | Path, device: str = "cuda", seed: int = 0) -> Path:
    """A random-init SD3.5-M-sized pipeline folder: the real transformer and VAE sizes, narrow text encoders with the
    real OUTPUT widths (CLIP projections 768 + 1280 = 2048 pooled, T5 width 4096, 77 + 256 text tokens). Text encoding
    is cached by the adapter, so narrow encoders do not change the per-iteration cost. Transformer saved in bf16."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel, T5Tokenizer

    torch.manual_seed(seed)
    tok = clip_tokenizer()
    tok.model_max_length = 77
    t5tok = t5_tokenizer()
    t5tok.model_max_length = 256
    with torch.device(device):
        transformer = SD3Transformer2DModel(**SD35M_TRANSFORMER).to(torch.bfloat16)
        vae = AutoencoderKL(**SD3_VAE)
        encs = []
        for proj in (768, 1280):
            n = len(tok)
            encs.append(CLIPTextModelWithProjection(CLIPTextConfig(
                bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=n - 1, hidden_size=64, intermediate_size=64,
                num_attention_heads=2, num_hidden_layers=2, vocab_size=n, projection_dim=proj, max_position_embeddings=77)))
        t5 = T5EncoderModel(T5Config(d_model=4096, d_ff=64, d_kv=32, num_heads=2, num_layers=1, vocab_size=len(t5tok),
                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0))
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer, vae=vae, text_encoder=encs[0],
        tokenizer=tok, text_encoder_2=encs[1], tokenizer_2=tok, text_encoder_3=t5, tokenizer_3=t5tok,
    )
    pipe.save_pretrained(str(directory))
    return Path(directory)


def benchmark(model_dir: str | Path, out_dir: str | Path, *, device: str = "cuda", methods=("flow_grpo", "stepwise", "vgpo"),
              resolution: int = 512, group_size: int = 8, num_steps: int = 10, iterations: int = 2,
              overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Time Trainer iterations of each method on an SD3 folder (LoRA r32/α64, bf16, CFG 4.5, T=10, G=8).

    Returns one dict per method with the LAST iteration's seconds per phase, s/iteration and peak GPU memory (GiB).
    """
    import json as _json

    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig
    from flowcredit.trainer.loop import Trainer

    rows = []
    for method in methods:
        args = [
            f"method={method}", "model.name=sd3", f"model.path={model_dir}", "model.precision=bf16",
            "model.trainable=lora", "model.lora_rank=32", "model.lora_alpha=64", f"sampler.num_steps={num_steps}",
            "sampler.grid=diffusers", "sampler.guidance_scale=4.5", "data.prompts_per_iter=1",
            f"data.group_size={group_size}", "reward.name=tiny_diffusers:BrightnessReward", "run.eval_at_end=false",
            f"run.iterations={iterations}", "run.grid_every=0", "run.checkpoint_every=1000000", "optim.kl_beta=0.04",
            "optim.micro_batch=8", "estimate.chunk_size=32", f"run.device={device}", f"run.out_dir={Path(out_dir) / method}",
            *overrides,
        ]
        cfg = load_config(TrainConfig, None, args)
        cfg.model.options = {"resolution": resolution}
        tr = Trainer(cfg)
        tr.setup()
        cuda = device.startswith("cuda") and torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tr.train()
        if cuda:
            torch.cuda.synchronize()
        rec = [_json.loads(x) for x in (Path(out_dir) / method / "metrics.jsonl").read_text().splitlines()][-1]
        rows.append({
            "method": method, "s_per_iteration": rec["seconds_total"], "seconds": rec["seconds"],
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "pairs_trained": rec["pairs_trained"], "nfe_rollout": rec["nfe_rollout"],
            "nfe_estimates": rec.get("nfe_estimates", 0), "latent_shape": list(tr.model.latent_shape),
        })
        del tr
        if cuda:
            torch.cuda.empty_cache()
    return rows


class BrightnessReward:
    """Mean image brightness in [0, 1] (non-negative, as VGPO needs). A stand-in for PickScore in tests."""

    name = "brightness"

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any):
        from flowcredit.rewards.base import RewardOutput

        return RewardOutput(scores=images.float().mean(dim=(1, 2, 3)))
