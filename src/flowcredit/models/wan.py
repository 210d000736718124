"""Wan 2.1 / Wan 2.2 TI2V-5B text-to-video behind the FlowModel protocol (diffusers' WanPipeline components).

    model = WanFlowModel.from_pretrained("path/to/Wan2.1-T2V-1.3B-Diffusers", ModelCfg(name="wan", trainable="lora"),
                                         height=240, width=416, num_frames=33)

Components: WanTransformer3DModel, AutoencoderKLWan (causal 3-D VAE), a UMT5 text encoder and its tokenizer, the
scheduler. Latent layout: the protocol latent is the pipeline's own 5-D video latent without the batch,
(C, F, h, w) = (z_dim, (num_frames − 1)/4 + 1, H/vsf, W/vsf) (vsf = 8 for Wan 2.1, 16 for Wan 2.2 TI2V-5B), exactly
the `latents` of `WanPipeline.__call__`. The samplers, credit, objectives and the trainer are shape-generic, so nothing
else knows; `decode` returns FRAMES (B, num_frames, 3, H, W) in [0, 1] (the pipeline's `output_type="pt"`), which
`FrameMeanReward` (below) scores with any image reward, frame by frame, averaged per sample.

Conventions (checked against WanPipeline in tests/models/test_wan.py on tiny components, fp32):
  * time: our t is the scheduler's sigma; the transformer gets `timestep = 1000·t` (= the scheduler's timesteps).
    Wan 2.2 TI2V-5B (`expand_timesteps=True`): one timestep per latent token, (B, F·h/2·w/2), all equal to 1000·t in
    text-to-video (the pipeline's mask is all ones);
  * velocity: the transformer output as is (FlowMatchEulerDiscreteScheduler.step: x + (σ_next − σ)·out);
  * scheduler: the hub folders ship `UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=s)` (s = 3.0 for
    Wan 2.1 T2V, 5.0 for TI2V-5B; diffusers scripts/convert_wan_to_diffusers.py). UniPC is a multistep solver that no
    Euler / SDE step reproduces, so the adapter replaces it (in its pipeline too) by the flow-matching Euler scheduler
    the pipeline also accepts, `FlowMatchEulerDiscreteScheduler(shift=s)`; `time_grid(T)` returns its sigmas (=
    `samplers.schedules.time_grid(T, s, "diffusers")`). To reproduce flowcredit's samples with the stock pipeline,
    set `pipe.scheduler = model.euler_scheduler()` (the export records the scheduler);
  * CFG: WanPipeline runs the prompt and the negative prompt ("" by default) in two calls and mixes u + w·(c − u);
    `policy_velocity` batches the two (max |Δ| 2.3e-6, 4e-7 relative, on the tiny test components);
  * prompts: `WanPipeline.encode_prompt` (UMT5 last hidden state, cut at the prompt's length and zero-padded to
    `max_sequence_length`, 512 by default).

LoRA: flow_grpo's scripts/train_wan2_1.py targets (`to_q`, `to_k`, `to_v`, `to_out.0` of the self- and the
cross-attention; `add_k_proj`/`add_v_proj`/`add_q_proj`/`to_add_out` of its list exist only in the image-to-video
models). Export: `flowcredit export` writes the LoRA with `WanPipeline.save_lora_weights`;
`WanPipeline.load_lora_weights` loads it.

Not supported: Wan 2.2 A14B (two experts `transformer` / `transformer_2` switched at `boundary_ratio`): refused in one
line before anything is loaded (what it needs: docs/REAL_MODELS.md, "Wan").
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..types import Cond
from .diffusers_common import ONE_TEXT_ENCODER_COMPONENTS, DiffusersFlowModel, check_model_dir, looks_like_hub_id


@dataclass
class WanOptions:
    """`model.options` of wan: the clip size and the text length (the trainer samples every rollout at this size)."""

    height: int | None = field(
        default=None, metadata={"help": "Frame height in pixels; null = 480 (WanPipeline's default).", "ge": 1}
    )
    width: int | None = field(
        default=None, metadata={"help": "Frame width in pixels; null = 832 (WanPipeline's default).", "ge": 1}
    )
    num_frames: int | None = field(
        default=None,
        metadata={"help": "Frames per clip, 4k+1 (the VAE's temporal factor 4); null = 81 (WanPipeline's default).",
                  "ge": 1},
    )
    max_sequence_length: int | None = field(
        default=None, metadata={"help": "UMT5 prompt tokens; null = 512 (WanPipeline's default).", "ge": 1}
    )
    flow_shift: float | None = field(
        default=None,
        metadata={"help": "Shift of the Euler flow-matching scheduler that replaces the hub's UniPC; null = the "
                          "folder's scheduler shift (UniPC flow_shift: 3.0 Wan 2.1, 5.0 TI2V-5B).", "gt": 0},
    )

    def kwargs(self) -> dict[str, Any]:
        """The options that are set, as keyword arguments of `WanFlowModel.from_pretrained`."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


