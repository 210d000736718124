"""A tiny QwenImagePipeline built from config, offline, saved as a local diffusers folder (test fixture).

Nothing is downloaded. The tokenizer is a byte-level Qwen2Tokenizer built in memory: the 256 byte characters, the
chat-template specials <|im_start|> / <|im_end|> / <|endoftext|>, and BPE merges that make every word of
QwenImagePipeline's prompt template one token, so the template's system prefix is exactly 34 tokens as with the real
Qwen tokenizer (`prompt_template_encode_start_idx = 34` then drops exactly that prefix). The text encoder is a
2-layer Qwen2_5_VLForConditionalGeneration of width 32 (its 1-block vision tower is built but never used), the VAE an
AutoencoderKLQwenImage with one downsampling stage (factor 2: 16×16 px → a 4×8×8 latent → 16 packed tokens of 16
channels), the transformer a 2-block QwenImageTransformer2DModel of width 16. The scheduler has Qwen-Image's own
config (dynamic exponential shift, base 0.5 / max 0.9 over 256 → 8192 tokens, shift_terminal 0.02).
"""

from __future__ import annotations

import atexit
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_diffusers as td  # offline env vars, the byte alphabet, quiet(), BrightnessReward

KIND = "qwen_image"
RESOLUTION = 16
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen/Qwen-Image scheduler/scheduler_config.json (the values QwenImagePipeline's time grid depends on)
QWEN_IMAGE_SCHEDULER = {
    "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
    "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}


def qwen_tokenizer():
    """Byte-level Qwen2Tokenizer (in memory) whose merges make each word of the pipeline's template one token."""
    from transformers import Qwen2Tokenizer

    b2u = td._bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(b2u.values())}
    # the words of QwenImagePipeline.prompt_template_encode (checked in the tests: its prefix is 34 tokens)
    text = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
            "<|im_start|>assistant\n")
    for s in SPECIALS:
        text = text.replace(s, "\n")
    merges: list[tuple[str, str]] = []
    for word in sorted(set(re.findall(r" ?[A-Za-z]+", text))):
        enc = "".join(b2u[b] for b in word.encode())
        cur = enc[0]
        for ch in enc[1:]:
            if (cur, ch) not in merges:
                merges.append((cur, ch))
            cur += ch
            vocab.setdefault(cur, len(vocab))
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=2048)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def build_qwen_image_pipeline(seed: int = 0):
    """A QwenImagePipeline of tiny random components (all in eval mode)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    tok = qwen_tokenizer()
    n = len(tok)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    te_cfg = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": n, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": None,
            "eos_token_id": eos, "pad_token_id": eos,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32,
                       "fullatt_block_indexes": [0]},
        image_token_id=n + 1, video_token_id=n + 2, vision_start_token_id=n + 3, vision_end_token_id=n + 4,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(te_cfg)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(2, 2, 4),
    )
    with torch.no_grad():  # a visible velocity (and visible LoRA effects) from random weights
        for p in transformer.proj_out.parameters():
            p.normal_(0.0, 0.2)
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    for m in (transformer, text_encoder, vae):
        m.eval()
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), vae=vae, text_encoder=text_encoder,
        tokenizer=tok, transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


_DIR: list[Path] = []


def tiny_model_dir() -> Path:
    """The tiny Qwen-Image folder, built once per test process in a temporary directory (removed at exit)."""
    if not _DIR:
        td.quiet()
        root = Path(tempfile.mkdtemp(prefix="flowcredit-tiny-qwen-image-"))
        atexit.register(shutil.rmtree, root, True)
        build_qwen_image_pipeline().save_pretrained(str(root / KIND))
        _DIR.append(root / KIND)
    return _DIR[0]


def load_pipeline(directory: str | Path | None = None):
    """Load the tiny folder with the stock QwenImagePipeline (what a user deploys)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(directory or tiny_model_dir()), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_adapter(precision: str = "fp32", trainable: str = "all", **kw):
    """flowcredit's adapter for the tiny folder (fp32 by default), at RESOLUTION px."""
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.qwen_image import QwenImageFlowModel

    cfg = ModelCfg(name=KIND, precision=precision, trainable=trainable, lora_rank=kw.pop("lora_rank", 4),
                   lora_alpha=kw.pop("lora_alpha", 8.0),
                   gradient_checkpointing=kw.pop("gradient_checkpointing", False))
    model = QwenImageFlowModel.from_pretrained(tiny_model_dir(), cfg, resolution=RESOLUTION, **kw)
    if trainable:
        model.configure_trainable(trainable)
    return model


def train_config(method: str, out_dir: str | Path, *overrides: str, true_cfg_scale: float = 4.0):
    """A TrainConfig running `method` on the tiny model with LoRA (r4, α8): 1 prompt × G=2, T=3, CPU, true CFG inside
    the model (sampler.guidance_scale 1.0, as the qwen_image presets)."""
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    args = [
        f"method={method}", f"model.name={KIND}", f"model.path={tiny_model_dir()}", "model.precision=fp32",
        "model.trainable=lora", "model.lora_rank=4", "model.lora_alpha=8", "sampler.num_steps=3",
        "sampler.guidance_scale=1.0", "data.prompts_per_iter=1", "data.group_size=2",
        "reward.name=tiny_diffusers:BrightnessReward", "run.eval_at_end=false", "run.iterations=2", "run.grid_every=0",
        "run.checkpoint_every=100", "optim.kl_beta=0.04", "optim.lr=1e-2", "run.threads=1", f"run.out_dir={out_dir}",
        *overrides,
    ]
    cfg = load_config(TrainConfig, None, args)
    cfg.model.options = {"resolution": RESOLUTION, "true_cfg_scale": true_cfg_scale}
    return cfg
