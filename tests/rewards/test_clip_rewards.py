"""CLIP-family rewards on a tiny random CLIPModel loaded from a folder: shapes, determinism, documented scaling."""

from __future__ import annotations

import pytest
import torch

from flowcredit.rewards.registry import build_reward

pytest.importorskip("transformers", reason="model rewards need transformers: pip install 'flowcredit[rewards]'")

PROMPTS = ["a red cat", "two blue dogs", "a green car", "sign 42"]


def _reference_cos(folder, images, prompts):
    """cos(text, image) computed independently with the transformers model on hand-preprocessed pixels."""
    from transformers import AutoTokenizer, CLIPModel

    m = CLIPModel.from_pretrained(folder, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    x = (images * 255).round() / 255
    x = torch.nn.functional.interpolate(x, size=(32, int(32 * 48 / 40)), mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    left = (x.shape[-1] - 32) // 2
    x = x[..., :, left:left + 32]
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    with torch.no_grad():
        ie = m.get_image_features(pixel_values=(x - mean) / std)
        te = m.get_text_features(**tok(prompts, padding=True, return_tensors="pt"))
    ie = getattr(ie, "pooler_output", ie)
    te = getattr(te, "pooler_output", te)
    cos = torch.nn.functional.cosine_similarity(ie, te, dim=-1)
    return cos, float(m.logit_scale.detach().exp())


def test_pickscore_scaling_shapes_determinism(tiny_clip_dir, rand_images):
    r = build_reward("pickscore", model=tiny_clip_dir, local_files_only=True, batch_size=3)  # 2 chunks
    out = r(rand_images, PROMPTS, [{}] * 4)
    assert out.scores.shape == (4,) and out.scores.dtype == torch.float32
    cos, scale = _reference_cos(tiny_clip_dir, rand_images, PROMPTS)
    torch.testing.assert_close(out.components["cos"], cos, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.scores, scale * cos / 26, atol=1e-5, rtol=1e-5)  # flow_grpo's /26
    again = r(rand_images, PROMPTS, [{}] * 4)
    assert torch.equal(out.scores, again.scores)
    # the score depends on the prompt and on the image
    assert not torch.allclose(r(rand_images, PROMPTS[::-1], [{}] * 4).scores, out.scores)


def test_clipscore_and_hpsv2_scaling(tiny_clip_dir, rand_images):
    cs = build_reward("clipscore", model=tiny_clip_dir, w=2.5)
    out = cs(rand_images, PROMPTS, [{}] * 4)
    torch.testing.assert_close(out.scores, 2.5 * out.components["cos"].clamp(min=0))
    assert out.scores.min() >= 0 and out.scores.max() <= 2.5
    hps = build_reward("hpsv2", model=tiny_clip_dir, scale=100.0)
    h = hps(rand_images, PROMPTS, [{}] * 4)
    torch.testing.assert_close(h.components["cos"], out.components["cos"])
    torch.testing.assert_close(h.scores, 100.0 * h.components["cos"])


def test_aesthetic_head_from_file(tiny_clip_dir, rand_images, tmp_path):
    from safetensors.torch import save_file

    from flowcredit.rewards.clip import AestheticMLP

    torch.manual_seed(3)
    head = AestheticMLP(16)
    save_file(head.state_dict(), str(tmp_path / "head.safetensors"))
    torch.save(head.state_dict(), tmp_path / "head.pth")
    a = build_reward("aesthetic", model=tiny_clip_dir, head=str(tmp_path / "head.safetensors"))
    b = build_reward("aesthetic", model=tiny_clip_dir, head=str(tmp_path / "head.pth"))
    out = a(rand_images, PROMPTS, [{}] * 4)
    assert out.scores.shape == (4,)
    torch.testing.assert_close(out.scores, b(rand_images, PROMPTS, [{}] * 4).scores)
    emb = a.clip.image_embeds(rand_images)
    assert torch.allclose(emb.norm(dim=-1), torch.ones(4), atol=1e-5)  # the head sees L2-normalized embeddings
    torch.testing.assert_close(out.scores, head.eval()(emb).squeeze(-1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs head="):
        build_reward("aesthetic", model=tiny_clip_dir)


def test_missing_weights_is_a_clear_error_not_a_download(tmp_path):
    with pytest.raises(ValueError, match="local_files_only=True"):
        build_reward("pickscore", model=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="local_files_only=True"):
        build_reward("clipscore", model="no-such-org/no-such-clip-model")