# component → a file that must exist in its subfolder (the layout of WanPipeline.save_pretrained / the hub repos)
WAN_COMPONENTS = ONE_TEXT_ENCODER_COMPONENTS

# flow_grpo scripts/train_wan2_1.py `target_modules` (names without a prefix: self- and cross-attention alike)
WAN_LORA_TARGETS = ("add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v")

DEFAULT_HEIGHT, DEFAULT_WIDTH, DEFAULT_NUM_FRAMES = 480, 832, 81  # WanPipeline.__call__ defaults


class TwoExpertsUnsupported(ValueError):
    """A Wan 2.2 A14B folder (transformer + transformer_2 with boundary_ratio): not supported by this adapter."""


def _two_experts_message(path: str) -> str:
    return (
        f"model.path '{path}' is a two-expert Wan 2.2 model (transformer + transformer_2 switched at boundary_ratio, "
        "e.g. Wan2.2-T2V-A14B); model.name=wan supports the one-transformer models (Wan 2.1 T2V 1.3B/14B, Wan 2.2 "
        "TI2V-5B); see docs/REAL_MODELS.md, section Wan"
    )


def _check_one_expert(path: str) -> None:
    """Refuse a local folder whose model_index.json names a transformer_2 or a boundary_ratio (before loading)."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return
    try:
        doc = json.loads(index.read_text())
    except (OSError, ValueError):
        return
    t2 = doc.get("transformer_2")
    if (isinstance(t2, list) and any(t2)) or doc.get("boundary_ratio") is not None:
        raise TwoExpertsUnsupported(_two_experts_message(path))


def euler_scheduler_for(scheduler, flow_shift: float | None = None):
    """The `FlowMatchEulerDiscreteScheduler` flowcredit samples with for a Wan folder's `scheduler`.

    A FlowMatchEulerDiscreteScheduler is kept (re-shifted if `flow_shift` is given); a UniPC / DPM flow scheduler
    (the hub's) is replaced by the Euler one with its `flow_shift` and `num_train_timesteps`.

    Raises:
        ValueError: the scheduler shifts dynamically (WanPipeline passes no `mu`), or has no flow shift to take.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    c = scheduler.config
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        if c.get("use_dynamic_shifting", False):
            raise ValueError("the Wan folder's FlowMatchEulerDiscreteScheduler shifts dynamically, which WanPipeline "
                             "does not support (it passes no mu); set use_dynamic_shifting=false")
        if flow_shift is None or float(flow_shift) == float(c.shift):
            return scheduler
        return FlowMatchEulerDiscreteScheduler.from_config(c, shift=float(flow_shift))
    shift = flow_shift if flow_shift is not None else c.get("flow_shift")
    if shift is None:
        raise ValueError(f"the Wan folder's {type(scheduler).__name__} has no flow_shift; set "
                         "model.options.flow_shift")
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=int(c.get("num_train_timesteps", 1000)),
                                           shift=float(shift))


