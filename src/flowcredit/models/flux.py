"""FLUX.1 (dev / schnell layout) behind the FlowModel protocol (diffusers' FluxPipeline components).

    model = FluxFlowModel.from_pretrained("path/to/FLUX.1-dev", ModelCfg(name="flux", trainable="lora"))

Latent layout (our choice): the protocol's latent is the PACKED token sequence (L, D) = (h/2·w/2, 4·C), exactly
the `latents` FluxPipeline iterates on (`FluxPipeline._pack_latents`: 2×2 patches of the C-channel VAE latent).
The samplers are shape-generic, so nothing else knows; `decode` unpacks (`FluxPipeline._unpack_latents` order) and
`unpack`/`pack` are public for users who want the (C, h, w) view. The noise of a packed latent is the packed noise of
an unpacked one (a permutation of i.i.d. N(0, 1) entries), so the policy is the same.

Conventions (checked against FluxPipeline in tests/models/test_flux.py, max |Δ| ≤ 1e-5 on tiny components):
  * time: our t is the scheduler's sigma. FluxPipeline passes `timestep = (sigma·1000)/1000` to the transformer
    (which multiplies by 1000 again inside); we form the same fp32 expression so the inputs are bit-identical;
  * velocity: the transformer output is v = x1 − x0 (FlowMatchEulerDiscreteScheduler.step: x + (σ_next − σ)·out);
  * guidance: FLUX.1-dev is guidance-DISTILLED: the scale goes into the transformer's guidance embedding
    (`embedded_guidance`, FluxPipeline's `guidance_scale`, default 3.5) and the model is called once per step.
    flowcredit's `sampler.guidance_scale` is TRUE classifier-free guidance (FluxPipeline's `true_cfg_scale` with
    `negative_prompt=""`); leave it at 1.0 for FLUX.1-dev as flow_grpo does;
  * time grid: FLUX.1-dev's scheduler shifts with the image size (`use_dynamic_shifting`, mu = calculate_shift(L));
    the shift is exponential with σ-power 1, i.e. the SD3 shift formula with shift = exp(mu). `time_grid(T)` returns
    the scheduler's own sigmas for FluxPipeline's `sigmas = linspace(1, 1/T, T)`; the same grid, up to float32
    rounding, is `samplers.schedules.time_grid(T, shift=model.equivalent_shift, kind="uniform")`;
  * ids: text ids are zeros (L_txt, 3); image ids are (row, col) of each 2×2 patch (`_prepare_latent_image_ids`);
  * prompts: `FluxPipeline.encode_prompt` (CLIP pooled output + T5 hidden states).

LoRA: flow_grpo's scripts/train_flux.py targets (attention projections + the feed-forward layers).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..types import Cond
from .diffusers_common import DiffusersFlowModel, DiffusersOptions, dynamic_shift_mu, shift_of


@dataclass
class FluxOptions(DiffusersOptions):
    """`model.options` of flux: the diffusers options + FLUX.1-dev's distilled guidance."""

    embedded_guidance: float = field(
        default=3.5,
        metadata={"help": "FLUX.1-dev distilled guidance embedding (not CFG; CFG is sampler.guidance_scale).",
                  "ge": 0},
    )

FLUX_COMPONENTS = {
    "transformer": "config.json",
    "vae": "config.json",
    "text_encoder": "config.json",
    "text_encoder_2": "config.json",
    "tokenizer": "",
    "tokenizer_2": "",
    "scheduler": "scheduler_config.json",
}

FLUX_LORA_TARGETS = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)

DEFAULT_EMBEDDED_GUIDANCE = 3.5  # FluxPipeline.__call__ default guidance_scale (FLUX.1-dev)


