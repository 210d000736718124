"""The tiny model's word-level tokenizer, built from the closed shapes vocabulary (no download)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[UNK]")


def default_vocabulary() -> list[str]:
    """Every word the shapes prompt generator can write (GenEval templates over shapes and colours)."""
    from ..shapes.vocab import ALL_SHAPES, COLOR_NAMES, NUMBER_WORDS, RELATIONS, plural

    words = ["a", "an", "photo", "of", "and"]
    words += list(COLOR_NAMES)
    words += list(ALL_SHAPES) + [plural(s) for s in ALL_SHAPES]
    words += list(NUMBER_WORDS.values())
    for rel in RELATIONS:
        words += rel.split()
    seen: list[str] = []
    for w in words:
        if w not in seen:
            seen.append(w)
    return seen


class WordTokenizer:
    """Lower-case whitespace tokenizer over a fixed word list. Unknown words map to [UNK]."""

    def __init__(self, words: Sequence[str], max_length: int = 16):
        self.words = list(words)
        self.itos = list(SPECIAL_TOKENS) + self.words
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        self.max_length = max_length

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def split(self, text: str) -> list[str]:
        return re.findall(r"[a-z0-9]+", text.lower())

    def __call__(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Tokenize B prompts.

        Returns:
            ids: (B, L) int64 with [CLS] first, then words, then [PAD]; L = max_length.
            mask: (B, L) bool, True for real tokens.
        """
        L = self.max_length
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        for b, p in enumerate(prompts):
            toks = [self.stoi["[CLS]"]] + [self.stoi.get(w, self.stoi["[UNK]"]) for w in self.split(p)]
            toks = toks[:L]
            ids[b, : len(toks)] = torch.tensor(toks)
        return ids, ids != 0


# ---------------------------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------------------------
