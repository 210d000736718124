"""Shared plumbing of the diffusers adapters (`sd3.py`, `flux.py`).

Each adapter wraps the components of a stock diffusers pipeline behind the FlowModel protocol (types.py):

    encode_prompts(prompts) -> Cond        the pipeline's own `encode_prompt`, with a per-prompt embedding cache
    velocity(x_t, t, cond)  -> v           one transformer call, v = x1 − x0 (diffusers' flow-matching output)
    decode(x0)              -> images      the pipeline's VAE scaling/shift + decode + [−1, 1] → [0, 1]
    trainable_parameters()                 LoRA weights (peft) or transformer weights

What lives here: checking a model folder (one-line error naming a missing component and the expected layout),
loading with per-component dtypes, LoRA through peft (`add_adapter`), the reference policy (adapter disabled),
precision (autocast bf16 with fp32 outputs), the prompt cache, chunked VAE decoding and a `__deepcopy__` that copies
only the transformer (the trainer's frozen reference for full fine-tunes).

Why reuse `Pipeline.encode_prompt` instead of re-implementing it: the prompt embeddings are then the deployed
pipeline's by construction (clip_skip, padding to max_length, the CLIP/T5 concatenation and padding of SD3 ...).

Import rule (STYLE.md R1): only the model adapters import diffusers/peft, and only lazily (inside functions),
through `require_extra`: a missing package is one line naming what needs it and `pip install -e ".[diffusers]"`.
A model folder is checked before anything is imported, so a wrong model.path is reported first.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..types import Cond
from .lora import adapters_disabled


class ModelLayoutError(FileNotFoundError):
    """A model folder lacks a component (a FileNotFoundError, so the CLI prints it as one line)."""


DIFFUSERS_EXTRA = 'pip install -e ".[diffusers]"'  # pyproject's optional extra: diffusers, transformers, peft, ...


class MissingExtraError(ImportError, ValueError):
    """An optional package is not installed (or too old). Also a ValueError, so the CLI prints it as one line."""


def require_extra(module: str, needed_by: str):
    """Import and return `module` (a package of the `diffusers` extra), or raise MissingExtraError.

    Args:
        module: e.g. "diffusers", "transformers", "peft".
        needed_by: what asked for it, for the message, e.g. "model.name=sd3".

    Raises:
        MissingExtraError: "model.name=sd3 needs the optional extra: pip install -e ".[diffusers]" (the Python
            package 'diffusers' is not installed)"; it names the package that failed to import, which may be a
            dependency of `module`.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = (e.name or module).split(".")[0]
        raise MissingExtraError(
            f"{needed_by} needs the optional extra: {DIFFUSERS_EXTRA} (the Python package '{missing}' is not "
            "installed)",
            name=missing,
        ) from None


def looks_like_hub_id(path: str) -> bool:
    """'org/name' with no local meaning: passed to diffusers as a hub id (downloading is the user's business)."""
    p = str(path)
    return p.count("/") == 1 and not p.startswith((".", "/", "~")) and not Path(p).exists()


def check_model_dir(path: str | Path, components: dict[str, str], family: str, pipeline: str) -> bool:
    """Check that `path` is a local diffusers folder holding every component; return False for a hub id.

    Args:
        path: local folder or hub id.
        components: component name → the file that must exist inside its subfolder ("" = any file).
        family: "sd3" | "flux" (for the message).
        pipeline: the diffusers pipeline class name (for the message).

    Raises:
        ModelLayoutError: one line naming the missing piece and the expected layout.
    """
    if looks_like_hub_id(str(path)):
        return False
    p = Path(path)
    layout = "model_index.json, " + ", ".join(f"{c}/" for c in components)
    hint = f"a {family} model folder (as written by {pipeline}.save_pretrained) holds {layout}"
    if not p.is_dir():
        raise ModelLayoutError(f"model.path '{path}' is not a directory; {hint}")
    if not (p / "model_index.json").is_file():
        raise ModelLayoutError(f"model folder '{path}' has no model_index.json; {hint}")
    for name, must in components.items():
        sub = p / name
        if not sub.is_dir() or not any(sub.iterdir()):
            raise ModelLayoutError(f"model folder '{path}' is missing the component '{name}/'; {hint}")
        if must and not (sub / must).is_file():
            raise ModelLayoutError(f"model folder '{path}': component '{name}/' has no {must}; {hint}")
    return True


