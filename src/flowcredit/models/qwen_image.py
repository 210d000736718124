"""Qwen-Image behind the FlowModel protocol (diffusers' QwenImagePipeline components).

    model = QwenImageFlowModel.from_pretrained("path/to/Qwen-Image", ModelCfg(name="qwen_image", trainable="lora"),
                                               resolution=512, true_cfg_scale=4.0)

Components: QwenImageTransformer2DModel (a 60-block dual-stream MMDiT), AutoencoderKLQwenImage (a Wan-style causal 3-D
VAE, 16 latent channels, factor 8), Qwen2.5-VL-7B-Instruct as the text encoder (Qwen2Tokenizer), and
FlowMatchEulerDiscreteScheduler with a resolution-dependent ("dynamic") shift and a terminal stretch.

Latent layout: the protocol's latent is the PACKED token sequence (L, D) = (h/2·w/2, 4·C) that QwenImagePipeline
iterates on (`QwenImagePipeline._pack_latents`: 2×2 patches of the C-channel VAE latent, the FLUX order);
`decode` unpacks it (`_unpack_latents`, a one-frame video latent (B, C, 1, h, w)) and `pack`/`unpack` are public.

Conventions (checked against QwenImagePipeline in tests/models/test_qwen_image.py on tiny components, fp32):
  * time: our t is the scheduler's sigma; QwenImagePipeline passes `timestep = (sigma·1000)/1000` to the transformer,
    we form the same fp32 expression;
  * velocity: the transformer output is v = x1 − x0 (FlowMatchEulerDiscreteScheduler.step: x + (σ_next − σ)·out);
  * guidance: Qwen-Image is NOT guidance-distilled; QwenImagePipeline runs TRUE classifier-free guidance with a
    negative prompt and rescales the mix per token to the conditional prediction's norm:
        c, u = v(prompt), v(negative);  m = u + w·(c − u);  v = m · ‖c‖ / ‖m‖   (norms over the channel dim)
    This form is not the linear CFG of `samplers.policy.policy_velocity`, so this adapter applies it INSIDE
    `velocity` with `true_cfg_scale` w and `negative_prompt` (model options, the pipeline's `true_cfg_scale` and
    `negative_prompt`; flow_grpo's scripts/train_qwenimage.py trains with w = 4 and the negative prompt " ", in the
    rollout AND the loss). flowcredit's own CFG (sampler.guidance_scale, run.eval_guidance, `--cfg`) must stay 1.0
    with this family: asking for the "" unconditional prompt while true_cfg_scale > 1 is a one-line error. With
    true_cfg_scale = 1 (the default: QwenImagePipeline without a negative prompt) the model is called once per step;
  * time grid: `time_grid(T)` is the scheduler's own sigmas for QwenImagePipeline's `sigmas = linspace(1, 1/T, T)`
    and mu = calculate_shift(L) (Qwen-Image: base_shift 0.5, max_shift 0.9, 256 → 8192 tokens, exponential shift,
    then the terminal stretch that makes the last non-zero sigma `shift_terminal` = 0.02). The trainer's grid
    (`samplers.schedules.time_grid(T, shift, "uniform")` with shift = `equivalent_shift` = exp(mu)) is the same grid
    WITHOUT the terminal stretch; evaluation (`eval/evaluate.py`) uses `time_grid`;
  * prompts: `QwenImagePipeline.encode_prompt` (the chat template, the last hidden state of Qwen2.5-VL with the 34
    template tokens dropped, right-padded with zeros to the longest prompt of the batch, truncated to
    `max_sequence_length`). Prompts are cached unpadded and padded per batch, with `prompt_mask`; the transformer
    gets the mask (None when it is all ones, as the pipeline passes it).

LoRA: flow_grpo's scripts/train_qwenimage.py targets (attention projections of both streams + both MLPs).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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
class QwenImageOptions(DiffusersOptions):
    """`model.options` of qwen_image: the diffusers options + QwenImagePipeline's true CFG."""

    true_cfg_scale: float = field(
        default=1.0,
        metadata={"help": "QwenImagePipeline's true CFG scale with the norm rescale, applied inside the model "
                          "(flow_grpo: 4.0); 1 = no CFG. Keep sampler.guidance_scale at 1.0 with qwen_image.",
                  "ge": 1},
    )
    negative_prompt: str = field(
        default=" ",
        metadata={"help": "Negative prompt of the true CFG (flow_grpo and the Qwen-Image model card: ' ')."},
    )


QWEN_IMAGE_COMPONENTS = ONE_TEXT_ENCODER_COMPONENTS

