"""A tiny deterministic FlowModel for CPU tests (no downloads, fixed init independent of the global seed).

Notation: see ``flowcredit.types``. Latents are (B, 3, 4, 4); the text "encoder" hashes each character of a prompt
into an ``nn.Embedding`` and averages; the empty prompt "" (unconditional) gets its own learned null embedding.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

VOCAB = 64
EMB_DIM = 8


class ToyFlowModel(nn.Module):
    """Implements the ``FlowModel`` protocol with a 2-layer MLP velocity v(x_t, t, c).

    Cond is ``{"emb": (B, EMB_DIM)}``.
    """

    def __init__(self, latent_shape: tuple[int, ...] = (3, 4, 4), hidden: int = 32, seed: int = 1234) -> None:
        super().__init__()
        self.latent_shape = tuple(latent_shape)
        dim = 1
        for size in self.latent_shape:
            dim *= size
        self.token_embedding = nn.Embedding(VOCAB, EMB_DIM)
        self.null_embedding = nn.Parameter(torch.zeros(EMB_DIM))
        self.net = nn.Sequential(nn.Linear(dim + 2 + EMB_DIM, hidden), nn.SiLU(), nn.Linear(hidden, dim))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def encode_prompts(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        """B prompts -> {"emb": (B, EMB_DIM)}; "" maps to the null embedding."""
        rows = []
        for prompt in prompts:
            if prompt == "":
                rows.append(self.null_embedding)
            else:
                tokens = torch.tensor([ord(ch) % VOCAB for ch in prompt], dtype=torch.long)
                rows.append(self.token_embedding(tokens).mean(dim=0))
        return {"emb": torch.stack(rows, dim=0)}

    def velocity(self, x_t: Tensor, t: Tensor, cond: dict[str, Tensor]) -> Tensor:
        """x_t (B, *latent), t (B,), cond {"emb": (B, EMB_DIM)} -> v (B, *latent)."""
        batch = x_t.shape[0]
        t = t.float().reshape(batch, 1)
        features = torch.cat([x_t.reshape(batch, -1).float(), t, torch.sin(3 * t), cond["emb"].float()], dim=1)
        return (self.net(features) + 0.5 * x_t.reshape(batch, -1).float()).reshape(batch, *self.latent_shape)

    def decode(self, x0: Tensor) -> Tensor:
        """(B, 3, 4, 4) latents -> (B, 3, 4, 4) images in [0, 1]."""
        return ((x0.float().clamp(-1, 1) + 1) / 2).reshape(x0.shape[0], 3, 4, 4)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())
