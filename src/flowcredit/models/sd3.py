"""Stable Diffusion 3 / 3.5 behind the FlowModel protocol (diffusers' StableDiffusion3Pipeline components).

    model = SD3FlowModel.from_pretrained("path/to/stable-diffusion-3.5-medium", ModelCfg(name="sd3", trainable="lora"))

Conventions (checked against the pipeline in tests/models/test_sd3.py, max |Δ| ≤ 1e-5 on tiny components):
  * latent: (C, H/8, W/8) VAE latents after the pipeline's scaling (z = (vae_latent − shift_factor)·scaling_factor),
    exactly the `latents` of `StableDiffusion3Pipeline.__call__`;
  * time: our t is the scheduler's sigma; the transformer is called with `timestep = 1000·t` (the pipeline passes
    `scheduler.timesteps = sigmas·num_train_timesteps`);
  * velocity: the transformer output is used as is. FlowMatchEulerDiscreteScheduler.step does
    `x_next = x + (σ_next − σ)·model_output`, our ODE step does `x + (t_next − t)·v`, so model_output IS our
    v = x1 − x0 (no sign flip);
  * CFG: the pipeline runs [negative ""; prompt] in one batch and mixes `u + w·(c − u)`, as `policy_velocity`;
  * prompts: `StableDiffusion3Pipeline.encode_prompt` (CLIP-L + CLIP-G penultimate hidden states concatenated and
    zero-padded to T5's width, then T5; pooled = both CLIP projections), T5 length `max_sequence_length`.

LoRA: peft on flow_grpo's attention projections (`attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,
to_add_out}`, ALGORITHMS.md §3.3). The `attn.` prefix leaves SD3.5's second self-attention `attn2` untouched, as
flow_grpo's scripts/train_sd3.py does.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import Tensor

from ..types import Cond
from .diffusers_common import DiffusersFlowModel

# component → a file that must exist in its subfolder (the layout of StableDiffusion3Pipeline.save_pretrained)
SD3_COMPONENTS = {
    "transformer": "config.json",
    "vae": "config.json",
    "text_encoder": "config.json",
    "text_encoder_2": "config.json",
    "text_encoder_3": "config.json",
    "tokenizer": "",
    "tokenizer_2": "",
    "tokenizer_3": "",
    "scheduler": "scheduler_config.json",
}

SD3_LORA_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)


class SD3FlowModel(DiffusersFlowModel):
    """SD3/SD3.5 adapter. Cond = {"prompt_embeds": (B, 77 + L_t5, D), "pooled": (B, 2048)} (sizes for SD3.5)."""

    family = "sd3"
    pipeline_name = "StableDiffusion3Pipeline"
    default_lora_targets = SD3_LORA_TARGETS
    default_max_sequence_length = 256  # StableDiffusion3Pipeline.__call__ default

    def __init__(self, pipe, cfg, *, resolution: int | None = None, max_sequence_length: int | None = None,
                 cache_size: int = 256, decode_batch_size: int = 8):
        super().__init__(pipe, cfg, max_sequence_length=max_sequence_length, cache_size=cache_size,
                         decode_batch_size=decode_batch_size)
        vsf = pipe.vae_scale_factor
        patch = self.net.config.patch_size
        self.resolution = int(resolution or self.net.config.sample_size * vsf)
        if self.resolution % (vsf * patch) != 0:
            raise ValueError(
                f"model resolution {self.resolution} must be a multiple of {vsf * patch} (VAE factor {vsf} × patch "
                f"{patch})"
            )
        self.latent_shape = (self.net.config.in_channels, self.resolution // vsf, self.resolution // vsf)

    @staticmethod
    def _t5_tokenizer_max(pipe) -> int | None:
        tok = getattr(pipe, "tokenizer_3", None)
        return int(tok.model_max_length) if tok is not None and tok.model_max_length < 10**6 else None

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg=None, **kwargs) -> SD3FlowModel:
        """Load from a local diffusers folder (checked: a missing component is named) or a hub id.

        Args:
            path: folder with model_index.json, transformer/, vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/,
                scheduler/; or a hub id (downloading is the caller's business; tests never do it).
            cfg: a ModelCfg (precision, trainable, LoRA settings, gradient checkpointing); default
                ModelCfg(name="sd3").
            **kwargs: resolution, max_sequence_length, cache_size, decode_batch_size.
        """
        from ..config.schema import ModelCfg

        cfg = copy.deepcopy(cfg) if cfg is not None else ModelCfg(name="sd3")
        cfg.path = str(path)
        pipe = cls._load_pipeline(str(path), cfg, SD3_COMPONENTS)
        return cls(pipe, cfg, **kwargs)

    # ------------------------------------------------------------------------------------------- protocol
    def _encode_uncached(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, _, pooled, _ = self._pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": pe, "pooled": pooled}

    def _forward(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        return self.net(
            hidden_states=x_t,
            timestep=t * 1000.0,  # = scheduler.timesteps (sigmas · num_train_timesteps), same fp32 product
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled"],
            return_dict=False,
        )[0]

    def time_grid(self, num_steps: int) -> Tensor:
        """The scheduler's sigmas for `num_inference_steps=num_steps` (T+1 values, 1 → 0), computed the way
        `StableDiffusion3Pipeline.__call__` asks for them (with `mu` when the scheduler shifts dynamically).
        Agrees with `samplers.schedules.time_grid(T, shift, "diffusers")` to float32 rounding."""
        sched = copy.deepcopy(self.scheduler)
        kw = {}
        if sched.config.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            p = self.net.config.patch_size
            seq = (self.latent_shape[1] // p) * (self.latent_shape[2] // p)
            c = sched.config
            kw["mu"] = calculate_shift(
                seq,
                c.get("base_image_seq_len", 256),
                c.get("max_image_seq_len", 4096),
                c.get("base_shift", 0.5),
                c.get("max_shift", 1.16),
            )
        sched.set_timesteps(num_steps, device="cpu", **kw)
        return sched.sigmas.detach().clone().float()

    def pipeline_kwargs(self) -> dict:
        """Arguments that make `StableDiffusion3Pipeline.__call__` match this adapter (height, width, T5 length)."""
        return {"height": self.resolution, "width": self.resolution, "max_sequence_length": self.max_sequence_length}
