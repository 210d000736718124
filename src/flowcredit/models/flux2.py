"""FLUX.2 ([dev] and [klein]) behind the FlowModel protocol (diffusers' Flux2Pipeline / Flux2KleinPipeline components).

    model = Flux2FlowModel.from_pretrained("path/to/FLUX.2-dev", ModelCfg(name="flux2", trainable="lora"))
    model = Flux2FlowModel.from_pretrained("path/to/FLUX.2-klein-base-4B", ModelCfg(name="flux2", trainable="lora"))

One registry name, `flux2`, for both pipelines: `model.options.variant` = auto (the folder's model_index.json names
the pipeline class; a hub id containing "klein" is klein) | dev | klein. The variants share the transformer
(Flux2Transformer2DModel), the VAE (AutoencoderKLFlux2), the scheduler, the latent layout and the time grid; they
differ in the text encoder and in the guidance form:

  * dev (Flux2Pipeline, FLUX.2 [dev]): Mistral-Small-3.x (Mistral3ForConditionalGeneration behind a PixtralProcessor,
    the system message of the pipeline, hidden states of layers 10, 20, 30 stacked: 3 × 5120 = 15360 channels). The
    transformer is guidance-DISTILLED: the scale goes into its guidance embedding (`embedded_guidance`, the
    pipeline's `guidance_scale`, default 4.0) and the model runs once per step. Flux2Pipeline has no true CFG: leave
    `sampler.guidance_scale` at 1.0, or the samples are not the deployed pipeline's;
  * klein (Flux2KleinPipeline, FLUX.2 [klein] 4B/9B): Qwen3 (Qwen3ForCausalLM + its chat template with
    `enable_thinking=False`, layers 9, 18, 27 stacked). No guidance embedding; the base models (`is_distilled=False`)
    use TRUE CFG with the empty prompt as negative, `u + w·(c − u)` (the pipeline's `guidance_scale` w), which is
    flowcredit's `sampler.guidance_scale` / `policy_velocity`. The step-distilled klein ignores CFG.

Conventions (checked against both pipelines in tests/models/test_flux2.py on tiny components, fp32):
  * latent: the PACKED token sequence (L, D) = (h/2·w/2, 4·C) that the pipelines iterate on: the VAE latent
    (C = 32 channels, factor 8) is "patchified" (2×2 patches → 4C channels on an h/2 × w/2 grid), normalised by the
    VAE's batch-norm statistics, then flattened row-major (`Flux2Pipeline._pack_latents`). The pipelines'
    `latents=` argument takes the (B, 4C, h/2, w/2) grid: `model.unpack(x)` gives it, `model.pack` inverts it;
    `model.to_vae_latents(x)` is the batch-norm-denormalised, unpatchified (B, C, h, w) latent that Flux2KleinPipeline
    returns for `output_type="latent"` and that the VAE decodes;
  * time: our t is the scheduler's sigma; the pipelines pass `timestep = (σ·1000)/1000` (the transformer multiplies
    by 1000 again); we form the same fp32 expression;
  * velocity: the transformer output is v = x1 − x0 (FlowMatchEulerDiscreteScheduler.step: x + (σ_next − σ)·out);
  * time grid: both pipelines take sigmas = linspace(1, 1/T, T) and the EMPIRICAL shift of the official code,
    mu = compute_empirical_mu(L, T) (it depends on the image tokens L AND on the number of steps T), applied by the
    scheduler's dynamic (exponential) shift = the SD3 shift formula with shift = exp(mu) on the uniform grid.
    `time_grid(T)` returns the scheduler's own sigmas; `equivalent_shift(T)` is exp(mu) for
    `samplers.schedules.time_grid(T, shift, "uniform")` (the trainer's `sampler.grid: uniform` + `sampler.shift`);
  * ids: text ids (0, 0, 0, l), image ids (0, row, col, 0) of the patchified grid (`_prepare_text_ids`,
    `_prepare_latent_ids`), int64 as the pipelines pass them;
  * prompts: the pipeline's own `encode_prompt` (padded to `max_sequence_length`, default 512; the transformer sees
    the padding tokens unmasked, as in the pipelines).

LoRA (peft): attention and feed-forward of the double-stream blocks and the fused projections of the single-stream
blocks (FLUX2_LORA_TARGETS: flow_grpo's FLUX.1 choice carried over to FLUX.2's module names). Targets are suffixes
resolved to the transformer's nn.Linear modules (the double blocks' `attn.to_out` is a ModuleList whose Linear is
`attn.to_out.0`; the single blocks' `attn.to_out` is the Linear itself).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from ..types import Cond
from .diffusers_common import ONE_TEXT_ENCODER_COMPONENTS, DiffusersFlowModel, DiffusersOptions, looks_like_hub_id

VARIANTS = ("auto", "dev", "klein")
PIPELINES = {"dev": "Flux2Pipeline", "klein": "Flux2KleinPipeline"}
DEFAULT_EMBEDDED_GUIDANCE = 4.0  # Flux2Pipeline.__call__ default guidance_scale (FLUX.2 [dev]'s model card: 4)


@dataclass
class Flux2Options(DiffusersOptions):
    """`model.options` of flux2: the diffusers options + which pipeline and (dev) the distilled guidance."""

    variant: Literal["auto", "dev", "klein"] = field(
        default="auto",
        metadata={"help": "dev = Flux2Pipeline (Mistral text encoder, guidance-distilled), klein = Flux2KleinPipeline "
                          "(Qwen3, true CFG); auto = the folder's model_index.json."},
    )
    embedded_guidance: float | None = field(
        default=None,
        metadata={"help": "dev only: the distilled guidance embedding (not CFG); null = Flux2Pipeline's default 4.0.",
                  "ge": 0},
    )


FLUX2_COMPONENTS = ONE_TEXT_ENCODER_COMPONENTS

FLUX2_LORA_TARGETS = (
    # double-stream blocks: image and text attention projections, both SwiGLU feed-forwards
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    # single-stream blocks: the fused QKV + MLP-in projection and the fused attention + MLP output
    "attn.to_qkv_mlp_proj", "attn.to_out",
)

# the conditioning path of FLUX.2: timestep (+ guidance) embedding, the shared modulations, the output modulation
FLUX2_MODULATION = ("time_guidance_embed", "double_stream_modulation_img", "double_stream_modulation_txt",
                    "single_stream_modulation", "norm_out")


def resolve_variant(path: str | Path, variant: str = "auto") -> str:
    """"dev" | "klein" for `path`: the given variant, else the pipeline class of the folder's model_index.json (a hub
    id: "klein" in its name). Raises ValueError for an unknown variant or a folder of another pipeline."""
    if variant not in VARIANTS:
        raise ValueError(f"model.options.variant={variant!r}; valid: {', '.join(VARIANTS)}")
    if variant != "auto":
        return variant
    if looks_like_hub_id(str(path)):
        return "klein" if "klein" in str(path).lower() else "dev"
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return "dev"  # the folder check names what is missing, with Flux2Pipeline's layout
    try:
        name = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError) as e:
        raise ValueError(f"model folder '{path}': cannot read model_index.json ({type(e).__name__})") from None
    for v, cls in PIPELINES.items():
        if name == cls:
            return v
    raise ValueError(
        f"model folder '{path}' holds a {name} (model_index.json); model.name=flux2 loads "
        f"{' or '.join(PIPELINES.values())}"
    )


class Flux2FlowModel(DiffusersFlowModel):
    """FLUX.2 [dev] adapter (Flux2KleinFlowModel: [klein]). Cond = {"prompt_embeds": (B, L_txt, 3·D_text)}
    ((B, 512, 15360) for FLUX.2 [dev]).

    Attributes (besides DiffusersFlowModel's):
        variant: "dev" | "klein".
        resolution: image side in pixels; latent_shape = (L, 4·C), L = (resolution / (8·2))².
        embedded_guidance: dev: the guidance fed to the guidance embedding; klein: None.
    """

    family = "flux2"
    variant = "dev"
    pipeline_name = PIPELINES["dev"]
    default_lora_targets = FLUX2_LORA_TARGETS
    default_max_sequence_length = 512  # both pipelines' __call__ default

    def __init__(self, pipe, cfg, *, resolution: int | None = None, embedded_guidance: float | None = None,
                 max_sequence_length: int | None = None, cache_size: int = 256, decode_batch_size: int = 8):
        super().__init__(pipe, cfg, max_sequence_length=max_sequence_length, cache_size=cache_size,
                         decode_batch_size=decode_batch_size)
        vsf = pipe.vae_scale_factor
        self.resolution = int(resolution or pipe.default_sample_size * vsf)
        if self.resolution % (vsf * 2) != 0:
            raise ValueError(
                f"model resolution {self.resolution} must be a multiple of {vsf * 2} (VAE factor {vsf} × 2×2 patches)"
            )
        n = self.resolution // (vsf * 2)  # the patchified grid side (Flux2Pipeline.prepare_latents)
        self.grid_side = n
        self.latent_channels = self.net.config.in_channels // 4
        self.latent_shape = (n * n, self.net.config.in_channels)
        self.embedded_guidance = self._guidance_value(embedded_guidance)
        ids = pipe._prepare_latent_ids(torch.zeros(1, 1, n, n))[0]  # (L, 4) int64: (0, row, col, 0)
        self.register_buffer("img_ids", ids, persistent=False)
        self._txt_ids: dict[tuple[int, str], Tensor] = {}

    def _guidance_value(self, embedded_guidance: float | None) -> float | None:
        return float(DEFAULT_EMBEDDED_GUIDANCE if embedded_guidance is None else embedded_guidance)

    # ------------------------------------------------------------------------------------------ construction
    @staticmethod
    def _t5_tokenizer_max(pipe) -> int | None:
        """The text tokenizer's model_max_length when it is a real limit (caps the default text length)."""
        tok = getattr(pipe, "tokenizer", None)
        tok = getattr(tok, "tokenizer", tok)  # FLUX.2 [dev]: a PixtralProcessor around the tokenizer
        mx = getattr(tok, "model_max_length", None)
        return int(mx) if mx is not None and mx < 10**6 else None

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg=None, *, variant: str = "auto", **kwargs) -> Flux2FlowModel:
        """Load from a local diffusers folder (checked: a missing component is named) or a hub id.

        Args:
            path: folder with model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/ (the layout
                of Flux2Pipeline / Flux2KleinPipeline.save_pretrained), or a hub id.
            cfg: a ModelCfg; default ModelCfg(name="flux2").
            variant: "auto" | "dev" | "klein" (see the module docstring).
            **kwargs: resolution, embedded_guidance (dev), max_sequence_length, cache_size, decode_batch_size.
        """
        from ..config.schema import ModelCfg

        cfg = copy.deepcopy(cfg) if cfg is not None else ModelCfg(name="flux2")
        cfg.path = str(path)
        klein = resolve_variant(path, variant) == "klein"
        klass: type[Flux2FlowModel] = Flux2KleinFlowModel if klein else Flux2FlowModel
        if klass is Flux2KleinFlowModel and kwargs.get("embedded_guidance") is not None:
            raise ValueError(
                "model.options.embedded_guidance: FLUX.2 [klein] has no guidance embedding; its guidance is true CFG, "
                "sampler.guidance_scale"
            )
        pipe = klass._load_pipeline(str(path), cfg, FLUX2_COMPONENTS)
        return klass(pipe, cfg, **kwargs)

    def _add_lora(self, cfg) -> None:
        """DiffusersFlowModel._add_lora on the nn.Linear modules whose names end with a target (peft's suffix rule,
        but only Linear layers: `attn.to_out` names the single blocks' Linear and the double blocks' ModuleList)."""
        targets = list(cfg.lora_targets) if cfg.lora_targets else list(self.default_lora_targets)
        names = [n for n, m in self.net.named_modules()
                 if isinstance(m, nn.Linear) and any(n == t or n.endswith("." + t) for t in targets)]
        if not names:
            raise ValueError(f"model.lora_targets={targets} matched no Linear module of the {self.family} transformer")
        resolved = copy.copy(cfg)
        resolved.lora_targets = names
        super()._add_lora(resolved)
        self.lora_targets = targets

    def configure_trainable(self, trainable: str) -> list[nn.Parameter]:
        """DiffusersFlowModel.configure_trainable; 'modulation' = FLUX.2's conditioning path: the timestep (and
        guidance) embedding, the three shared modulations of the double/single blocks and the output norm's."""
        params = super().configure_trainable(trainable)
        if trainable == "modulation":
            self.net.requires_grad_(False)
            for name in FLUX2_MODULATION:
                getattr(self.net, name).requires_grad_(True)
            params = self.trainable_parameters()
        return params

    # ------------------------------------------------------------------------------------------- packing
    def pack(self, z: Tensor) -> Tensor:
        """(B, 4C, h/2, w/2) patchified, normalised latents (the pipelines' `latents=`) → (B, L, 4C) tokens."""
        return self._pipe._pack_latents(z)

    def unpack(self, x: Tensor) -> Tensor:
        """(B, L, 4C) tokens → (B, 4C, h/2, w/2) (the row-major order of `_unpack_latents_with_ids`)."""
        B, L, D = x.shape
        n = self.grid_side
        return x.permute(0, 2, 1).reshape(B, D, n, n)

    def to_vae_latents(self, x: Tensor) -> Tensor:
        """(B, L, 4C) tokens → the (B, C, h, w) VAE latents the pipelines decode: unpack, undo the VAE's batch-norm
        normalisation (x·sqrt(var + eps) + mean), unpatchify."""
        z = self.unpack(x)
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(z.device, z.dtype)
        return self._pipe._unpatchify_latents(z * std + mean)

    _unpack = to_vae_latents

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """(B, L, 4C) → (B, 3, H, W) fp32 images in [0, 1], as the pipelines' `output_type="pt"`: to_vae_latents →
        vae.decode → (x / 2 + 0.5).clamp(0, 1); in chunks of `decode_batch_size`."""
        vdt = self.vae.dtype
        out = []
        for s in range(0, x0.shape[0], self.decode_batch_size):
            z = self.to_vae_latents(x0[s : s + self.decode_batch_size].to(self.device).float())
            img = self.vae.decode(z.to(vdt), return_dict=False)[0]
            out.append((img.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out)

    # ------------------------------------------------------------------------------------------- protocol
    def _encode_uncached(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, _text_ids = self._pipe.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1, max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": pe}

    def _text_ids(self, length: int, device: torch.device) -> Tensor:
        key = (length, str(device))
        if key not in self._txt_ids:
            self._txt_ids[key] = self._pipe._prepare_text_ids(torch.zeros(1, length, 1))[0].to(device)
        return self._txt_ids[key]

    def _forward(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        B = x_t.shape[0]
        pe = cond["prompt_embeds"]
        guidance = None
        if self.embedded_guidance is not None:  # Flux2Pipeline passes it always (ignored without the embedding)
            guidance = torch.full((B,), self.embedded_guidance, dtype=torch.float32, device=x_t.device)
        return self.net(
            hidden_states=x_t,
            timestep=(t * 1000.0) / 1000.0,  # the pipelines: (scheduler.timesteps = σ·1000) / 1000
            guidance=guidance,
            encoder_hidden_states=pe,
            txt_ids=self._text_ids(pe.shape[1], x_t.device),
            img_ids=self.img_ids,
            return_dict=False,
        )[0]

    # ------------------------------------------------------------------------------------------- schedule
    def mu(self, num_steps: int) -> float:
        """The pipelines' empirical shift exponent for this image size and `num_steps` (compute_empirical_mu)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return float(compute_empirical_mu(image_seq_len=self.latent_shape[0], num_steps=int(num_steps)))

    def equivalent_shift(self, num_steps: int) -> float:
        """The SD3-style shift of the uniform grid that reproduces `time_grid(num_steps)` (to float32 rounding):
        exp(mu) under the scheduler's dynamic exponential shift, else its static `shift`."""
        c = self.scheduler.config
        if c.get("use_dynamic_shifting", False):
            if c.get("time_shift_type", "exponential") != "exponential":
                raise ValueError("equivalent_shift: the scheduler's time_shift_type is not exponential")
            return math.exp(self.mu(num_steps))
        return float(c.get("shift", 1.0))

    def time_grid(self, num_steps: int) -> Tensor:
        """The scheduler's sigmas for `num_inference_steps=num_steps`, set as Flux2Pipeline / Flux2KleinPipeline set
        them (sigmas = linspace(1, 1/T, T), mu = compute_empirical_mu(L, T)), with the final 0: (T+1,) 1 → 0."""
        sched = copy.deepcopy(self.scheduler)
        mu = self.mu(num_steps)
        if sched.config.get("use_flow_sigmas", False):  # the pipelines then let the scheduler choose the sigmas
            sched.set_timesteps(num_steps, device="cpu", mu=mu)
        else:
            sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", mu=mu)
        return sched.sigmas.detach().clone().float()

    def pipeline_kwargs(self, cfg_scale: float = 1.0) -> dict[str, Any]:
        """Arguments that make the pipeline's `__call__` match this adapter sampling with CFG `cfg_scale`
        (Flux2Pipeline: `guidance_scale` is the embedded guidance and there is no CFG, so cfg_scale must be 1)."""
        if cfg_scale != 1.0:
            raise ValueError(
                f"cfg_scale={cfg_scale}: Flux2Pipeline has no true CFG (FLUX.2 [dev] is guidance-distilled; its "
                "guidance_scale is the embedded guidance, model.options.embedded_guidance)"
            )
        return {
            "height": self.resolution,
            "width": self.resolution,
            "max_sequence_length": self.max_sequence_length,
            "guidance_scale": self.embedded_guidance,
        }

    def describe(self) -> dict:
        d = super().describe()
        d["variant"] = self.variant
        d["embedded_guidance"] = self.embedded_guidance
        return d


class Flux2KleinFlowModel(Flux2FlowModel):
    """FLUX.2 [klein] adapter (Flux2KleinPipeline: Qwen3 text encoder, no guidance embedding, true CFG)."""

    variant = "klein"
    pipeline_name = PIPELINES["klein"]

    def _guidance_value(self, embedded_guidance: float | None) -> float | None:
        return None  # Flux2KleinPipeline calls the transformer with guidance=None

    @property
    def is_distilled(self) -> bool:
        """The step-distilled klein (4 steps, no CFG): the pipeline then ignores guidance_scale."""
        return bool(self._pipe.config.get("is_distilled", False))

    def pipeline_kwargs(self, cfg_scale: float = 1.0) -> dict[str, Any]:
        """Arguments that make Flux2KleinPipeline's `__call__` match this adapter sampling with CFG `cfg_scale` (its
        `guidance_scale` is true CFG against the empty prompt; the pipeline's default is 4.0, so it is always set)."""
        if cfg_scale != 1.0 and self.is_distilled:
            raise ValueError(f"cfg_scale={cfg_scale}: this FLUX.2 [klein] is step-distilled; its pipeline ignores CFG")
        return {
            "height": self.resolution,
            "width": self.resolution,
            "max_sequence_length": self.max_sequence_length,
            "guidance_scale": float(cfg_scale),
        }

    def describe(self) -> dict:
        d = super().describe()
        d["is_distilled"] = self.is_distilled
        return d