class WanFlowModel(DiffusersFlowModel):
    """Wan adapter. Cond = {"prompt_embeds": (B, L, 4096)} (L = max_sequence_length; 4096 = UMT5-XXL width).

    Attributes (besides DiffusersFlowModel's):
        height, width, num_frames: the clip size in pixels / frames.
        latent_shape: (C, F, h, w) = (z_dim, (num_frames − 1)/4 + 1, height/vsf, width/vsf).
        expand_timesteps: Wan 2.2 TI2V-5B's per-token timesteps.
    """

    family = "wan"
    pipeline_name = "WanPipeline"
    default_lora_targets = WAN_LORA_TARGETS
    default_max_sequence_length = 512  # WanPipeline.__call__ default (flow_grpo encodes 512 tokens too)

    def __init__(self, pipe, cfg, *, height: int | None = None, width: int | None = None,
                 num_frames: int | None = None, max_sequence_length: int | None = None,
                 flow_shift: float | None = None, cache_size: int = 64, decode_batch_size: int = 1):
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            raise TwoExpertsUnsupported(_two_experts_message(str(cfg.path)))
        if pipe.transformer is None:
            raise ValueError(f"model.path '{cfg.path}': the WanPipeline has no transformer")
        super().__init__(pipe, cfg, max_sequence_length=max_sequence_length, cache_size=cache_size,
                         decode_batch_size=decode_batch_size)
        euler = euler_scheduler_for(pipe.scheduler, flow_shift)
        if euler is not pipe.scheduler:
            pipe.scheduler = euler  # the adapter's pipeline samples as the adapter does
        self.scheduler = euler
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))
        self.height = int(height or DEFAULT_HEIGHT)
        self.width = int(width or DEFAULT_WIDTH)
        self.num_frames = int(num_frames or DEFAULT_NUM_FRAMES)
        vst, vss = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        _, ph, pw = self.net.config.patch_size
        for name, side, mult in (("height", self.height, vss * ph), ("width", self.width, vss * pw)):
            if side % mult != 0:
                raise ValueError(f"model.options.{name}={side} must be a multiple of {mult} (VAE factor {vss} × patch "
                                 f"{mult // vss}; WanPipeline would round it down)")
        if (self.num_frames - 1) % vst != 0:
            raise ValueError(f"model.options.num_frames={self.num_frames} must be {vst}k+1 (the VAE's temporal factor "
                             f"{vst}; WanPipeline would round it)")
        frames = (self.num_frames - 1) // vst + 1
        self.latent_shape = (int(self.net.config.in_channels), frames, self.height // vss, self.width // vss)

    @staticmethod
    def _text_encoder_modules(pipe) -> list[nn.Module | None]:
        return [getattr(pipe, "text_encoder", None)]

    @staticmethod
    def _t5_tokenizer_max(pipe) -> int | None:
        tok = getattr(pipe, "tokenizer", None)
        return int(tok.model_max_length) if tok is not None and tok.model_max_length < 10**6 else None

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg=None, **kwargs) -> WanFlowModel:
        """Load from a local diffusers folder (checked: a missing component is named) or a hub id.

        Args:
            path: folder with model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/ (the layout
                of Wan-AI/Wan2.1-T2V-1.3B-Diffusers); or a hub id (downloading is the caller's business).
            cfg: a ModelCfg; default ModelCfg(name="wan").
            **kwargs: height, width, num_frames, max_sequence_length, flow_shift, cache_size, decode_batch_size.

        Raises:
            ModelLayoutError: a missing component (one line); TwoExpertsUnsupported: a Wan 2.2 A14B folder.
        """
        from ..config.schema import ModelCfg

        cfg = copy.deepcopy(cfg) if cfg is not None else ModelCfg(name="wan")
        cfg.path = str(path)
        if not looks_like_hub_id(str(path)):
            check_model_dir(path, WAN_COMPONENTS, cls.family, cls.pipeline_name)  # the layout first, then experts
            _check_one_expert(str(path))
        pipe = cls._load_pipeline(str(path), cfg, WAN_COMPONENTS)
        return cls(pipe, cfg, **kwargs)

    # ------------------------------------------------------------------------------------------- training
    def configure_trainable(self, trainable: str) -> list[nn.Parameter]:
        """As DiffusersFlowModel, with Wan's module names: 'blocks' = the `blocks` list; 'modulation' = the
        conditioning path: `condition_embedder.time_embedder` / `.time_proj` (timestep → the blocks' adaLN inputs)
        and every `scale_shift_table` (each block's and the output's learned modulation offsets)."""
        if trainable not in ("blocks", "modulation"):
            return super().configure_trainable(trainable)
        if self.has_lora:
            raise ValueError(f"model.trainable={trainable} on a model built with a LoRA adapter; build it with "
                             f"trainable={trainable}")
        net = self.net
        net.requires_grad_(False)
        if trainable == "blocks":
            net.blocks.requires_grad_(True)
        else:
            net.condition_embedder.time_embedder.requires_grad_(True)
            net.condition_embedder.time_proj.requires_grad_(True)
            for name, p in net.named_parameters():
                if name == "scale_shift_table" or name.endswith(".scale_shift_table"):
                    p.requires_grad_(True)
        return self.trainable_parameters()

    # ------------------------------------------------------------------------------------------- protocol
    def _encode_uncached(self, prompts: list[str]) -> dict[str, Tensor]:
        pe, _ = self._pipe.encode_prompt(
            prompt=prompts, negative_prompt=None, do_classifier_free_guidance=False, num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length, device=self.device,
        )
        return {"prompt_embeds": pe}

    def _forward(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        timestep = t * 1000.0  # = scheduler.timesteps (sigmas · num_train_timesteps), the same fp32 product
        if self.expand_timesteps:  # Wan 2.2 TI2V-5B: (B, tokens), the pipeline's `mask[0][0][:, ::2, ::2] * t`
            p_t, p_h, p_w = self.net.config.patch_size
            _, f, h, w = x_t.shape[1:]
            timestep = timestep[:, None].expand(x_t.shape[0], (f // p_t) * (-(-h // p_h)) * (-(-w // p_w)))
        return self.net(
            hidden_states=x_t,
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """(B, C, F, h, w) latents → (B, num_frames, 3, H, W) fp32 frames in [0, 1], in chunks of `decode_batch_size`.

        Same arithmetic as WanPipeline's `output_type="pt"`: z / (1/latents_std) + latents_mean → vae.decode →
        VideoProcessor.postprocess_video ((x / 2 + 0.5).clamp(0, 1), frames first).
        """
        c = self.vae.config
        vdt = self.vae.dtype
        out = []
        for s in range(0, x0.shape[0], self.decode_batch_size):
            z = x0[s : s + self.decode_batch_size].to(self.device, vdt)
            mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
            inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
            video = self.vae.decode(z / inv_std + mean, return_dict=False)[0]  # (b, 3, frames, H, W) in [-1, 1]
            out.append((video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4))
        return torch.cat(out)

    # ------------------------------------------------------------------------------------------- schedule
    @property
    def shift(self) -> float:
        """The Euler scheduler's shift (= sampler.shift with sampler.grid=diffusers for the same grid)."""
        return float(self.scheduler.config.shift)

    def euler_scheduler(self):
        """A fresh copy of the scheduler flowcredit samples with: set it on a stock WanPipeline
        (`pipe.scheduler = model.euler_scheduler()`) to reproduce flowcredit's ODE samples."""
        return copy.deepcopy(self.scheduler)

    def time_grid(self, num_steps: int) -> Tensor:
        """The Euler scheduler's sigmas for `num_inference_steps=num_steps` (T+1 values, 1 → 0), as
        `WanPipeline.__call__` sets them (`set_timesteps(T)`); = `samplers.schedules.time_grid(T, shift, "diffusers")`
        to float32 rounding."""
        sched = copy.deepcopy(self.scheduler)
        sched.set_timesteps(num_steps, device="cpu")
        return sched.sigmas.detach().clone().float()

    def pipeline_kwargs(self) -> dict:
        """Arguments that make `WanPipeline.__call__` match this adapter (with `pipe.scheduler = euler_scheduler()`);
        pass `guidance_scale` yourself (WanPipeline's default is 5.0, flowcredit's is the sampler's)."""
        return {"height": self.height, "width": self.width, "num_frames": self.num_frames,
                "max_sequence_length": self.max_sequence_length}

    def describe(self) -> dict:
        d = super().describe()
        d.update(height=self.height, width=self.width, num_frames=self.num_frames,
                 expand_timesteps=self.expand_timesteps,
                 scheduler={"class": type(self.scheduler).__name__, "shift": self.shift},
                 decode="frames (B, num_frames, 3, H, W) in [0, 1]")
        return d


# ---------------------------------------------------------------------------------------------------------------
# Scoring videos with image rewards
# ---------------------------------------------------------------------------------------------------------------


class FrameMeanReward:
    """Any image reward applied to videos: each sample's frames (every `frame_stride`-th) are scored as images with
    the sample's prompt and metadata, and the scores (and every component) are averaged over the frames.

    Use it as the reward of a wan run: ``reward: {name: "flowcredit.models.wan:FrameMeanReward", options: {reward:
    pickscore, options: {model: /path/to/pickscore}, frame_stride: 4}}``; ``reward: mix`` with ``options:
    {components: [...], normalize: ...}`` mixes per frame. flow_grpo's video OCR reward scores every 4th frame and
    averages (frame_interval 4). Images that are not videos, (B, 3, H, W), go to the inner reward unchanged.

    Args:
        reward: the inner reward's registry name or 'module:Class' path.
        options: the inner reward's constructor options.
        frame_stride: score frames 0, s, 2s, … of each clip (≥ 1).
    """

    def __init__(self, reward: str = "imagestats", options: dict[str, Any] | None = None, frame_stride: int = 1):
        from ..rewards.registry import build_reward

        if int(frame_stride) < 1:
            raise ValueError(f"reward FrameMeanReward: frame_stride must be >= 1, got {frame_stride!r}")
        self.inner = build_reward(reward, **dict(options or {}))
        self.frame_stride = int(frame_stride)
        self.name = f"frames({getattr(self.inner, 'name', reward)})"

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]], **meta: Any):
        from ..rewards.base import RewardOutput, check_output

        if not isinstance(images, Tensor) or images.ndim != 5 or images.shape[2] != 3:
            return self.inner(images, prompts, metadata, **meta)  # images, or a bad input the inner reward names
        B = images.shape[0]
        frames = images[:, :: self.frame_stride]
        n = frames.shape[1]
        if len(prompts) != B or (metadata is not None and len(metadata) != B):
            raise ValueError(f"reward '{self.name}': {B} videos but {len(prompts)} prompts / "
                             f"{len(metadata) if metadata is not None else 'no'} metadata")
        flat = frames.reshape(B * n, *frames.shape[2:])
        rep = {k: (v.repeat_interleave(n, dim=0) if isinstance(v, Tensor) and v.ndim >= 1 and v.shape[0] == B else v)
               for k, v in meta.items()}  # per-sample keyword tensors (group_ids) follow their frames
        out = check_output(self.name, self.inner(flat, [p for p in prompts for _ in range(n)],
                                                 [m for m in (metadata or [{}] * B) for _ in range(n)], **rep), B * n)
        info = dict(out.info)
        info["frames_scored"] = n
        return RewardOutput(
            scores=out.scores.view(B, n).mean(dim=1),
            components={k: v.view(B, n).mean(dim=1) for k, v in out.components.items()},
            info=info,
        )

    @classmethod
    def around(cls, inner: Any, frame_stride: int = 1) -> FrameMeanReward:
        """An already built image reward applied to videos the same way (`flowcredit eval` of a video model wraps
        the reward it was given by name in this)."""
        if int(frame_stride) < 1:
            raise ValueError(f"reward FrameMeanReward: frame_stride must be >= 1, got {frame_stride!r}")
        self = cls.__new__(cls)
        self.inner = inner
        self.frame_stride = int(frame_stride)
        self.name = f"frames({getattr(inner, 'name', type(inner).__name__)})"
        return self

    def check_prompts(self, metadata, source) -> None:
        """The inner reward's prompt check, if it has one (the trainer calls it before training)."""
        check = getattr(self.inner, "check_prompts", None)
        if callable(check):
            check(metadata, source)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()
