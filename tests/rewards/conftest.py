"""Fixtures for the reward tests: tiny random CLIP / BLIP models saved to folders (never downloaded), and images."""

from __future__ import annotations

import pytest
import torch


def _clip_vocab() -> dict[str, int]:
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    return vocab


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory):
    """A folder with a tiny random CLIPModel (32-px images, 16-d projection), a character-level CLIP tokenizer and a
    preprocessor_config.json (shortest_edge 32, crop 32) — the layout of a hub CLIP checkpoint."""
    import json

    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    d = tmp_path_factory.mktemp("tiny_clip")
    vocab = _clip_vocab()
    CLIPTokenizer(vocab=vocab, merges=[]).save_pretrained(d)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(d)
    (d / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }))
    return str(d)


@pytest.fixture
def rand_images():
    g = torch.Generator().manual_seed(1)
    return torch.rand(4, 3, 40, 48, generator=g)


@pytest.fixture(scope="session")
def tiny_blip_dir(tmp_path_factory):
    """A folder with a tiny random transformers BLIP (ITM towers), a word-level BERT tokenizer and an ImageReward
    head (`imagereward_head.safetensors`)."""
    from safetensors.torch import save_file
    from transformers import BertTokenizer, BlipConfig, BlipForImageTextRetrieval

    from flowcredit.rewards.clip import AestheticMLP
    from flowcredit.rewards.imagereward import HEAD_FILE

    d = tmp_path_factory.mktemp("tiny_blip")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "cat", "two", "blue", "dogs", "green", "car", "sign", "42"]
    BertTokenizer(vocab={w: i for i, w in enumerate(words)}).save_pretrained(d)
    cfg = BlipConfig(
        text_config=dict(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=40, bos_token_id=2, sep_token_id=3, pad_token_id=0),
        vision_config=dict(hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8),
        image_text_hidden_size=16,
    )
    torch.manual_seed(0)
    BlipForImageTextRetrieval(cfg).save_pretrained(d)
    save_file(AestheticMLP(32).state_dict(), str(d / HEAD_FILE))
    return str(d)
