"""Z-Image (Tongyi-MAI Z-Image / Z-Image-Turbo) behind the FlowModel protocol (diffusers' ZImagePipeline components).

    model = ZImageFlowModel.from_pretrained("path/to/Z-Image", ModelCfg(name="zimage", trainable="lora"))

Components: ZImageTransformer2DModel (a single-stream DiT: image and caption tokens in one sequence), a Qwen3 text
encoder (`Qwen3Model`, its second-to-last hidden states), the FLUX VAE (AutoencoderKL, 16 channels) and
FlowMatchEulerDiscreteScheduler.

Conventions (checked against ZImagePipeline in tests/models/test_zimage.py on tiny components, fp32):
  * latent: (C, H/8, W/8), the pipeline's `latents` (after the VAE scaling: z = (vae_latent − shift)·scaling);
  * time: our t is the scheduler's sigma. ZImagePipeline calls the transformer with `(1000 − σ·1000)/1000`, i.e. the
    DATA-side time 1 − σ (the transformer multiplies by t_scale = 1000 inside); we form the same fp32 expression;
  * velocity: the pipeline negates the transformer's output before `scheduler.step` (x + (σ_next − σ)·out), so the
    transformer predicts x0 − x1 and our v = x1 − x0 is MINUS its output;
  * CFG: ZImagePipeline's `guidance_scale` g mixes `c + g·(c − u)` (CFG on when g > 0). flowcredit's
    `sampler.guidance_scale` w mixes `u + w·(c − u)`, so w = 1 + g: Z-Image's card setting g = 4 is w = 5, the
    Turbo's g = 0 is w = 1 (`pipeline_guidance`). Not reproduced: `cfg_normalization` (the card's example sets it;
    the pipeline's default is off) and `cfg_truncation` < 1 (default 1.0 never truncates);
  * time grid: `sigmas = linspace(1, 1/T, T)` through the scheduler with mu = calculate_shift(image tokens). The
    released schedulers shift statically (Z-Image: 6.0, Z-Image-Turbo: 3.0; `use_dynamic_shifting: false`), so the
    grid is `samplers.schedules.time_grid(T, shift, "uniform")` (`equivalent_shift`); `time_grid(T)` returns the
    scheduler's own sigmas either way;
  * prompts: `ZImagePipeline.encode_prompt` (the tokenizer's chat template, `max_sequence_length` tokens, the
    masked hidden states: a ragged list). The Cond pads them to `max_sequence_length` and keeps each length in
    "prompt_len", so `_forward` hands the transformer exactly the pipeline's ragged list (the transformer pads
    captions to a multiple of 32 itself, and the image tokens' RoPE positions start after the caption).

LoRA: diffusers' Z-Image LoRA trainer's default targets (examples/dreambooth/train_dreambooth_lora_z_image.py:
to_k, to_q, to_v, to_out.0), written `attention.*`; they cover the main layers and both refiners.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ..types import Cond
from .diffusers_common import (
    ONE_TEXT_ENCODER_COMPONENTS,
    DiffusersFlowModel,
    DiffusersOptions,
    dynamic_shift_mu,
    shift_of,
)


@dataclass
class ZImageOptions(DiffusersOptions):
    """`model.options` of zimage: image side and Qwen3 prompt length."""

    resolution: int | None = field(
        default=None,
        metadata={"help": "Image side in pixels, a multiple of 16 (recipes: 512); null = ZImagePipeline's 1024.",
                  "ge": 1},
    )
    max_sequence_length: int | None = field(
        default=None, metadata={"help": "Qwen3 prompt tokens (chat template included); null = the pipeline's 512.",
                                "ge": 1}
    )


ZIMAGE_COMPONENTS = ONE_TEXT_ENCODER_COMPONENTS

ZIMAGE_LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")

DEFAULT_RESOLUTION = 1024  # ZImagePipeline.__call__: height = height or 1024
BLOCK_LISTS = ("layers", "noise_refiner", "context_refiner")  # the transformer blocks ('blocks' trains these)


class ZImageFlowModel(DiffusersFlowModel):
    """Z-Image adapter. Cond = {"prompt_embeds": (B, L, 2560) zero-padded to L = max_sequence_length,
    "prompt_len": (B,) int64 token counts} (sizes for Z-Image)."""

    family = "zimage"
    pipeline_name = "ZImagePipeline"
    default_lora_targets = ZIMAGE_LORA_TARGETS
    default_max_sequence_length = 512  # ZImagePipeline.__call__ default

    def __init__(self, pipe, cfg, *, resolution: int | None = None, max_sequence_length: int | None = None,
                 cache_size: int = 256, decode_batch_size: int = 8):
        super().__init__(pipe, cfg, max_sequence_length=max_sequence_length, cache_size=cache_size,
                         decode_batch_size=decode_batch_size)
        vsf = pipe.vae_scale_factor
        self.patch_size = int(self.net.config.all_patch_size[0])
        self.resolution = int(resolution or DEFAULT_RESOLUTION)
        if self.resolution % (vsf * 2) != 0:
            raise ValueError(
                f"model resolution {self.resolution} must be a multiple of {vsf * 2} (ZImagePipeline: VAE factor "
                f"{vsf} × 2)"
            )
        hw = 2 * (self.resolution // (vsf * 2))  # ZImagePipeline.prepare_latents
        self.latent_shape = (int(self.net.config.in_channels), hw, hw)

    @staticmethod
    def _t5_tokenizer_max(pipe) -> int | None:  # the Qwen tokenizer's cap (Z-Image: 131072, no cap in practice)
        tok = getattr(pipe, "tokenizer", None)
        return int(tok.model_max_length) if tok is not None and tok.model_max_length < 10**6 else None

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg=None, **kwargs) -> ZImageFlowModel:
        """Load from a local diffusers folder (checked: a missing component is named) or a hub id.

        Args:
            path: folder with model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/.
            cfg: a ModelCfg; default ModelCfg(name="zimage").
            **kwargs: resolution, max_sequence_length, cache_size, decode_batch_size.
        """
        from ..config.schema import ModelCfg

        cfg = copy.deepcopy(cfg) if cfg is not None else ModelCfg(name="zimage")
        cfg.path = str(path)
        pipe = cls._load_pipeline(str(path), cfg, ZIMAGE_COMPONENTS)
        return cls(pipe, cfg, **kwargs)

    # ------------------------------------------------------------------------------------------- training
    def configure_trainable(self, trainable: str) -> list[nn.Parameter]:
        """As DiffusersFlowModel.configure_trainable, with Z-Image's module names: 'blocks' = the main layers and
        both refiners; 'modulation' = the timestep embedder and every adaLN projection (blocks and final layer)."""
        if trainable not in ("blocks", "modulation"):
            return super().configure_trainable(trainable)
        super().configure_trainable("all")  # its checks (a LoRA model cannot train base weights)
        net = self.net
        net.requires_grad_(False)
        if trainable == "blocks":
            for attr in BLOCK_LISTS:
                getattr(net, attr).requires_grad_(True)
        else:
            net.t_embedder.requires_grad_(True)
            for name, mod in net.named_modules():
                if name.endswith("adaLN_modulation"):
                    mod.requires_grad_(True)
        return self.trainable_parameters()

    # ------------------------------------------------------------------------------------------- protocol
    def _encode_uncached(self, prompts: list[str]) -> dict[str, Tensor]:
        embeds, _ = self._pipe.encode_prompt(
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        L = max(self.max_sequence_length, *(int(e.shape[0]) for e in embeds))  # the tokenizer truncates to it
        out = embeds[0].new_zeros(len(embeds), L, embeds[0].shape[-1])
        for i, e in enumerate(embeds):
            out[i, : e.shape[0]] = e
        lens = torch.tensor([int(e.shape[0]) for e in embeds], dtype=torch.long, device=out.device)
        return {"prompt_embeds": out, "prompt_len": lens}

    def _forward(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        pe, lens = cond["prompt_embeds"], cond["prompt_len"].tolist()
        caps = [pe[i, : int(n)] for i, n in enumerate(lens)]
        x = x_t.to(self.net.dtype).unsqueeze(2)  # (B, C, F=1, h, w), the pipeline's per-sample frames
        out = self.net(
            list(x.unbind(dim=0)),
            (1000.0 - t * 1000.0) / 1000.0,  # ZImagePipeline: (1000 − scheduler.timesteps) / 1000, timesteps = σ·1000
            caps,
            return_dict=False,
        )[0]
        return -torch.stack(out, dim=0).squeeze(2)  # the pipeline's noise_pred = −output; v = x1 − x0

    # ------------------------------------------------------------------------------------------- schedule
    @property
    def image_seq_len(self) -> int:
        """Image tokens of one sample (ZImagePipeline's `image_seq_len`, the input of calculate_shift)."""
        return (self.latent_shape[1] // self.patch_size) * (self.latent_shape[2] // self.patch_size)

    @property
    def mu(self) -> float:
        """ZImagePipeline's calculate_shift(image tokens); used only by a dynamically shifting scheduler."""
        from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

        return dynamic_shift_mu(self.scheduler, self.image_seq_len, calculate_shift)

    @property
    def equivalent_shift(self) -> float:
        """The shift of `samplers.schedules.time_grid(T, shift, "uniform")` that is this pipeline's grid: the
        scheduler's static shift (Z-Image 6.0, Turbo 3.0), or exp(mu) when it shifts dynamically."""
        return shift_of(self.scheduler, lambda: self.mu)

    def time_grid(self, num_steps: int) -> Tensor:
        """The scheduler's sigmas for `num_inference_steps=num_steps` as ZImagePipeline.__call__ sets them."""
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        sched = copy.deepcopy(self.scheduler)
        sched.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), device="cpu", mu=self.mu)
        return sched.sigmas.detach().clone().float()

    @staticmethod
    def pipeline_guidance(guidance_scale: float) -> dict:
        """ZImagePipeline's `guidance_scale` for flowcredit's CFG scale w (u + w·(c − u) = c + (w − 1)·(c − u))."""
        return {"guidance_scale": float(guidance_scale) - 1.0}

    def pipeline_kwargs(self) -> dict:
        """Arguments that make `ZImagePipeline.__call__` match this adapter (add `pipeline_guidance(w)` for CFG)."""
        return {"height": self.resolution, "width": self.resolution, "max_sequence_length": self.max_sequence_length}

    def describe(self) -> dict:
        d = super().describe()
        d["equivalent_shift"] = self.equivalent_shift
        d["guidance"] = "ZImagePipeline guidance_scale = flowcredit sampler.guidance_scale - 1"
        return d
