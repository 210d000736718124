"""ImageReward (Xu et al. 2023, THUDM/ImageReward) re-implemented on transformers' BLIP.

The `image-reward` package cannot be installed beside our stack (shared/docs/ENVIRONMENT.md §5: undeclared `clip`,
transformers-5 import errors, pins that clash with diffusers), so the scorer is rebuilt here from its published
definition (`ImageReward/ImageReward.py`):

    image_embeds = BLIP ViT-L(preprocess(image))                       # all tokens, after the final LayerNorm
    h            = BLIP text encoder(prompt tokens, cross-attending to image_embeds)[:, 0]   # [CLS]
    reward       = (MLP(h) − 0.16717362830052426) / 1.0333394966054072

with the prompt tokenized by bert-base-uncased (padding to max_length=35, truncation), the image resized (shortest
edge, bicubic) and center-cropped to 224 and normalized with the OpenAI CLIP mean/std, and the same 5-Linear MLP head
as the LAION aesthetic predictor (768 → 1 here). transformers' `BlipForImageTextRetrieval` holds exactly the two
towers (`vision_model`, `text_encoder` with cross-attention).

Loading (no download: `local_files_only=True` by default):
- `model=<folder>`: a transformers BLIP checkpoint folder (config.json + weights + tokenizer) plus `head=<file>`;
  `convert_checkpoint()` writes such a folder from the original `ImageReward.pt`.
- `checkpoint=<ImageReward.pt>` + `config=<folder or hub id of a BLIP config, e.g. Salesforce/blip-itm-large-coco>`
  + `tokenizer=<bert-base-uncased folder or id>`: the original weights are renamed on load (`rename_original_key`);
  any key that does not map, or a shape mismatch, is an error listing the keys (never a silent partial load).

Caveat: the key renaming follows BLIP's module names (salesforce/BLIP `vit.py`, `med.py`) and transformers' BLIP
conversion; it is tested on a synthetic checkpoint with those names, not on the real `ImageReward.pt` (no weights
offline here).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .base import Reward, RewardOutput, check_inputs, chunks
from .clip import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    AestheticMLP,
    ImagePreprocessor,
    _dtype,
    _transformers,
    load_state_dict_file,
)

MEAN = 0.16717362830052426
STD = 1.0333394966054072
HEAD_FILE = "imagereward_head.safetensors"

_VISION_RULES = [  # original BLIP ViT name → transformers BlipVisionModel name (applied in order)
    (r"^visual_encoder\.", "vision_model."),
    (r"^vision_model\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^vision_model\.pos_embed$", "vision_model.embeddings.position_embedding"),
    (r"^vision_model\.patch_embed\.proj\.", "vision_model.embeddings.patch_embedding."),
    (r"^vision_model\.norm\.", "vision_model.post_layernorm."),
    (r"^vision_model\.blocks\.(\d+)\.", r"vision_model.encoder.layers.\1."),
    (r"\.attn\.proj\.", ".self_attn.projection."),
    (r"\.attn\.qkv\.", ".self_attn.qkv."),
    (r"\.norm1\.", ".layer_norm1."),
    (r"\.norm2\.", ".layer_norm2."),
]
_IGNORED = re.compile(r"(position_ids$|^itm_head\.)")


def rename_original_key(key: str) -> str:
    """Map an `ImageReward.pt` key to a transformers BLIP key ("head." prefix for the MLP)."""
    if key.startswith("mlp."):
        return "head." + key[len("mlp."):]
    if not key.startswith("blip."):
        return key
    k = key[len("blip."):]
    if k.startswith("visual_encoder."):
        for pat, rep in _VISION_RULES:
            k = re.sub(pat, rep, k)
    return k  # text_encoder.*, vision_proj.*, text_proj.* keep their names


def _split_original(sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    blip, head = {}, {}
    for k, v in sd.items():
        nk = rename_original_key(k)
        if nk.startswith("head."):
            head[nk[len("head."):]] = v
        else:
            blip[nk] = v
    return blip, head


class ImageRewardReward(Reward):
    """ImageReward score (see the module docstring): roughly standard-normal on real images, higher is better.

    Args:
        model: transformers BLIP folder / hub id (weights + config + tokenizer), or None with `checkpoint`.
        head: MLP weights file (default: `<model>/imagereward_head.safetensors`).
        checkpoint: the original `ImageReward.pt`; needs `config` and `tokenizer`.
        config: BLIP config folder / hub id (with `checkpoint`); `image_size` is forced to 224.
        tokenizer: bert-base-uncased folder / hub id (default: `model`).
        local_files_only, revision, device, dtype, batch_size: as for the CLIP rewards.
        max_length: prompt tokens (ImageReward: 35).
    Components: `raw` (the MLP output before standardization).
    """

    name = "imagereward"

    def __init__(self, model: str | None = None, head: str | None = None, checkpoint: str | None = None,
                 config: str | None = None, tokenizer: str | Any = None, local_files_only: bool = True,
                 revision: str | None = None, device: str = "cpu", dtype: str = "float32", batch_size: int = 16,
                 max_length: int = 35, image_size: int | None = None, quantize: bool = True):
        tf = _transformers(self.name)
        self.device, self.dtype, self.batch_size, self.max_length = (
            torch.device(device),
            _dtype(dtype),
            int(batch_size),
            int(max_length),
        )
        kw = {"local_files_only": local_files_only, "revision": revision}
        if (model is None) == (checkpoint is None):
            raise ValueError(
                "reward 'imagereward' needs model=<transformers BLIP folder> (+ head) or checkpoint=<ImageReward.pt> "
                "(+ config, tokenizer); it is not downloaded"
            )
        try:
            if model is not None:
                blip = tf.BlipForImageTextRetrieval.from_pretrained(model, **kw)
                head = head or os.path.join(model, HEAD_FILE)
                if not os.path.isfile(head):
                    raise ValueError(f"reward 'imagereward': head weights not found at {head} (pass head=<file>)")
                head_sd = load_state_dict_file(head)
            else:
                if config is None or tokenizer is None:
                    raise ValueError(
                        "reward 'imagereward': checkpoint= needs config=<BLIP config folder/id> and "
                        "tokenizer=<bert-base-uncased folder/id>"
                    )
                cfg = tf.BlipConfig.from_pretrained(config, **kw)
                cfg.vision_config.image_size = image_size or 224
                blip = tf.BlipForImageTextRetrieval(cfg)
                assert checkpoint is not None  # exactly one of model / checkpoint (checked above)
                blip_sd, head_sd = _split_original(load_state_dict_file(checkpoint))
                self._load_strict(blip, blip_sd, checkpoint)
        except OSError as e:
            raise ValueError(f"reward 'imagereward': cannot load ({e}); local_files_only={local_files_only}") from e
        tok_src = tokenizer if tokenizer is not None else model
        self.tokenizer: Any = tf.AutoTokenizer.from_pretrained(tok_src, **kw) if isinstance(tok_src, str) else tok_src
        self.blip: Any = blip.to(self.device, self.dtype).eval().requires_grad_(False)
        dim = int(blip.config.text_config.hidden_size)
        self.head = AestheticMLP(dim)
        try:
            self.head.load_state_dict(head_sd)
        except RuntimeError as e:
            raise ValueError(f"reward 'imagereward': head weights do not fit a {dim}-d text feature: {e}") from e
        self.head.to(self.device).eval().requires_grad_(False)
        size = int(blip.config.vision_config.image_size)
        self.preprocess = ImagePreprocessor(size, (size, size), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, quantize)

    @staticmethod
    def _load_strict(blip: nn.Module, sd: dict[str, Tensor], source: str) -> None:
        expected = blip.state_dict()
        unexpected = [k for k in sd if k not in expected and not _IGNORED.search(k)]
        missing = [k for k in expected if k not in sd and not _IGNORED.search(k)]
        wrong = [
            f"{k}: {tuple(sd[k].shape)} vs {tuple(v.shape)}"
            for k, v in expected.items()
            if k in sd and sd[k].shape != v.shape
        ]
        if unexpected or missing or wrong:
            raise ValueError(
                f"reward 'imagereward': {source} does not match the BLIP config: unexpected {unexpected[:5]}, missing "
                f"{missing[:5]}, shape mismatches {wrong[:5]}"
            )
        blip.load_state_dict({k: v for k, v in sd.items() if k in expected}, strict=False)

    @torch.no_grad()
    def raw_scores(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        px = self.preprocess(images.to(self.device)).to(self.dtype)
        img = self.blip.vision_model(pixel_values=px).last_hidden_state
        att = torch.ones(img.shape[:-1], dtype=torch.long, device=self.device)
        t = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        out = self.blip.text_encoder(
            input_ids=t["input_ids"].to(self.device),
            attention_mask=t["attention_mask"].to(self.device),
            encoder_hidden_states=img,
            encoder_attention_mask=att,
        )
        return self.head(out.last_hidden_state[:, 0, :].float()).squeeze(-1)

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        check_inputs(self.name, images, prompts, None)
        raw = torch.cat(
            [self.raw_scores(images[sl], list(prompts)[sl]).cpu() for sl in chunks(images.shape[0], self.batch_size)]
        )
        return RewardOutput(((raw - MEAN) / STD).float(), {"raw": raw.float()})


def convert_checkpoint(
    checkpoint: str, config: str, tokenizer: str, out_dir: str, local_files_only: bool = True, image_size: int = 224
) -> str:
    """Write a transformers BLIP folder (+ `imagereward_head.safetensors` + tokenizer) from the original
    ImageReward.pt, loadable with `ImageRewardReward(model=out_dir)`."""
    from safetensors.torch import save_file

    r = ImageRewardReward(
        checkpoint=checkpoint,
        config=config,
        tokenizer=tokenizer,
        local_files_only=local_files_only,
        image_size=image_size,
    )
    os.makedirs(out_dir, exist_ok=True)
    r.blip.save_pretrained(out_dir)
    r.tokenizer.save_pretrained(out_dir)
    save_file({k: v.contiguous() for k, v in r.head.state_dict().items()}, os.path.join(out_dir, HEAD_FILE))
    return out_dir