# flow_grpo scripts/train_qwenimage.py (LoRA r64/α128)
QWEN_IMAGE_LORA_TARGETS = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
)

# transformer config keys of the other Qwen-Image variants (edit / layered / distilled), which QwenImagePipeline
# (text-to-image) does not drive the same way
_UNSUPPORTED = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


class QwenImageFlowModel(DiffusersFlowModel):
    """Qwen-Image adapter. Cond = {"prompt_embeds": (B, L, 3584), "prompt_mask": (B, L)} and, when
    true_cfg_scale > 1, {"negative_embeds": (B, L_neg, 3584), "negative_mask": (B, L_neg)} (sizes for Qwen-Image;
    L = the longest prompt of the encoded batch)."""

    family = "qwen_image"
    pipeline_name = "QwenImagePipeline"
    default_lora_targets = QWEN_IMAGE_LORA_TARGETS
    default_max_sequence_length = 512  # QwenImagePipeline.__call__ default

    def __init__(self, pipe, cfg, *, resolution: int | None = None, true_cfg_scale: float = 1.0,
                 negative_prompt: str = " ", max_sequence_length: int | None = None, cache_size: int = 256,
                 decode_batch_size: int = 8):
        tc = pipe.transformer.config
        bad = [k for k in _UNSUPPORTED if tc.get(k, False)]
        if bad:
            raise ValueError(
                f"model.name=qwen_image: the transformer sets {', '.join(bad)} (an edit / layered / distilled "
                "Qwen-Image variant); this adapter drives the text-to-image QwenImagePipeline"
            )
        if max_sequence_length is not None and max_sequence_length > 1024:
            raise ValueError(f"model.options.max_sequence_length={max_sequence_length}; QwenImagePipeline takes at "
                             "most 1024 prompt tokens")
        super().__init__(pipe, cfg, max_sequence_length=max_sequence_length, cache_size=cache_size,
                         decode_batch_size=decode_batch_size)
        vsf = pipe.vae_scale_factor
        self.resolution = int(resolution or pipe.default_sample_size * vsf)
        if self.resolution % (vsf * 2) != 0:
            raise ValueError(
                f"model resolution {self.resolution} must be a multiple of {vsf * 2} (VAE factor {vsf} × 2×2 packing)"
            )
        self.latent_hw = 2 * (self.resolution // (vsf * 2))  # QwenImagePipeline.prepare_latents
        self.latent_channels = self.net.config.in_channels // 4
        n = self.latent_hw // 2
        self.latent_shape = (n * n, self.latent_channels * 4)
        if true_cfg_scale < 1:
            raise ValueError(f"model.options.true_cfg_scale={true_cfg_scale}; it must be >= 1 (1 = no CFG)")
        self.true_cfg_scale = float(true_cfg_scale)
        self.negative_prompt = str(negative_prompt)

    @staticmethod
    def _t5_tokenizer_max(pipe) -> int | None:
        return int(getattr(pipe, "tokenizer_max_length", 1024))  # QwenImagePipeline refuses more than 1024

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg=None, **kwargs) -> QwenImageFlowModel:
        """Load from a local diffusers folder (checked: a missing component is named) or a hub id.

        Args:
            path: folder with model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/.
            cfg: a ModelCfg; default ModelCfg(name="qwen_image").
            **kwargs: resolution, true_cfg_scale, negative_prompt, max_sequence_length, cache_size,
                decode_batch_size.
        """
        from ..config.schema import ModelCfg

        cfg = copy.deepcopy(cfg) if cfg is not None else ModelCfg(name="qwen_image")
        cfg.path = str(path)
        pipe = cls._load_pipeline(str(path), cfg, QWEN_IMAGE_COMPONENTS)
        return cls(pipe, cfg, **kwargs)

    @property
    def cfg_active(self) -> bool:
        """True when `velocity` runs the pipeline's true CFG (true_cfg_scale > 1)."""
        return self.true_cfg_scale > 1.0

    # ------------------------------------------------------------------------------------------- training
    def configure_trainable(self, trainable: str) -> list[nn.Parameter]:
        """As DiffusersFlowModel; 'modulation' also trains every block's `img_mod` / `txt_mod` (Qwen-Image's
        per-block adaLN projections are plain Linear layers, not AdaLayerNorm modules)."""
        params = super().configure_trainable(trainable)
        if trainable == "modulation":
            for name, mod in self.net.named_modules():
                if name.endswith((".img_mod", ".txt_mod")):
                    mod.requires_grad_(True)
            params = self.trainable_parameters()
        return params

    # ------------------------------------------------------------------------------------------- packing
    def pack(self, z: Tensor) -> Tensor:
        """(B, C, h, w) VAE latents → (B, L, 4C) tokens (QwenImagePipeline._pack_latents order)."""
        return self._pipe._pack_latents(z, z.shape[0], z.shape[1], z.shape[2], z.shape[3])

    def unpack(self, x: Tensor) -> Tensor:
        """(B, L, 4C) tokens → (B, C, h, w) VAE latents (QwenImagePipeline._unpack_latents order, no frame dim)."""
        B, L, D = x.shape
        n = self.latent_hw // 2
        return x.view(B, n, n, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, D // 4, 2 * n, 2 * n)

    _unpack = unpack

    # ------------------------------------------------------------------------------------------- prompts
    def _encode_uncached(self, prompts: list[str]) -> dict[str, Tensor]:
        """The pipeline's `encode_prompt` → {"embeds": (n, L, D), "lengths": (n,)} (valid tokens of each prompt)."""
        pe, mask = self._pipe.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1, max_sequence_length=self.max_sequence_length
        )
        n, L = pe.shape[:2]
        lengths = mask.sum(1) if mask is not None else torch.full((n,), L, device=pe.device)
        return {"embeds": pe, "lengths": lengths}

    def _rows(self, prompts: Sequence[str]) -> list[Tensor]:
        """One (L_i, D) embedding per prompt (its valid tokens), through the LRU prompt cache."""
        todo = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        fresh: dict[str, Tensor] = {}
        if todo:
            with torch.no_grad():
                enc = self._encode_uncached(todo)
            for i, p in enumerate(todo):
                fresh[p] = enc["embeds"][i, : int(enc["lengths"][i])].clone()
        rows = []
        for p in prompts:
            if p in fresh:
                rows.append(fresh[p])
            else:
                self._cache.move_to_end(p)
                rows.append(self._cache[p]["embeds"])
        if self.cache_size > 0:
            for p, r in fresh.items():
                self._cache[p] = {"embeds": r}
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return rows

    @staticmethod
    def _padded(rows: Sequence[Tensor], length: int | None = None) -> tuple[Tensor, Tensor]:
        """Zero-pad (L_i, D) rows to (B, L, D) + the (B, L) int64 mask, as the pipeline's _get_qwen_prompt_embeds."""
        L = max(r.shape[0] for r in rows) if length is None else length
        emb = torch.stack([torch.cat([r, r.new_zeros(L - r.shape[0], r.shape[1])]) for r in rows])
        mask = torch.stack(
            [torch.cat([r.new_ones(r.shape[0], dtype=torch.long), r.new_zeros(L - r.shape[0], dtype=torch.long)])
             for r in rows]
        )
        return emb, mask

    def encode_prompts(self, prompts: Sequence[str]) -> Cond:
        """Encode B prompts with the pipeline's own `encode_prompt` (cached per prompt), padded to the longest; with
        true_cfg_scale > 1 also the negative prompt, one row per sample.

        Raises:
            ValueError: "" (flowcredit's unconditional prompt) is asked for while the model applies its own true
                CFG: sampler.guidance_scale / run.eval_guidance / --cfg must be 1.0 for qwen_image.
        """
        prompts = list(prompts)
        if self.cfg_active and "" in prompts:
            raise ValueError(
                f"model.name=qwen_image applies QwenImagePipeline's true CFG itself (model.options.true_cfg_scale="
                f"{self.true_cfg_scale}, negative_prompt={self.negative_prompt!r}); flowcredit's linear CFG would "
                "guide twice: set sampler.guidance_scale=1.0 and run.eval_guidance=1.0 (flowcredit sample/eval: "
                "--cfg 1)"
            )
        pe, pm = self._padded(self._rows(prompts))
        cond = {"prompt_embeds": pe, "prompt_mask": pm}
        if self.cfg_active:
            ne, nm = self._padded(self._rows([self.negative_prompt]) * len(prompts))
            cond.update(negative_embeds=ne, negative_mask=nm)
        return cond

    # ------------------------------------------------------------------------------------------- forward
    def _transformer(self, x_t: Tensor, t: Tensor, pe: Tensor, mask: Tensor) -> Tensor:
        n = self.latent_hw // 2
        return self.net(
            hidden_states=x_t,
            timestep=(t * 1000.0) / 1000.0,  # QwenImagePipeline: (scheduler.timesteps = σ·1000) / 1000
            guidance=None,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask,  # encode_prompt: None when all valid
            encoder_hidden_states=pe,
            img_shapes=[[(1, n, n)]] * x_t.shape[0],
            return_dict=False,
        )[0]

    def _forward(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        pe, pm = cond["prompt_embeds"], cond["prompt_mask"]
        if not self.cfg_active:
            return self._transformer(x_t, t, pe, pm)
        if "negative_embeds" not in cond:
            raise ValueError("qwen_image: true_cfg_scale > 1 but the conditioning has no negative prompt; encode it "
                             "with this model's encode_prompts")
        ne, nm = cond["negative_embeds"], cond["negative_mask"]
        L = max(pe.shape[1], ne.shape[1])
        pad = lambda e, m: (torch.nn.functional.pad(e, (0, 0, 0, L - e.shape[1])),  # noqa: E731
                            torch.nn.functional.pad(m, (0, L - m.shape[1])))
        (pe, pm), (ne, nm) = pad(pe, pm), pad(ne, nm)
        # one batched call on [prompt; negative] (flow_grpo's form; the pipeline makes two calls: same values)
        out = self._transformer(torch.cat([x_t, x_t]), torch.cat([t, t]), torch.cat([pe, ne]), torch.cat([pm, nm]))
        c, u = out.float().chunk(2)
        return self.combine_true_cfg(c, u, self.true_cfg_scale)

    @staticmethod
    def combine_true_cfg(v_cond: Tensor, v_neg: Tensor, scale: float) -> Tensor:
        """QwenImagePipeline's true CFG: m = u + w·(c − u), rescaled per token to ‖c‖ (norms over the last dim)."""
        comb = v_neg + scale * (v_cond - v_neg)
        return comb * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """(B, L, D) packed latents → (B, 3, H, W) fp32 images in [0, 1], VAE-decoded in chunks of `decode_batch_size`.

        Same arithmetic as QwenImagePipeline's `output_type="pt"`: unpack to a one-frame latent, z / (1/std) + mean →
        vae.decode → first frame → (x / 2 + 0.5).clamp(0, 1).
        """
        vc = self.vae.config
        vdt = self.vae.dtype
        out = []
        for s in range(0, x0.shape[0], self.decode_batch_size):
            z = self.unpack(x0[s : s + self.decode_batch_size].to(self.device)).unsqueeze(2).to(vdt)
            mean = torch.tensor(vc.latents_mean).view(1, vc.z_dim, 1, 1, 1).to(z.device, z.dtype)
            std_inv = 1.0 / torch.tensor(vc.latents_std).view(1, vc.z_dim, 1, 1, 1).to(z.device, z.dtype)
            img = self.vae.decode(z / std_inv + mean, return_dict=False)[0][:, :, 0]
            out.append((img.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out)

    # ------------------------------------------------------------------------------------------- schedule
    @property
    def mu(self) -> float:
        """QwenImagePipeline's resolution-dependent shift exponent for this image size (calculate_shift)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        return dynamic_shift_mu(self.scheduler, self.latent_shape[0], calculate_shift)

    @property
    def equivalent_shift(self) -> float:
        """The SD3-style shift of the dynamic-shift grid, exp(mu) (the scheduler's shift if static). The scheduler's
        terminal stretch (`shift_terminal`, Qwen-Image 0.02) comes on top and has no shift equivalent."""
        return shift_of(self.scheduler, lambda: self.mu)

    def time_grid(self, num_steps: int) -> Tensor:
        """The scheduler's sigmas for `num_inference_steps=num_steps` as QwenImagePipeline.__call__ sets them."""
        sched = copy.deepcopy(self.scheduler)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        sched.set_timesteps(sigmas=sigmas, device="cpu", mu=self.mu)  # the pipeline always passes mu
        return sched.sigmas.detach().clone().float()

    def pipeline_kwargs(self, batch_size: int | None = None) -> dict[str, Any]:
        """Arguments that make `QwenImagePipeline.__call__` match this adapter. With true CFG the negative prompt is
        given once per sample (`batch_size` prompts; QwenImagePipeline does not repeat a single negative prompt)."""
        kw: dict[str, Any] = {
            "height": self.resolution,
            "width": self.resolution,
            "max_sequence_length": self.max_sequence_length,
        }
        if self.cfg_active:
            neg = self.negative_prompt
            kw.update(true_cfg_scale=self.true_cfg_scale, negative_prompt=[neg] * batch_size if batch_size else neg)
        return kw

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["true_cfg_scale"] = self.true_cfg_scale
        d["negative_prompt"] = self.negative_prompt
        d["equivalent_shift"] = self.equivalent_shift
        d["shift_terminal"] = self.scheduler.config.get("shift_terminal")
        return d