class FluxFlowModel(DiffusersFlowModel):
    """FLUX.1 adapter. Cond = {"prompt_embeds": (B, L_t5, 4096), "pooled": (B, 768)} (sizes for FLUX.1-dev)."""

    family = "flux"
    pipeline_name = "FluxPipeline"
    default_lora_targets = FLUX_LORA_TARGETS
    default_max_sequence_length = 512  # FluxPipeline.__call__ default

    def __init__(self, pipe, cfg, *, resolution: int | None = None, embedded_guidance: float | None = None,
                 max_sequence_length: int | None = None, cache_size: int = 256, decode_batch_size: int = 8):
        super().__init__(pipe, cfg, max_sequence_length=max_sequence_length, cache_size=cache_size,
                         decode_batch_size=decode_batch_size)
        vsf = pipe.vae_scale_factor
        self.resolution = int(resolution or pipe.default_sample_size * vsf)
        if self.resolution % (vsf * 2) != 0:
            raise ValueError(
                f"model resolution {self.resolution} must be a multiple of {vsf * 2} (VAE factor {vsf} × 2×2 packing)"
            )
        self.latent_hw = 2 * (self.resolution // (vsf * 2))  # FluxPipeline.prepare_latents
        self.latent_channels = self.net.config.in_channels // 4
        n = self.latent_hw // 2
        self.latent_shape = (n * n, self.latent_channels * 4)
        self.embedded_guidance = float(DEFAULT_EMBEDDED_GUIDANCE if embedded_guidance is None else embedded_guidance)
        ids = pipe._prepare_latent_image_ids(1, n, n, "cpu", torch.float32)  # (L, 3)
        self.register_buffer("img_ids", ids, persistent=False)

    @staticmethod
    def _t5_tokenizer_max(pipe) -> int | None:
        tok = getattr(pipe, "tokenizer_2", None)
        return int(tok.model_max_length) if tok is not None and tok.model_max_length < 10**6 else None

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg=None, **kwargs) -> FluxFlowModel:
        """Load from a local diffusers folder (checked: a missing component is named) or a hub id.

        Args:
            path: folder with model_index.json, transformer/, vae/, text_encoder{,_2}/, tokenizer{,_2}/, scheduler/.
            cfg: a ModelCfg; default ModelCfg(name="flux").
            **kwargs: resolution, embedded_guidance, max_sequence_length, cache_size, decode_batch_size.
        """
        from ..config.schema import ModelCfg

        cfg = copy.deepcopy(cfg) if cfg is not None else ModelCfg(name="flux")
        cfg.path = str(path)
        pipe = cls._load_pipeline(str(path), cfg, FLUX_COMPONENTS)
        return cls(pipe, cfg, **kwargs)

    # ------------------------------------------------------------------------------------------- packing
    def pack(self, z: Tensor) -> Tensor:
        """(B, C, h, w) VAE latents → (B, L, 4C) tokens (FluxPipeline._pack_latents order)."""
        return self._pipe._pack_latents(z, z.shape[0], z.shape[1], z.shape[2], z.shape[3])

    def unpack(self, x: Tensor) -> Tensor:
        """(B, L, 4C) tokens → (B, C, h, w) VAE latents (FluxPipeline._unpack_latents order)."""
        B, L, D = x.shape
        n = self.latent_hw // 2
        return x.view(B, n, n, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, D // 4, 2 * n, 2 * n)

    _unpack = unpack

    # ------------------------------------------------------------------------------------------- protocol
    def _encode_uncached(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, pooled, _text_ids = self._pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": pe, "pooled": pooled}

    def _forward(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        B = x_t.shape[0]
        pe = cond["prompt_embeds"]
        guidance = None
        if self.net.config.guidance_embeds:
            guidance = torch.full((B,), self.embedded_guidance, dtype=torch.float32, device=x_t.device)
        txt_ids = torch.zeros(pe.shape[1], 3, device=x_t.device, dtype=torch.float32)
        return self.net(
            hidden_states=x_t,
            timestep=(t * 1000.0) / 1000.0,  # FluxPipeline: (scheduler.timesteps = σ·1000) / 1000
            guidance=guidance,
            pooled_projections=cond["pooled"],
            encoder_hidden_states=pe,
            txt_ids=txt_ids,
            img_ids=self.img_ids,
            return_dict=False,
        )[0]

    # ------------------------------------------------------------------------------------------- schedule
    @property
    def mu(self) -> float:
        """FluxPipeline's resolution-dependent shift exponent for this image size (calculate_shift)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        return dynamic_shift_mu(self.scheduler, self.latent_shape[0], calculate_shift)

    @property
    def equivalent_shift(self) -> float:
        """The SD3-style shift that reproduces the dynamic-shift grid: exp(mu) (or the scheduler's shift if static)."""
        return shift_of(self.scheduler, lambda: self.mu)

    def time_grid(self, num_steps: int) -> Tensor:
        """The scheduler's sigmas for `num_inference_steps=num_steps` as FluxPipeline.__call__ sets them."""
        sched = copy.deepcopy(self.scheduler)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        kw = {"mu": self.mu} if sched.config.get("use_dynamic_shifting", False) else {}
        sched.set_timesteps(sigmas=sigmas, device="cpu", **kw)
        return sched.sigmas.detach().clone().float()

    def pipeline_kwargs(self) -> dict:
        """Arguments that make `FluxPipeline.__call__` match this adapter."""
        return {
            "height": self.resolution,
            "width": self.resolution,
            "max_sequence_length": self.max_sequence_length,
            "guidance_scale": self.embedded_guidance,
        }

    def describe(self) -> dict:
        d = super().describe()
        d["embedded_guidance"] = self.embedded_guidance
        d["equivalent_shift"] = self.equivalent_shift
        return d
