"""ImageReward on transformers' BLIP: tiny random model from a folder, and the original-checkpoint key renaming."""

from __future__ import annotations

import pytest
import torch

from flowcredit.rewards.imagereward import MEAN, STD
from flowcredit.rewards.registry import build_reward

pytest.importorskip("transformers", reason="model rewards need transformers: pip install 'flowcredit[rewards]'")

PROMPTS = ["a red cat", "two blue dogs", "a green car", "sign 42"]


def _original_key(k: str) -> str:
    """Test-side inverse of the renaming: transformers BLIP names → ImageReward.pt (BLIP vit.py / med.py) names."""
    if k.startswith("vision_model."):
        k = k.replace("vision_model.embeddings.class_embedding", "visual_encoder.cls_token")
        k = k.replace("vision_model.embeddings.position_embedding", "visual_encoder.pos_embed")
        k = k.replace("vision_model.embeddings.patch_embedding.", "visual_encoder.patch_embed.proj.")
        k = k.replace("vision_model.post_layernorm.", "visual_encoder.norm.")
        k = k.replace("vision_model.encoder.layers.", "visual_encoder.blocks.")
        k = k.replace(".self_attn.projection.", ".attn.proj.").replace(".self_attn.qkv.", ".attn.qkv.")
        k = k.replace(".layer_norm1.", ".norm1.").replace(".layer_norm2.", ".norm2.")
    return "blip." + k


def test_imagereward_folder_scaling_and_determinism(tiny_blip_dir, rand_images):
    r = build_reward("imagereward", model=tiny_blip_dir, batch_size=3)
    out = r(rand_images, PROMPTS, [{}] * 4)
    assert out.scores.shape == (4,) and out.scores.dtype == torch.float32
    torch.testing.assert_close(out.scores, (out.components["raw"] - MEAN) / STD)  # ImageReward's standardization
    assert torch.equal(out.scores, r(rand_images, PROMPTS, [{}] * 4).scores)
    # independent recomputation of the raw score with the transformers modules
    from transformers import AutoTokenizer, BlipForImageTextRetrieval

    m = BlipForImageTextRetrieval.from_pretrained(tiny_blip_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_blip_dir)
    px = r.preprocess(rand_images)
    with torch.no_grad():
        img = m.vision_model(pixel_values=px).last_hidden_state
        t = tok(PROMPTS, padding="max_length", max_length=35, truncation=True, return_tensors="pt")
        h = m.text_encoder(input_ids=t["input_ids"], attention_mask=t["attention_mask"], encoder_hidden_states=img,
                           encoder_attention_mask=torch.ones(img.shape[:-1], dtype=torch.long)).last_hidden_state[:, 0]
        raw = r.head(h).squeeze(-1)
    torch.testing.assert_close(out.components["raw"], raw, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(r(rand_images, PROMPTS[::-1], [{}] * 4).scores, out.scores)


def test_imagereward_from_original_checkpoint_layout(tiny_blip_dir, rand_images, tmp_path):
    from transformers import BlipForImageTextRetrieval

    from safetensors.torch import load_file

    from flowcredit.rewards.imagereward import HEAD_FILE, convert_checkpoint

    m = BlipForImageTextRetrieval.from_pretrained(tiny_blip_dir)
    sd = {_original_key(k): v for k, v in m.state_dict().items() if not k.startswith("itm_head.")}
    sd["blip.text_encoder.embeddings.position_ids"] = torch.arange(40)[None]  # a buffer the original file carries
    sd.update({"mlp." + k: v for k, v in load_file(f"{tiny_blip_dir}/{HEAD_FILE}").items()})
    torch.save(sd, tmp_path / "ImageReward.pt")
    kw = dict(checkpoint=str(tmp_path / "ImageReward.pt"), config=tiny_blip_dir, tokenizer=tiny_blip_dir, image_size=32)
    a = build_reward("imagereward", **kw)
    b = build_reward("imagereward", model=tiny_blip_dir)
    torch.testing.assert_close(a(rand_images, PROMPTS, [{}] * 4).scores, b(rand_images, PROMPTS, [{}] * 4).scores)
    conv = convert_checkpoint(kw["checkpoint"], tiny_blip_dir, tiny_blip_dir, str(tmp_path / "converted"), image_size=32)
    c = build_reward("imagereward", model=conv)
    torch.testing.assert_close(c(rand_images, PROMPTS, [{}] * 4).scores, b(rand_images, PROMPTS, [{}] * 4).scores)
    # a key that maps nowhere is an error naming it, never a silent partial load
    sd["blip.visual_encoder.blocks.0.extra.weight"] = torch.zeros(1)
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="extra.weight"):
        build_reward("imagereward", **{**kw, "checkpoint": str(tmp_path / "bad.pt")})
    with pytest.raises(ValueError, match="not downloaded"):
        build_reward("imagereward")