def load_dtypes(precision: str, trainable: str) -> dict[str, torch.dtype]:
    """Per-component load dtypes (diffusers' `torch_dtype` dict, "default" for the rest).

    fp32: everything fp32. bf16: frozen text encoders in bf16; the VAE in fp32 (decoded images feed the reward, as
    flow_grpo keeps it); the transformer in bf16 when only LoRA weights train (the frozen base is never updated,
    flow_grpo's setting), in fp32 otherwise (fp32 master weights under bf16 autocast).
    """
    if precision == "fp32":
        return {"default": torch.float32}
    if precision != "bf16":
        raise ValueError(f"model.precision={precision!r}; valid here: fp32, bf16 ('auto' is resolved by "
                         "models.factory.build_model)")
    return {
        "default": torch.bfloat16,
        "vae": torch.float32,
        "transformer": torch.bfloat16 if trainable == "lora" else torch.float32,
    }


MIN_DIFFUSERS = (0, 34)  # per-component dtype dicts (0.33) and LoRA adapter metadata in save_lora_weights (0.34)


def check_diffusers_version(needed_by: str) -> None:
    """Raise MissingExtraError when diffusers is not installed or older than MIN_DIFFUSERS."""
    diffusers = require_extra("diffusers", needed_by)
    parts = tuple(int(x) for x in diffusers.__version__.split(".")[:2] if x.isdigit())
    if parts < MIN_DIFFUSERS:
        raise MissingExtraError(
            f"{needed_by} needs diffusers>={'.'.join(map(str, MIN_DIFFUSERS))} (per-component dtypes, LoRA alpha "
            f"metadata); found {diffusers.__version__}: pip install -U 'diffusers>=0.34'"
        )


