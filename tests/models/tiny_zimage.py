"""A tiny Z-Image pipeline built from config, offline, saved as a local diffusers folder (test fixture).

Nothing is downloaded. The Qwen2 tokenizer is an in-memory byte-level BPE without merges (the 256 byte characters,
`<|endoftext|>` and the two chat tokens `<|im_start|>` / `<|im_end|>`) with a ChatML chat template of Qwen3's shape
(`ZImagePipeline._encode_prompt` calls `apply_chat_template(..., add_generation_prompt=True, enable_thinking=True)`).
Every network is built from a config with a fixed seed and put in eval mode. The folder has the layout of
Tongyi-MAI/Z-Image (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/), so
`ZImagePipeline.from_pretrained(dir)` and flowcredit's adapter load the same weights.

Sizes (CPU test speed): 16×16 images; a two-block VAE (factor 2, 16 latent channels, the FLUX VAE's scaling 0.3611
and shift 0.1159) → latents 16×8×8 → 16 image tokens (padded by the transformer to 32); a 2-layer Qwen3 encoder of
width 32; a ZImageTransformer2DModel of width 32 (2 heads of 16 = RoPE axes 4 + 6 + 6), 2 main layers and 1 noise /
1 context refiner; prompts of MAX_SEQ tokens at most (the chat template alone is 19 tokens, so prompt lengths on
both sides of the transformer's 32-token padding exercise its attention masks). The scheduler is Z-Image's (static
shift 6.0, `use_dynamic_shifting: false`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_diffusers as td  # the byte alphabet, quiet(), BrightnessReward

KIND = "zimage"
RESOLUTION = 16
MAX_SEQ = 48  # Qwen tokens (the pipeline's max_sequence_length for this tiny model)
SHIFT = 6.0  # Tongyi-MAI/Z-Image scheduler_config.json (Z-Image-Turbo: 3.0)

# A ChatML template of the shape of Qwen3's: the generation prompt adds the empty think block only when
# enable_thinking is false (ZImagePipeline passes enable_thinking=True, so it is not added).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def qwen_tokenizer():
    """Byte-level Qwen2 tokenizer without merges: 256 byte characters + <|endoftext|> (pad) + the two chat tokens."""
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(td._bytes_to_unicode().values())}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=MAX_SEQ)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _qwen3(tok):
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=2 * MAX_SEQ, rms_norm_eps=1e-6,
        tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
    ))


def _vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        sample_size=RESOLUTION, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1, latent_channels=16,
        norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
        shift_factor=0.1159,
    )


def build_zimage_pipeline(seed: int = 0):
    """A ZImagePipeline of tiny random components (all in eval mode)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    torch.manual_seed(seed)
    tok = qwen_tokenizer()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[4, 6, 6], axes_lens=[128, 32, 32],
    )
    with torch.no_grad():  # the pad tokens start at zero: give them values so that the padding path is visible
        transformer.x_pad_token.normal_(0.0, 0.5)
        transformer.cap_pad_token.normal_(0.0, 0.5)
    text_encoder = _qwen3(tok)
    vae = _vae()
    for m in (transformer, text_encoder, vae):
        m.eval()
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=sched, vae=vae, text_encoder=text_encoder, tokenizer=tok, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_zimage(directory: str | Path, seed: int = 0) -> Path:
    d = Path(directory)
    build_zimage_pipeline(seed).save_pretrained(str(d))
    return d


def load_pipeline(directory: str | Path | None = None):
    """Load a saved tiny folder with the stock ZImagePipeline (what a user deploys)."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(directory or tiny_model_dir()), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


_DIR: list[Path] = []


def tiny_model_dir() -> Path:
    """The tiny Z-Image folder, built once per test process in a temporary directory (removed at exit)."""
    if not _DIR:
        td.quiet()
        root = Path(tempfile.mkdtemp(prefix="flowcredit-tiny-zimage-"))
        atexit.register(shutil.rmtree, root, True)
        _DIR.append(save_tiny_zimage(root / KIND))
    return _DIR[0]


def load_adapter(precision: str = "fp32", trainable: str = "all", **kw):
    """flowcredit's adapter for the tiny folder (fp32 by default: parity tests compare to the last bits)."""
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.zimage import ZImageFlowModel

    cfg = ModelCfg(name=KIND, precision=precision, trainable=trainable, lora_rank=kw.pop("lora_rank", 4),
                   lora_alpha=kw.pop("lora_alpha", 8.0),
                   gradient_checkpointing=kw.pop("gradient_checkpointing", False))
    model = ZImageFlowModel.from_pretrained(tiny_model_dir(), cfg, resolution=RESOLUTION, **kw)
    if trainable:
        model.configure_trainable(trainable)
    return model


def train_config(method: str, out_dir: str | Path, *overrides: str):
    """A TrainConfig running `method` on the tiny Z-Image with LoRA (r4, α8): 1 prompt × G=2, T=3, CFG 2, CPU."""
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    args = [
        f"method={method}", f"model.name={KIND}", f"model.path={tiny_model_dir()}", "model.precision=fp32",
        "model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8", "sampler.num_steps=3",
        "sampler.grid=uniform", f"sampler.shift={SHIFT}", "sampler.guidance_scale=2.0", "data.prompts_per_iter=1",
        "data.group_size=2", "reward.name=tiny_diffusers:BrightnessReward", "run.eval_at_end=false",
        "run.iterations=2", "run.grid_every=0", "run.checkpoint_every=100", "optim.kl_beta=0.04", "optim.lr=1e-2",
        "run.threads=1", f"run.out_dir={out_dir}", *overrides,
    ]
    cfg = load_config(TrainConfig, None, args)
    cfg.model.options = {"resolution": RESOLUTION}  # the pipeline's default would be 1024 px
    return cfg
