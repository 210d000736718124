"""CLIP-family rewards on transformers' `CLIPModel`: PickScore, CLIPScore, LAION aesthetic, HPSv2-style.

Loading: `model` is a local folder or a hub id, loaded with `from_pretrained(..., local_files_only=...)`.
`local_files_only` defaults to True: a hub id resolves from the local Hugging Face cache and never downloads at run
time (pre-fetch weights with `huggingface-cli download <id>` on a machine with network, or pass a folder).
The tokenizer and `preprocessor_config.json` come from `processor` (default: the model's folder/id).

Preprocessing runs on tensors, without PIL or torchvision: images (B, 3, H, W) in [0, 1] are first quantized to
the uint8 grid (as flow_grpo's PIL path does, `quantize=True`), resized so the shortest edge equals
`size["shortest_edge"]` with antialiased bicubic interpolation (torch's `antialias=True` follows PIL's resampling
filter), center-cropped to `crop_size` and normalized with the processor's `image_mean` / `image_std`. Results
match `CLIPProcessor` up to interpolation rounding (PIL resamples in uint8).

Scores (all in the docstrings of the classes): PickScore = exp(logit_scale)·cos/26 (flow_grpo
`pickscore_scorer.py`, shared/docs/SHAPES_BENCHMARK.md §2.4); CLIPScore = w·max(cos, 0) with w = 2.5 (Hessel et al.
2021, "CLIPScore"); aesthetic = MLP(image_embedding/‖·‖) (christophschuhmann/improved-aesthetic-predictor, as in
flow_grpo's `aesthetic_scorer.py`); HPSv2 = cos (tgxs002/HPSv2 `score.py`: diagonal of normalized image·text
features), optionally × `scale`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Reward, RewardOutput, check_inputs, chunks

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _dtype(d: str | torch.dtype) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    if d not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {d!r}")
    return _DTYPES[d]


def _transformers(reward: str):
    try:
        import transformers
    except ModuleNotFoundError as e:
        raise ValueError(f"reward '{reward}' needs transformers: pip install 'flowcredit[rewards]'") from e
    return transformers


def _features(out: Any) -> Tensor:
    """`get_image_features` / `get_text_features` return a tensor (transformers 4) or an output whose
    `pooler_output` holds the projected features (transformers 5)."""
    if isinstance(out, Tensor):
        return out
    for k in ("pooler_output", "image_embeds", "text_embeds"):
        v = getattr(out, k, None)
        if v is not None:
            return v
    raise TypeError(f"cannot find features in {type(out).__name__}")


def read_preprocessor_config(path: str, local_files_only: bool = True, revision: str | None = None) -> dict[str, Any]:
    """`preprocessor_config.json` of a folder or hub id (cache only when local_files_only), or {} if absent."""
    if os.path.isdir(path):
        f = os.path.join(path, "preprocessor_config.json")
        return json.load(open(f)) if os.path.isfile(f) else {}
    from transformers.utils import cached_file

    cached = cached_file(path, "preprocessor_config.json", local_files_only=local_files_only, revision=revision,
                         _raise_exceptions_for_missing_entries=False)
    return json.load(open(cached)) if cached else {}


class ImagePreprocessor:
    """CLIP-style tensor preprocessing (see the module docstring). Differentiable when `quantize=False`."""

    def __init__(self, shortest_edge: int = 224, crop: tuple[int, int] = (224, 224), mean=OPENAI_CLIP_MEAN,
                 std=OPENAI_CLIP_STD, quantize: bool = True):
        self.shortest_edge, self.crop, self.quantize = int(shortest_edge), (int(crop[0]), int(crop[1])), quantize
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], image_size: int, quantize: bool = True) -> ImagePreprocessor:
        size = cfg.get("size", image_size)
        if isinstance(size, dict):
            short = size.get("shortest_edge") or min(size.get("height", image_size), size.get("width", image_size))
        else:
            short = int(size)
        crop: Any = cfg.get("crop_size", short)
        crop = (crop["height"], crop["width"]) if isinstance(crop, dict) else (int(crop), int(crop))
        return cls(
            short, crop, cfg.get("image_mean", OPENAI_CLIP_MEAN), cfg.get("image_std", OPENAI_CLIP_STD), quantize
        )

    def __call__(self, images: Tensor) -> Tensor:
        x = images.float().clamp(0, 1)
        if self.quantize:
            x = (x * 255).round() / 255
        h, w = x.shape[-2:]
        s = self.shortest_edge / min(h, w)
        nh, nw = (
            (self.shortest_edge, int(self.shortest_edge * w / h))
            if h <= w
            else (int(self.shortest_edge * h / w), self.shortest_edge)
        )
        if (nh, nw) != (h, w):
            x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=s < 1).clamp(0, 1)
        ch, cw = self.crop
        top, left = max(0, (nh - ch) // 2), max(0, (nw - cw) // 2)
        x = x[..., top : top + ch, left : left + cw]
        if x.shape[-2:] != (ch, cw):  # image smaller than the crop: pad with zeros like CLIPImageProcessor
            x = F.pad(x, (0, cw - x.shape[-1], 0, ch - x.shape[-2]))
        return (x - self.mean.to(x.device)) / self.std.to(x.device)


class CLIPBackbone:
    """A loaded CLIP model + tokenizer + preprocessor with normalized embedding helpers."""

    def __init__(
        self,
        model: str | nn.Module,
        processor: str | None = None,
        local_files_only: bool = True,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        revision: str | None = None,
        quantize: bool = True,
        tokenizer: Any = None,
        reward: str = "clip",
    ):
        tf = _transformers(reward)
        self.device, self.dtype = torch.device(device), _dtype(dtype)
        if isinstance(model, str):
            try:
                model_obj = tf.CLIPModel.from_pretrained(model, local_files_only=local_files_only, revision=revision)
            except OSError as e:
                raise ValueError(
                    f"reward '{reward}': cannot load CLIP model '{model}' (local_files_only={local_files_only}; pass "
                    f"a folder or pre-download the hub id): {e}"
                ) from e
        else:
            model_obj = model
        self.model = model_obj.to(self.device, self.dtype).eval().requires_grad_(False)
        src = processor or (model if isinstance(model, str) else None)
        if tokenizer is None:
            if src is None:
                raise ValueError(
                    f"reward '{reward}': pass processor=<folder or hub id> (tokenizer + preprocessor_config) with a "
                    "model object"
                )
            try:
                tokenizer = tf.AutoTokenizer.from_pretrained(src, local_files_only=local_files_only, revision=revision)
            except OSError as e:
                raise ValueError(f"reward '{reward}': cannot load the tokenizer of '{src}': {e}") from e
        self.tokenizer = tokenizer
        cfg = read_preprocessor_config(src, local_files_only, revision) if src else {}
        self.preprocess = ImagePreprocessor.from_config(cfg, self.model.config.vision_config.image_size, quantize)
        self.max_length = min(77, int(self.model.config.text_config.max_position_embeddings))

    @torch.no_grad()
    def image_embeds(self, images: Tensor) -> Tensor:
        px = self.preprocess(images.to(self.device)).to(self.dtype)
        e = _features(self.model.get_image_features(pixel_values=px)).float()
        return e / e.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def text_embeds(self, prompts: Sequence[str]) -> Tensor:
        t = self.tokenizer(
            list(prompts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        t = {k: v.to(self.device) for k, v in t.items() if k in ("input_ids", "attention_mask")}
        e = _features(self.model.get_text_features(**t)).float()
        return e / e.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def cosine(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        return (self.image_embeds(images) * self.text_embeds(prompts)).sum(-1)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.detach().float().exp())


class _CLIPReward(Reward):
    default_model: str | None = None
    default_processor: str | None = None

    def __init__(
        self,
        model: str | nn.Module | None = None,
        processor: str | None = None,
        local_files_only: bool = True,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        revision: str | None = None,
        quantize: bool = True,
        tokenizer: Any = None,
    ):
        model = model if model is not None else self.default_model
        if model is None:
            raise ValueError(f"reward '{self.name}' needs model=<folder or hub id of a transformers CLIPModel>")
        if processor is None and isinstance(model, str) and model == self.default_model:
            processor = self.default_processor
        self.clip = CLIPBackbone(
            model, processor, local_files_only, device, dtype, revision, quantize, tokenizer, self.name
        )
        self.batch_size = int(batch_size)

    def _score(self, images: Tensor, prompts: Sequence[str]) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def __call__(
        self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any
    ) -> RewardOutput:
        check_inputs(self.name, images, prompts, None)
        scores: list[Tensor] = []
        comps: dict[str, list[Tensor]] = {}
        for sl in chunks(images.shape[0], self.batch_size):
            s, c = self._score(images[sl], list(prompts)[sl])
            scores.append(s.cpu())
            for k, v in c.items():
                comps.setdefault(k, []).append(v.cpu())
        return RewardOutput(torch.cat(scores).float(), {k: torch.cat(v).float() for k, v in comps.items()})


class PickScoreReward(_CLIPReward):
    """PickScore (Kirstain et al. 2023) as flow_grpo uses it: exp(logit_scale) · cos(text, image) / 26.

    Defaults: model `yuvalkirstain/PickScore_v1`, tokenizer/preprocessing of `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`
    (flow_grpo's pair). Prompts are truncated to 77 tokens. Components: `cos`.
    """

    name = "pickscore"
    default_model = "yuvalkirstain/PickScore_v1"
    default_processor = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    divisor = 26.0

    def _score(self, images, prompts):
        cos = self.clip.cosine(images, prompts)
        return self.clip.logit_scale * cos / self.divisor, {"cos": cos}


class CLIPScoreReward(_CLIPReward):
    """CLIPScore (Hessel et al. 2021): w · max(cos(text, image), 0), w = 2.5 by default (so it lies in [0, 2.5]).

    Default model `openai/clip-vit-large-patch14`. Components: `cos`.
    """

    name = "clipscore"
    default_model = "openai/clip-vit-large-patch14"

    def __init__(self, *args: Any, w: float = 2.5, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.w = float(w)

    def _score(self, images, prompts):
        cos = self.clip.cosine(images, prompts)
        return self.w * cos.clamp(min=0), {"cos": cos}


class HPSv2Reward(_CLIPReward):
    """HPSv2-style preference score: cos(text, image) of a CLIP fine-tuned on human preferences, × `scale` (1 = the
    raw HPS of tgxs002/HPSv2 `score.py`, typically 0.2–0.35).

    HPSv2 ships OpenCLIP ViT-H-14 weights (`HPS_v2(.1)_compressed.pt`); this scorer needs them in transformers
    `CLIPModel` format (`model=<folder>`); there is no default. Components: `cos`.
    """

    name = "hpsv2"

    def __init__(self, *args: Any, scale: float = 1.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.scale = float(scale)

    def _score(self, images, prompts):
        cos = self.clip.cosine(images, prompts)
        return self.scale * cos, {"cos": cos}


class AestheticMLP(nn.Module):
    """The LAION improved-aesthetic-predictor head: five Linear layers with dropout in between and no activations
    (keys layers.0/2/4/6/7, matching `sac+logos+ava1-l14-linearMSE.pth`)."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def load_state_dict_file(path: str) -> dict[str, Tensor]:
    """A state dict from .safetensors, or from a torch file with `weights_only=True` (no arbitrary pickle code)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    return sd


class AestheticReward(_CLIPReward):
    """LAION aesthetic predictor v2: MLP(CLIP image embedding / ‖·‖), roughly 1–10 on real images. Prompts unused.

    Args:
        head: local file of the MLP weights (`sac+logos+ava1-l14-linearMSE.pth` or a .safetensors export); required.
        model: default `openai/clip-vit-large-patch14` (the head expects its 768-d embedding).
    """

    name = "aesthetic"
    default_model = "openai/clip-vit-large-patch14"

    def __init__(self, *args: Any, head: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if head is None:
            raise ValueError(
                "reward 'aesthetic' needs head=<local file of the LAION aesthetic MLP weights, e.g. "
                "sac+logos+ava1-l14-linearMSE.pth>"
            )
        if not os.path.isfile(head):
            raise ValueError(f"reward 'aesthetic': head file not found: {head}")
        dim = int(self.clip.model.config.projection_dim)
        self.head = AestheticMLP(dim)
        sd = load_state_dict_file(head)
        try:
            self.head.load_state_dict(sd)
        except RuntimeError as e:
            raise ValueError(f"reward 'aesthetic': head {head} does not fit a {dim}-d CLIP embedding: {e}") from e
        self.head.to(self.clip.device).eval().requires_grad_(False)

    @torch.no_grad()
    def _score(self, images, prompts):
        return self.head(self.clip.image_embeds(images)).squeeze(-1), {}