@dataclass
class DiffusersOptions:
    """`model.options` of the diffusers families (sd3; flux adds `embedded_guidance`)."""

    resolution: int | None = field(
        default=None,
        metadata={"help": "Image side in pixels (papers: 512); null = the transformer's native size.", "ge": 1},
    )
    max_sequence_length: int | None = field(
        default=None, metadata={"help": "T5 prompt tokens; null = the pipeline's default.", "ge": 1}
    )

    def kwargs(self) -> dict[str, Any]:
        """The options that are set, as keyword arguments of the adapter's constructor."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


# The folder layout of a pipeline with one transformer, one VAE and ONE text encoder + tokenizer (FLUX.2, Qwen-Image,
# Z-Image, Wan): component folder → the file `check_model_dir` requires in it ("" = any content).
ONE_TEXT_ENCODER_COMPONENTS = {
    "transformer": "config.json",
    "vae": "config.json",
    "text_encoder": "config.json",
    "tokenizer": "",
    "scheduler": "scheduler_config.json",
}


def dynamic_shift_mu(scheduler, image_seq_len: int, calculate_shift) -> float:
    """The pipelines' resolution-dependent shift exponent mu for `image_seq_len` image tokens: diffusers'
    `calculate_shift` (the same "Copied from" formula in FluxPipeline, QwenImagePipeline and ZImagePipeline; the
    caller passes its own pipeline's copy) with the scheduler config's defaults."""
    c = scheduler.config
    return float(calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                 c.get("base_shift", 0.5), c.get("max_shift", 1.15)))


def shift_of(scheduler, mu: Callable[[], float]) -> float:
    """The SD3-style shift of a scheduler's grid: exp(mu) when it shifts dynamically (mu called only then), else its
    static `shift`. A terminal stretch (`shift_terminal`) comes on top and has no shift equivalent."""
    if scheduler.config.get("use_dynamic_shifting", False):
        return math.exp(mu())
    return float(scheduler.config.get("shift", 1.0))


class DiffusersFlowModel(nn.Module):
    """Base class of the SD3 and FLUX adapters: everything but the family-specific encode/forward/pack.

    Subclasses set `family`, `pipeline_name`, `default_lora_targets`, and implement `_encode_uncached`,
    `_forward`, `_unpack` and `time_grid`.

    Attributes:
        net: the transformer (the trainer reads `model.net`; alias `transformer`).
        vae, text_encoders: frozen, always in eval mode.
        cfg: the ModelCfg it was built from (saved in trainer checkpoints).
        compute_dtype: autocast dtype of the transformer forward (float32 = no autocast).
        latent_shape: the protocol's per-sample latent shape.
    """

    family = "?"
    pipeline_name = "?"
    default_lora_targets: tuple[str, ...] = ()
    latent_shape: tuple[int, ...]  # set by each family's __init__
    default_max_sequence_length = 256

    def __init__(self, pipe, cfg, *, max_sequence_length: int | None = None, cache_size: int = 256,
                 decode_batch_size: int = 8):
        super().__init__()
        self.cfg = cfg
        self.net = pipe.transformer
        self.vae = pipe.vae
        self.text_encoders = nn.ModuleList([m for m in self._text_encoder_modules(pipe) if m is not None])
        self._pipe = pipe  # not a Module: holds tokenizers, the scheduler and the same modules as above
        self.scheduler = pipe.scheduler
        self.compute_dtype: torch.dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        tok_max = self._t5_tokenizer_max(pipe)
        if max_sequence_length is None:
            max_sequence_length = self.default_max_sequence_length
            if tok_max:
                max_sequence_length = min(max_sequence_length, tok_max)
        self.max_sequence_length = int(max_sequence_length)
        self.cache_size = int(cache_size)
        self.decode_batch_size = int(decode_batch_size)
        self._cache: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        for m in (self.vae, *self.text_encoders):
            m.requires_grad_(False).eval()
        self.net.requires_grad_(False)
        self.lora_targets: list[str] = []
        if cfg.trainable == "lora":
            self._add_lora(cfg)
        if cfg.gradient_checkpointing:
            self.net.enable_gradient_checkpointing()
        self.eval()

    # ------------------------------------------------------------------------------------------ construction
    @staticmethod
    def _text_encoder_modules(pipe) -> list[nn.Module | None]:
        return [getattr(pipe, n, None) for n in ("text_encoder", "text_encoder_2", "text_encoder_3")]

    @staticmethod
    def _t5_tokenizer_max(pipe) -> int | None:
        raise NotImplementedError

    @classmethod
    def _load_pipeline(cls, path: str, cfg, components: dict[str, str]):
        """Load the diffusers pipeline `cls.pipeline_name` from a local folder or a hub id, per-component dtypes.

        Order: the folder is checked first (ModelLayoutError), then the packages are imported (MissingExtraError),
        so a wrong model.path is reported even where diffusers is not installed.
        """
        local = check_model_dir(path, components, cls.family, cls.pipeline_name)
        needed_by = f"model.name={cls.family}"
        diffusers = require_extra("diffusers", needed_by)
        require_extra("transformers", needed_by)  # the pipeline's text encoders and tokenizers
        check_diffusers_version(needed_by)
        pipeline_cls = getattr(diffusers, cls.pipeline_name)
        dtypes = load_dtypes(cfg.precision, cfg.trainable)
        # diffusers renamed `torch_dtype` to `dtype` (utils/deprecation_utils._resolve_dtype); both take a dict.
        from diffusers.utils import deprecation_utils

        key = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
        pipe = pipeline_cls.from_pretrained(str(path), local_files_only=local, **{key: dtypes})
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _add_lora(self, cfg) -> None:
        """Add a peft LoRA adapter ("default") on `cfg.lora_targets` or the family's default target list.

        LoRA weights are kept in fp32 whatever the base dtype (bf16 autocast computes with them, AdamW updates fp32).
        init "gaussian" (A ~ N(0, 1/r), B = 0: the adapted model starts exactly at the base model), as flow_grpo.
        """
        LoraConfig = require_extra("peft", f"model.trainable=lora on model.name={self.family}").LoraConfig

        targets = list(cfg.lora_targets) if cfg.lora_targets else list(self.default_lora_targets)
        self.lora_targets = targets
        self.net.add_adapter(
            LoraConfig(
                r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, init_lora_weights="gaussian", target_modules=targets
            )
        )
        n = 0
        for name, p in self.net.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
                n += 1
        if n == 0:
            raise ValueError(f"model.lora_targets={targets} matched no module of the {self.family} transformer")

    # ----------------------------------------------------------------------------------------- properties
    @property
    def transformer(self) -> nn.Module:
        return self.net

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    def enable_gradient_checkpointing(self) -> None:
        """The trainer's `model.gradient_checkpointing` switch (trainer/memory.py): diffusers' own, on the
        transformer (also turned on at construction when cfg.gradient_checkpointing is set)."""
        self.net.enable_gradient_checkpointing()

    @property
    def has_lora(self) -> bool:
        return bool(getattr(self.net, "_hf_peft_config_loaded", False))

    @property
    def pipeline(self):
        """The diffusers pipeline sharing this adapter's modules (its transformer carries the LoRA adapter)."""
        return self._pipe

    # ------------------------------------------------------------------------------------------- training
    def configure_trainable(self, trainable: str) -> list[nn.Parameter]:
        """Set requires_grad for `trainable` ('lora' | 'all' | 'blocks' | 'modulation'); text encoders and VAE stay
        frozen. 'modulation': the conditioning path only, i.e. `time_text_embed` (timestep, pooled-text and FLUX's
        guidance embeddings) and every adaptive norm's projection (diffusers' AdaLayerNormZero / …Single /
        …Continuous / SD35AdaLayerNormZeroX modules: norm1, norm1_context, norm, norm_out).

        Returns:
            the trainable parameters.
        """
        net = self.net
        if trainable == "lora":
            if not self.has_lora:
                raise ValueError("model.trainable=lora but the model was built without a LoRA adapter")
            net.requires_grad_(False)
            for name, p in net.named_parameters():
                if "lora_" in name:
                    p.requires_grad_(True)
        elif trainable in ("all", "blocks", "modulation"):
            if self.has_lora:
                raise ValueError(
                    f"model.trainable={trainable} on a model built with a LoRA adapter; build it with "
                    f"trainable={trainable}"
                )
            if trainable == "all":
                net.requires_grad_(True)
            elif trainable == "modulation":
                net.requires_grad_(False)
                for name, mod in net.named_modules():
                    if name == "time_text_embed" or "AdaLayerNorm" in type(mod).__name__:
                        mod.requires_grad_(True)
            else:
                net.requires_grad_(False)
                for attr in ("transformer_blocks", "single_transformer_blocks"):
                    if hasattr(net, attr):
                        getattr(net, attr).requires_grad_(True)
        else:
            raise ValueError(f"model.trainable={trainable!r}; valid: all, lora, blocks, modulation")
        return self.trainable_parameters()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def train(self, mode: bool = True):
        """Only the transformer changes mode; text encoders and VAE are frozen and always in eval mode."""
        super().train(False)
        self.net.train(mode)
        self.training = mode
        return self

    @property
    def reference(self):
        """Context manager yielding the reference policy π_ref = this model with the LoRA adapter disabled.

        Only LoRA models have it (for full fine-tunes `hasattr(model, "reference")` is False and the trainer keeps a
        frozen copy made by `copy.deepcopy`, which copies the transformer only; see `__deepcopy__`).
        """
        if not self.has_lora:
            raise AttributeError("reference: only LoRA models give the reference by disabling the adapter")
        return self._adapter_disabled

    @contextlib.contextmanager
    def _adapter_disabled(self) -> Iterator[DiffusersFlowModel]:
        with adapters_disabled(self.net, self.net.disable_adapters, self.net.enable_adapters):
            yield self

    def __deepcopy__(self, memo):
        """Copy the transformer; share the frozen text encoders, VAE, tokenizers, scheduler and prompt cache."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__ = dict(self.__dict__)
        for key in ("_parameters", "_buffers", "_modules"):
            new.__dict__[key] = OrderedDict(self.__dict__[key])
        new._modules["net"] = copy.deepcopy(self.net, memo)
        new.cfg = copy.deepcopy(self.cfg, memo)
        return new

    # ------------------------------------------------------------------------------------------- protocol
    def encode_prompts(self, prompts: Sequence[str]) -> Cond:
        """Encode B prompts with the pipeline's own `encode_prompt` ("" = the unconditional prompt of CFG).

        Embeddings of prompts seen before come from an LRU cache of `cache_size` prompts (the encoders are frozen),
        so a group of G copies of a prompt is encoded once.
        """
        prompts = list(prompts)
        todo = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        fresh: dict[str, dict[str, Tensor]] = {}
        if todo:
            with torch.no_grad():
                enc = self._encode_uncached(todo)
            for i, p in enumerate(todo):
                fresh[p] = {k: v[i] for k, v in enc.items()}
        rows = []
        for p in prompts:
            if p in fresh:
                rows.append(fresh[p])
            else:
                self._cache.move_to_end(p)
                rows.append(self._cache[p])
        if self.cache_size > 0:
            for p, r in fresh.items():
                self._cache[p] = r
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    def velocity(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """v(x_t, t) = x1 − x0 in fp32. x_t: (B, *latent); t: (B,) in [0, 1]; autocast per `compute_dtype`."""
        t = torch.as_tensor(t, dtype=torch.float32, device=x_t.device)
        t = t.expand(x_t.shape[0]) if t.ndim == 0 else t
        if self.compute_dtype != torch.float32:
            with torch.autocast(x_t.device.type, dtype=self.compute_dtype):
                v = self._forward(x_t, t, cond)
        else:
            v = self._forward(x_t, t, cond)
        return v.float()

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """(B, *latent) → (B, 3, H, W) fp32 images in [0, 1], VAE-decoded in chunks of `decode_batch_size`.

        Same arithmetic as the pipelines' `output_type="pt"`: z / scaling_factor + shift_factor → vae.decode →
        VaeImageProcessor.denormalize ((x / 2 + 0.5).clamp(0, 1)).
        """
        sf = self.vae.config.scaling_factor
        sh = self.vae.config.shift_factor or 0.0
        vdt = self.vae.dtype
        out = []
        for s in range(0, x0.shape[0], self.decode_batch_size):
            z = self._unpack(x0[s : s + self.decode_batch_size].to(self.device))
            z = z / sf + sh
            img = self.vae.decode(z.to(vdt), return_dict=False)[0]
            out.append((img.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out)

    # ---------------------------------------------------------------------------------- family specific
    def _encode_uncached(self, prompts: list[str]) -> dict[str, Tensor]:
        raise NotImplementedError

    def _forward(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        raise NotImplementedError

    def _unpack(self, x: Tensor) -> Tensor:
        """Protocol latents → the VAE's (B, C, h, w) latents."""
        return x

    def time_grid(self, num_steps: int) -> Tensor:
        """The (T+1,) grid 1 → 0 the stock pipeline uses for `num_inference_steps=T` (its scheduler's sigmas)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ info
    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (written next to exports)."""
        return {
            "family": self.family,
            "pipeline": self.pipeline_name,
            "base_model": self.cfg.path,
            "latent_shape": list(self.latent_shape),
            "max_sequence_length": self.max_sequence_length,
            "lora": {"rank": self.cfg.lora_rank, "alpha": self.cfg.lora_alpha, "targets": self.lora_targets}
            if self.has_lora
            else None,
        }

    def __repr__(self) -> str:  # the default nn.Module repr prints every layer of a 2B-parameter transformer
        return f"{self.__class__.__name__}({json.dumps(self.describe())})"
