"""The built-in tiny text-to-image flow model (the embedded default): a small DiT over pixels with a word-level
text encoder over the closed shapes vocabulary. No download: the tokenizer
(`tokenizer.py`) is built from the vocabulary.

Conventions follow SD3 (ALGORITHMS.md §1.1): t = 1 is noise, t = 0 is data, x_t = (1 − t)·x0 + t·x1, the network
predicts v = x1 − x0, and it is called with t ∈ [0, 1] (embedded as 1000·t, like diffusers' `timestep`).
Latents are pixels scaled to [−1, 1], shape (3, R, R).

Architecture (a single-stream "MMDiT-lite", after the calibration prototype, CALIBRATION.md):
  * image: patchify p×p → linear → + fixed 2-D sin-cos position embeddings (learned ones gave patch confetti);
  * text: word embeddings + learned positions → 1 transformer layer; pooled = mean over valid tokens;
  * text tokens and image tokens are concatenated into one sequence; each block is self-attention + MLP with
    adaLN-zero modulation from (timestep embedding + pooled text);
  * final adaLN + linear back to patches; only image tokens are read out.
Classifier-free guidance uses the empty prompt "" (only the [CLS] token), trained by prompt dropout.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..types import Cond
from .lora import adapters_disabled
from .tokenizer import SPECIAL_TOKENS, WordTokenizer, default_vocabulary


@dataclass
class TinyOptions:
    """`model.options` of the tiny family."""

    gelu: Literal["tanh", "exact"] | None = field(
        default=None,
        metadata={
            "help": "MLP activation: tanh = the GELU approximation the shipped model was pretrained with; exact = "
            "erf GELU (|Δ| ≤ 4.7e-4 per activation, under bf16's resolution; ≈ 4× faster than the tanh kernel on "
            "CPU, ≈ 10% of a forward; README 'Where the time goes'); null = what the weights' config says.",
        },
    )


@dataclass
class TinyDiTConfig:
    """Architecture of the tiny DiT (saved as JSON next to the weights)."""

    resolution: int = 32
    channels: int = 3
    patch: int = 4
    width: int = 192
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    text_layers: int = 1
    max_text_len: int = 16
    vocabulary: list[str] = field(default_factory=default_vocabulary)
    gelu: str = "tanh"  # MLP activation: "tanh" approximation (as pretrained) or "exact" (TinyOptions.gelu)

    @property
    def num_patches(self) -> int:
        return (self.resolution // self.patch) ** 2


def sincos_2d(width: int, grid: int) -> Tensor:
    """Fixed 2-D sin-cos position embeddings (MAE/DiT style). Returns (grid², width)."""
    assert width % 4 == 0
    d = width // 4
    omega = 1.0 / (10000 ** (torch.arange(d, dtype=torch.float64) / d))
    ys, xs = torch.meshgrid(
        torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64), indexing="ij"
    )
    out = []
    for pos in (ys.reshape(-1), xs.reshape(-1)):
        a = pos[:, None] * omega[None, :]
        out += [torch.sin(a), torch.cos(a)]
    return torch.cat(out, dim=1).float()


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding of 1000·t. t: (B,) → (B, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (1000.0 * t.float())[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def gelu_approximate(kind: str) -> str:
    """`nn.GELU(approximate=...)` of a tiny-model `gelu` setting: "tanh" → "tanh", "exact" → "none"."""
    if kind not in ("tanh", "exact"):
        raise ValueError(f"tiny model gelu: {kind!r}; use tanh|exact (model.options.gelu)")
    return "tanh" if kind == "tanh" else "none"


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> Tensor:
    """softmax(q·kᵀ/√d + mask)·v, the same function in sampling and training.

    Args:
        q, k, v: (B, heads, N, d). attn_mask: (B, 1, 1, N) bool (True = attend) or None.

    Returns:
        (B, heads, N, d) in q's dtype.

    bf16 on CPU takes an explicit path: scores and softmax in fp32, probabilities·v in bf16. PyTorch's CPU flash
    kernel (what `F.scaled_dot_product_attention` picks) is slow for these short sequences (N = 80) in bf16: its
    backward took 37% of a forward + backward of the whole tiny DiT at batch 64 (torch.profiler, 2 threads, AVX-512),
    and the explicit path is ≈ 2× faster forward + backward at the same error against an fp32 reference
    (`benchmarks/bench_model.py --kernels`). fp32 and accelerators keep `F.scaled_dot_product_attention`, which is
    the faster one there. Either path is deterministic, and rollouts and updates take the same one for a given dtype.
    """
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    with torch.autocast("cpu", enabled=False):  # autocast would cast the fp32 score matmul back to bf16
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf"))  # every row attends to the image tokens: never all −inf
        return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)


def longest_prompt(mask: Tensor) -> int:
    """mask: (B, L) bool, right-padded prompts. The length of the longest one ([CLS] included), at least 1."""
    return max(int(mask.sum(1).max()), 1) if mask.numel() else mask.shape[1]


class Block(nn.Module):
    """Pre-norm transformer block with adaLN-zero modulation."""

    def __init__(self, width: int, heads: int, mlp_ratio: float, gelu: str = "tanh"):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        hidden = int(width * mlp_ratio)
        act = nn.GELU(approximate=gelu_approximate(gelu))
        self.mlp = nn.Sequential(nn.Linear(width, hidden), act, nn.Linear(hidden, width))
        ada = nn.Linear(width, 6 * width)
        self.ada = nn.Sequential(nn.SiLU(), ada)
        nn.init.zeros_(ada.weight)
        nn.init.zeros_(ada.bias)

    def forward(self, x: Tensor, c: Tensor, attn_mask: Tensor | None, first_out: int = 0) -> Tensor:
        """x: (B, N, D) tokens; c: (B, D) conditioning; attn_mask: (B, 1, 1, N) bool (True = attend) or None.

        Returns (B, N − first_out, D): the tokens from `first_out` on. Every token is a key and value, but only those
        rows are queries and go through the projection and MLP (the last block: the image tokens only).
        """
        B, N, D = x.shape
        s1, sc1, g1, s2, sc2, g2 = self.ada(c).chunk(6, dim=-1)
        h = modulate(self.norm1(x), s1, sc1)
        q, k, v = self.qkv(h).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if first_out:
            q, x = q[:, :, first_out:], x[:, first_out:]
        a = attention(q, k, v, attn_mask)
        x = x + g1[:, None] * self.proj(a.transpose(1, 2).reshape(B, N - first_out, D))
        x = x + g2[:, None] * self.mlp(modulate(self.norm2(x), s2, sc2))
        return x


class TextEncoder(nn.Module):
    """Word embeddings + learned positions + a few transformer layers. Returns tokens (B, L, D) and pooled (B, D)."""

    def __init__(self, vocab_size: int, width: int, heads: int, layers: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.randn(max_len, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        # PyTorch's fused "fast path" of TransformerEncoderLayer runs only in eval mode without grad (rollouts), and
        # gives other numbers than the regular path of updates (bf16: up to 0.06 in the velocity), which would break
        # "sampling and training use the same velocity function" (on-policy ratio exactly 1): always the regular path.
        fast = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            h = self.norm(self.layers(h, src_key_padding_mask=~mask))
        finally:
            torch.backends.mha.set_fastpath_enabled(fast)
        m = mask.to(h.dtype)[..., None]
        pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return h, pooled


class TinyDiT(nn.Module):
    """Velocity network v_θ(x_t, t, text). See the module docstring for the architecture."""

    def __init__(self, cfg: TinyDiTConfig):
        super().__init__()
        self.cfg = cfg
        D, p, C = cfg.width, cfg.patch, cfg.channels
        self.text = TextEncoder(
            len(SPECIAL_TOKENS) + len(cfg.vocabulary), D, cfg.heads, cfg.text_layers, cfg.max_text_len
        )
        self.patch_in = nn.Linear(C * p * p, D)
        self.register_buffer("pos_img", sincos_2d(D, cfg.resolution // p), persistent=False)
        self.t_mlp = nn.Sequential(nn.Linear(D, D), nn.SiLU(), nn.Linear(D, D))
        self.pool_mlp = nn.Sequential(nn.Linear(D, D), nn.SiLU(), nn.Linear(D, D))
        self.blocks = nn.ModuleList([Block(D, cfg.heads, cfg.mlp_ratio, cfg.gelu) for _ in range(cfg.depth)])
        self.norm_out = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        ada_out = nn.Linear(D, 2 * D)
        self.ada_out = nn.Sequential(nn.SiLU(), ada_out)
        self.patch_out = nn.Linear(D, C * p * p)
        nn.init.zeros_(ada_out.weight)
        nn.init.zeros_(ada_out.bias)
        nn.init.zeros_(self.patch_out.weight)
        nn.init.zeros_(self.patch_out.bias)

    def patchify(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        p = self.cfg.patch
        return (
            x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), C * p * p)
        )

    def unpatchify(self, tok: Tensor) -> Tensor:
        B, N, _ = tok.shape
        p, C, R = self.cfg.patch, self.cfg.channels, self.cfg.resolution
        g = R // p
        return tok.reshape(B, g, g, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, R, R)

    def forward(
        self, x_t: Tensor, t: Tensor, ids: Tensor, mask: Tensor, text: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """x_t: (B, C, R, R); t: (B,); ids, mask: (B, L); text: the text encoder's (tokens (B, L, D), pooled (B, D))
        of these ids if already computed. Returns v: (B, C, R, R).

        Prompts are right-padded to max_text_len, and padding is a masked key everywhere whose own outputs no image
        token reads, so the text is cut to the longest prompt of the batch (shapes prompts: ≤ 11 of 16 tokens, 75
        instead of 80 tokens per block) and the last block computes the image tokens only (their velocity is all the
        model returns): the same function with ≈ 9% fewer FLOPs (`tests/models/test_tiny.py` checks the invariance).
        """
        n = longest_prompt(mask)
        ids, mask = ids[:, :n], mask[:, :n]
        txt, pooled = self.text(ids, mask) if text is None else (text[0][:, :n], text[1])
        img = self.patch_in(self.patchify(x_t)) + self.pos_img.to(x_t.dtype)
        c = self.t_mlp(timestep_embedding(t, self.cfg.width).to(img.dtype)) + self.pool_mlp(pooled)
        h = torch.cat([txt.to(img.dtype), img], dim=1)
        key_ok = torch.cat([mask, torch.ones(mask.shape[0], img.shape[1], dtype=torch.bool, device=mask.device)], 1)
        attn_mask = key_ok[:, None, None, :]
        for i, blk in enumerate(self.blocks):
            h = blk(h, c, attn_mask, first_out=n if i == len(self.blocks) - 1 else 0)
        shift, scale = self.ada_out(c).chunk(2, dim=-1)
        out = self.patch_out(modulate(self.norm_out(h[:, h.shape[1] - img.shape[1] :]), shift, scale))
        return self.unpatchify(out)


# ---------------------------------------------------------------------------------------------------------------
# The FlowModel adapter
# ---------------------------------------------------------------------------------------------------------------

ASSET_DIR = Path(__file__).parent / "assets"
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # Cond["txt_dtype"]: what "txt" was computed in
# LoRA targets of model.trainable=lora (empty model.lora_targets): every linear layer of the DiT blocks, attention
# (qkv, proj) and MLP; not the adaLN modulation, embeddings or text encoder.
DEFAULT_LORA_TARGETS = ("qkv", "proj", "mlp.0", "mlp.2")
SHIPPED_NAME = "tiny_shapes32"


class TinyFlowModel(nn.Module):
    """The tiny model behind the FlowModel protocol (types.py): encode_prompts → velocity → decode.

    `encode_prompts` only tokenizes, so the text encoder runs inside `velocity` and is trained with everything
    else (full fine-tune) unless frozen by the trainer.
    """

    def __init__(self, cfg: TinyDiTConfig | None = None):
        super().__init__()
        self.cfg = cfg or TinyDiTConfig()
        self.net = TinyDiT(self.cfg)
        self.tokenizer = WordTokenizer(self.cfg.vocabulary, self.cfg.max_text_len)
        self.latent_shape: tuple[int, ...] = (self.cfg.channels, self.cfg.resolution, self.cfg.resolution)
        self.compute_dtype: torch.dtype = torch.float32
        self.lora: dict | None = None  # {"rank", "alpha", "targets"} once `add_lora` ran

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def encode_prompts(self, prompts: Sequence[str]) -> Cond:
        """{"ids", "mask"}: (B, L) tokens; while the text encoder is frozen (model.trainable = modulation | blocks, and
        LoRA without text targets) also its output {"txt": (B, L, D), "pooled": (B, D)} and "txt_dtype": (B,) the
        compute-dtype code it was computed in, so rollouts and updates do not re-encode the same prompts in every
        forward (≈ 4% of one; `velocity` recomputes when the encoder was unfrozen or the dtype changed since)."""
        ids, mask = self.tokenizer(prompts)
        cond = {"ids": ids.to(self.device), "mask": mask.to(self.device)}
        if self._text_frozen() and not self._text_sharded():
            n = longest_prompt(mask)  # as in TinyDiT.forward, so the cached output is bit-identical to recomputing
            with torch.no_grad(), self._autocast(self.device.type):
                txt, pooled = self.net.text(cond["ids"][:, :n], cond["mask"][:, :n])
            txt = F.pad(txt, (0, 0, 0, ids.shape[1] - n))  # (B, L, D): padding rows are never read
            code = torch.full((ids.shape[0],), _DTYPE_CODE[self.compute_dtype], dtype=torch.int8, device=self.device)
            cond.update(txt=txt, pooled=pooled, txt_dtype=code)
        return cond

    def _text_frozen(self) -> bool:
        return not any(p.requires_grad for p in self.net.text.parameters())

    def _text_sharded(self) -> bool:
        """FSDP shards the root group, text encoder included, and only the root's forward gathers it: no caching."""
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch without distributed support
            return False
        return any(isinstance(p, DTensor) for p in self.net.text.parameters())

    def _autocast(self, device_type: str):
        if self.compute_dtype != torch.float32 and device_type in ("cpu", "cuda"):
            return torch.autocast(device_type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def velocity(self, x_t: Tensor, t: Tensor, cond: Cond) -> Tensor:
        text = None
        code = _DTYPE_CODE[self.compute_dtype]
        if "txt" in cond and self._text_frozen() and bool((cond["txt_dtype"] == code).all()):
            text = (cond["txt"], cond["pooled"])  # the frozen encoder's output of these ids, in this dtype
        with self._autocast(x_t.device.type):
            v = self.net(x_t, t, cond["ids"], cond["mask"], text)
        return v.float()

    def set_gelu(self, kind: str) -> None:
        """The MLP activation of every block: "tanh" (as pretrained) or "exact" (erf), `TinyOptions.gelu`."""
        approximate = gelu_approximate(kind)
        self.cfg.gelu = kind  # saved with the weights and in checkpoints' model_config
        for act in self.net.modules():
            if isinstance(act, nn.GELU):
                act.approximate = approximate

    def decode(self, x0: Tensor) -> Tensor:
        return ((x0.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_images(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) images in [0, 1] → latents in [−1, 1] (the inverse of decode)."""
        return images.float() * 2.0 - 1.0

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    # -- LoRA (peft) -------------------------------------------------------------------------------------------

    def add_lora(self, rank: int, alpha: float, targets: Sequence[str] | None = None) -> TinyFlowModel:
        """Inject a peft LoRA adapter ("default") into the DiT's linear layers (`DEFAULT_LORA_TARGETS` if `targets`
        is empty): W x + (α/r)·B A x with B = 0 at init (peft `inject_adapter_in_model`), so the velocity is unchanged
        until B is trained. The text encoder (nn.MultiheadAttention) is never wrapped. Returns self."""
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ImportError:
            raise ValueError("model.trainable=lora needs peft: pip install 'flowcredit[diffusers]'") from None
        targets = list(targets) if targets else list(DEFAULT_LORA_TARGETS)
        try:
            inject_adapter_in_model(
                # peft annotates lora_alpha as int; any positive float works (scaling = alpha / r)
                LoraConfig(
                    r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=targets  # type: ignore[arg-type]
                ),
                self.net,
            )
        except ValueError as e:  # peft: "Target modules ... not found in the base model"
            raise ValueError(
                f"model.lora_targets={targets} matched no linear layer of the tiny DiT ({str(e).splitlines()[0]}); "
                f"use names like {list(DEFAULT_LORA_TARGETS)}"
            ) from None
        self.lora = {"rank": int(rank), "alpha": float(alpha), "targets": targets}
        return self

    @property
    def has_lora(self) -> bool:
        return self.lora is not None

    def _lora_layers(self) -> list[Any]:  # peft LoraLayer (peft is optional)
        from peft.tuners.lora import LoraLayer

        return [m for m in self.net.modules() if isinstance(m, LoraLayer)]

    @property
    def reference(self):
        """Context manager yielding π_ref = this model with its LoRA adapter disabled (Flow-GRPO: `disable_adapter()`).

        Only LoRA models have it: for a full fine-tune `hasattr(model, "reference")` is False and the trainer keeps a
        frozen copy of the initial weights instead.
        """
        if not self.has_lora:
            raise AttributeError("reference: only LoRA models give the reference by disabling the adapter")
        return self._adapter_disabled

    @contextlib.contextmanager
    def _adapter_disabled(self) -> Iterator[TinyFlowModel]:
        layers = self._lora_layers()

        def switch(on: bool):
            for m in layers:
                m.enable_adapters(on)

        with adapters_disabled(self.net, lambda: switch(False), lambda: switch(True)):
            yield self

    def merged_state_dict(self) -> dict[str, Tensor]:
        """The plain TinyDiT state dict with the adapter folded in (W ← W + (α/r)·B A, peft `get_delta_weight`):
        loads into a TinyFlowModel without LoRA and gives the same velocity. Without LoRA: `net.state_dict()`."""
        state = {k: v.detach().clone() for k, v in self.net.state_dict().items()}
        if not self.has_lora:
            return state
        names = {m: n for n, m in self.net.named_modules()}
        for m in self._lora_layers():
            n = names[m]
            w = state.pop(f"{n}.base_layer.weight")
            state[f"{n}.weight"] = w + m.get_delta_weight("default").to(w.dtype)
            if f"{n}.base_layer.bias" in state:
                state[f"{n}.bias"] = state.pop(f"{n}.base_layer.bias")
        return {k: v for k, v in state.items() if "lora_" not in k}

    # -- persistence -------------------------------------------------------------------------------------------

    def save(self, directory: str | Path, name: str = SHIPPED_NAME, extra: dict | None = None) -> Path:
        """Write `<name>.safetensors` (fp32 weights) and `<name>.json` (config + provenance)."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {k: v.float().contiguous() for k, v in self.merged_state_dict().items()}  # a LoRA model saves merged
        save_file(state, str(d / f"{name}.safetensors"))
        meta = {"config": asdict(self.cfg), **(extra or {})}
        (d / f"{name}.json").write_text(json.dumps(meta, indent=2))
        return d / f"{name}.safetensors"

    @classmethod
    def load(cls, path: str | Path | None = None) -> TinyFlowModel:
        """Load from a `.safetensors` path (config JSON beside it) or, with None, the shipped checkpoint."""
        from safetensors.torch import load_file

        p = Path(path) if path is not None else ASSET_DIR / f"{SHIPPED_NAME}.safetensors"
        if p.is_dir():
            cands = sorted(p.glob("*.safetensors"))
            if not cands:
                raise FileNotFoundError(f"no .safetensors file in '{p}'; pass the weights file of a tiny model")
            p = cands[0]
        if not p.exists():
            raise FileNotFoundError(
                f"tiny model weights '{p}' not found; pass a .safetensors file written by `flowcredit pretrain`"
            )
        meta_path = p.with_suffix(".json")
        if not meta_path.exists():
            raise FileNotFoundError(
                f"config '{meta_path}' missing next to '{p}'; it is written together with the weights"
            )
        meta = json.loads(meta_path.read_text())
        model = cls(TinyDiTConfig(**meta["config"]))
        model.net.load_state_dict(load_file(str(p)))
        model.eval()
        return model
