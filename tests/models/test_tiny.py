"""The built-in tiny model: tokenizer coverage of the prompt generator, velocity contract, save/load, shipped asset."""

from __future__ import annotations

import time

import pytest
import torch

import torch.nn.functional as F

from flowcredit.config.schema import ModelCfg
from flowcredit.models.factory import build_model
from flowcredit.models.tiny import (
    ASSET_DIR,
    SHIPPED_NAME,
    TinyDiTConfig,
    TinyFlowModel,
    attention,
    modulate,
    timestep_embedding,
)
from flowcredit.models.tokenizer import SPECIAL_TOKENS, WordTokenizer
from flowcredit.shapes.prompts import make_splits

SMALL = dict(width=32, depth=1, heads=2)


def _perturbed_model(seed: int = 0) -> TinyFlowModel:
    """A random tiny model whose zero-initialised adaLN/output layers are perturbed, so outputs are non-trivial."""
    torch.manual_seed(seed)
    model = TinyFlowModel(TinyDiTConfig(**SMALL))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("resolution", [32, 64])
def test_tokenizer_covers_every_generated_prompt(resolution):
    tok = TinyFlowModel(TinyDiTConfig(resolution=resolution, **SMALL)).tokenizer
    unk = tok.stoi["[UNK]"]
    splits = make_splits(resolution)
    prompts = sorted({r["prompt"] for key in ("train", "test", "test_lines") for r in splits[key]})
    assert len(prompts) > 100
    for p in prompts:
        words = tok.split(p)
        assert all(w in tok.stoi for w in words), (p, [w for w in words if w not in tok.stoi])
        assert len(words) + 1 <= tok.max_length, p  # [CLS] + words fit: nothing is truncated
        ids, mask = tok([p])
        assert (ids[0] != unk).all(), p
        assert int(mask[0].sum()) == len(words) + 1
        # round trip: ids decode back to the words of the prompt
        assert [tok.itos[i] for i in ids[0, 1 : len(words) + 1].tolist()] == words


def test_tokenizer_empty_prompt_and_unknown_word():
    tok = WordTokenizer(["a", "photo"], max_length=6)
    assert tok.itos[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    ids, mask = tok(["", "a zebra photo"])
    assert ids.shape == (2, 6) and ids.dtype == torch.long and mask.dtype == torch.bool
    assert ids[0].tolist() == [tok.stoi["[CLS]"]] + [tok.stoi["[PAD]"]] * 5
    assert mask[0].tolist() == [True] + [False] * 5
    assert ids[1, :4].tolist() == [tok.stoi["[CLS]"], tok.stoi["a"], tok.stoi["[UNK]"], tok.stoi["photo"]]


def test_velocity_shape_dtype_and_decode_range():
    model = _perturbed_model()
    B = 3
    cond = model.encode_prompts(["a photo of a red circle", "", "a photo of two squares"])
    x = torch.randn(B, *model.latent_shape)
    with torch.no_grad():
        v = model.velocity(x, torch.tensor([1.0, 0.5, 0.1]), cond)
    assert model.latent_shape == (3, 32, 32)
    assert v.shape == x.shape and v.dtype == torch.float32
    assert torch.isfinite(v).all() and v.abs().sum() > 0
    # the prompt matters (text conditioning is wired in)
    assert not torch.allclose(v[0], v[1])
    img = model.decode(x)
    assert img.shape == (B, 3, 32, 32) and img.min() >= 0 and img.max() <= 1
    torch.testing.assert_close(model.encode_images(model.decode(x.clamp(-1, 1))), x.clamp(-1, 1))


def test_velocity_bf16_autocast_returns_fp32():
    model = _perturbed_model()
    model.compute_dtype = torch.bfloat16
    cond = model.encode_prompts(["a photo of a red circle"])
    with torch.no_grad():
        v = model.velocity(torch.randn(1, *model.latent_shape), torch.tensor([0.5]), cond)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def _qkv_mask(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, 2, 12, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    mask = torch.ones(3, 1, 1, 12, dtype=torch.bool)
    mask[0, ..., 2:4] = False  # padded text keys of one row
    return q, k, v, mask


def test_attention_bf16_explicit_path_matches_sdpa():
    """bf16 on CPU takes the explicit path (fp32 scores/softmax): the same function as SDPA up to bf16 rounding,
    masked keys get zero weight, and the gradients agree too."""
    q, k, v, mask = _qkv_mask(torch.bfloat16)
    out = attention(q, k, v, mask)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    # a masked key's value never leaks into the output
    v2 = v.detach().clone()
    v2[0, :, 2:4] = 1e3
    torch.testing.assert_close(attention(q.detach(), k.detach(), v2, mask)[0], out.detach()[0])
    out.float().square().sum().backward()
    ref.square().sum().backward()
    for a, b in ((q, q32), (k, k32), (v, v32)):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad.float(), b.grad, atol=0.1, rtol=5e-2)


def test_attention_fp32_is_sdpa_exactly():
    q, k, v, mask = _qkv_mask(torch.float32)
    assert torch.equal(attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert torch.equal(attention(q, k, v, None), F.scaled_dot_product_attention(q, k, v))


def _velocity_without_shortcuts(net, x_t, t, ids, mask):
    """TinyDiT written out plainly: all max_text_len text positions (padding too) through every block, every token a
    query in every block, the image tokens taken at the end."""
    txt, pooled = net.text(ids, mask)
    img = net.patch_in(net.patchify(x_t)) + net.pos_img
    c = net.t_mlp(timestep_embedding(t, net.cfg.width)) + net.pool_mlp(pooled)
    h = torch.cat([txt, img], dim=1)
    keys = torch.cat([mask, torch.ones(mask.shape[0], img.shape[1], dtype=torch.bool)], 1)[:, None, None, :]
    for blk in net.blocks:
        h = blk(h, c, keys)
    shift, scale = net.ada_out(c).chunk(2, dim=-1)
    return net.unpatchify(net.patch_out(modulate(net.norm_out(h[:, txt.shape[1] :]), shift, scale)))


def test_padding_cut_and_image_only_last_block_compute_the_same_velocity():
    """The forward cuts the text to the batch's longest prompt and lets only image tokens query in the last block; the
    velocity equals the plain computation over all 16 positions, and a prompt's velocity does not depend on the
    length of the other prompts in its batch (cached text encoder included)."""
    model = _perturbed_model(3)
    model.net.blocks.append(type(model.net.blocks[0])(32, 2, 4.0))  # depth 2: a block before the last one
    with torch.no_grad():
        for p in model.net.blocks[1].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    prompts = ["a photo of a red circle", "a photo of two blue squares left of a green triangle"]
    x, t = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0)), torch.tensor([0.9, 0.4])
    cond = model.encode_prompts(prompts)
    assert int(cond["mask"].sum(1).max()) < model.cfg.max_text_len  # padding to cut
    with torch.no_grad():
        v = model.velocity(x, t, cond)
        plain = _velocity_without_shortcuts(model.net, x, t, cond["ids"], cond["mask"])
        alone = model.velocity(x[:1], t[:1], model.encode_prompts(prompts[:1]))  # cut to 6 instead of 12 tokens
        torch.testing.assert_close(v, plain, rtol=0, atol=1e-5)
        torch.testing.assert_close(alone, v[:1], rtol=0, atol=1e-5)
        model.net.text.requires_grad_(False)  # frozen: encode_prompts caches the (cut) encoder output
        cached = model.encode_prompts(prompts)
        assert cached["txt"].shape[1] == model.cfg.max_text_len
        v_cached, v_recomputed = model.velocity(x, t, cached), model.velocity(x, t, {k: cond[k] for k in ("ids", "mask")})
        assert torch.equal(v_cached, v_recomputed)  # the cache holds what the forward computes on the cut text
        torch.testing.assert_close(v_cached, v, rtol=0, atol=1e-5)
    assert v.abs().mean() > 0.1  # a non-trivial velocity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rollout_and_update_velocities_are_bit_identical(dtype):
    """Rollouts (eval mode, no grad) and updates (train mode, grad) compute the same function bit for bit — in
    particular the text encoder never takes PyTorch's eval-only fused path (0.06 apart in bf16 before)."""
    model = _perturbed_model(5)
    model.compute_dtype = dtype
    cond = model.encode_prompts(["a photo of a red circle", "a photo of two squares"])
    assert "txt" not in cond  # full fine-tune: the text encoder runs inside every velocity call
    x, t = torch.randn(2, *model.latent_shape), torch.tensor([0.8, 0.3])
    model.eval()
    with torch.no_grad():
        a = model.velocity(x, t, cond)
    model.train()
    b = model.velocity(x, t, cond)
    assert torch.equal(a, b.detach())
    assert torch.backends.mha.get_fastpath_enabled()  # the global switch is restored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_text_encoder_output_is_computed_once_and_equals_recomputing(dtype):
    """With the text encoder frozen, encode_prompts carries its output; velocity then skips the encoder and returns
    exactly what recomputing it gives — also for row subsets (micro-batches). Unfrozen or another dtype: recomputed."""
    model = _perturbed_model(9)
    model.compute_dtype = dtype
    prompts = ["a photo of a red circle", "", "a photo of two squares"]
    x, t = torch.randn(3, *model.latent_shape), torch.tensor([0.9, 0.5, 0.2])
    assert "txt" not in model.encode_prompts(prompts)  # trainable text encoder (full fine-tune): nothing cached
    model.net.text.requires_grad_(False)
    cond = model.encode_prompts(prompts)
    assert cond["txt"].shape == (3, model.cfg.max_text_len, model.cfg.width) and cond["pooled"].shape == (3, 32)
    plain = {"ids": cond["ids"], "mask": cond["mask"]}
    with torch.no_grad():
        cached, recomputed = model.velocity(x, t, cond), model.velocity(x, t, plain)
        rows = torch.tensor([2, 0])
        sub = model.velocity(x[rows], t[rows], {k: v[rows] for k, v in cond.items()})
        sub_plain = model.velocity(x[rows], t[rows], {k: v[rows] for k, v in plain.items()})
    assert torch.equal(cached, recomputed) and torch.equal(sub, sub_plain)
    calls = []
    hook = model.net.text.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        model.velocity(x, t, cond)
    assert calls == []  # the encoder did not run
    model.compute_dtype = torch.bfloat16 if dtype == torch.float32 else torch.float32  # stale dtype: recompute
    with torch.no_grad():
        assert torch.equal(model.velocity(x, t, cond), model.velocity(x, t, plain))
    assert len(calls) == 2
    model.compute_dtype = dtype
    model.net.text.requires_grad_(True)  # unfrozen after encoding: the cache is ignored, gradients reach the encoder
    model.velocity(x, t, cond).square().sum().backward()
    assert len(calls) == 3 and model.net.text.embed.weight.grad is not None
    hook.remove()


def test_gelu_option_exact_vs_tanh(tmp_path):
    """model.options.gelu: exact swaps the tanh-approximated GELU for erf GELU — a velocity within the
    approximation's 4.7e-4 per activation, recorded in the config so save/load and checkpoints keep it."""
    model = _perturbed_model(7)
    cond = model.encode_prompts(["a photo of a red circle"])
    x, t = torch.randn(1, *model.latent_shape), torch.tensor([0.6])
    with torch.no_grad():
        v_tanh = model.velocity(x, t, cond)
        model.set_gelu("exact")
        v_exact = model.velocity(x, t, cond)
    assert model.cfg.gelu == "exact"
    assert all(m.approximate == "none" for m in model.net.modules() if isinstance(m, torch.nn.GELU))
    assert not torch.equal(v_tanh, v_exact)
    torch.testing.assert_close(v_exact, v_tanh, atol=1e-3, rtol=0)
    loaded = TinyFlowModel.load(model.save(tmp_path, name="m"))
    assert loaded.cfg.gelu == "exact"
    with torch.no_grad():
        assert torch.equal(loaded.velocity(x, t, cond), v_exact)
    with pytest.raises(ValueError, match="gelu"):
        model.set_gelu("fast")
    with pytest.raises(ValueError, match="gelu"):
        TinyFlowModel(TinyDiTConfig(**SMALL, gelu="fast"))


def test_build_model_applies_the_gelu_option(tmp_path):
    assert build_model(ModelCfg(name="tiny")).cfg.gelu == "tanh"  # the shipped model as pretrained
    saved = _perturbed_model(2)
    saved.set_gelu("exact")
    path = saved.save(tmp_path, name="exact")
    assert build_model(ModelCfg(name="tiny", path=str(path))).cfg.gelu == "exact"  # no option: the weights' config
    assert build_model(ModelCfg(name="tiny", path=str(path), options={"gelu": "tanh"})).cfg.gelu == "tanh"
    built = build_model(ModelCfg(name="tiny", options={"gelu": "exact"}))
    assert built.cfg.gelu == "exact"
    assert all(m.approximate == "none" for m in built.net.modules() if isinstance(m, torch.nn.GELU))
    with pytest.raises(ValueError, match=r"model\.options\.gelu"):
        ModelCfg(name="tiny", options={"gelu": "fast"})


def test_save_load_is_bit_exact(tmp_path):
    model = _perturbed_model(3)
    path = model.save(tmp_path, name="m", extra={"note": "test"})
    assert path == tmp_path / "m.safetensors" and (tmp_path / "m.json").exists()
    loaded = TinyFlowModel.load(path)
    assert loaded.cfg == model.cfg
    assert not loaded.training
    x = torch.randn(2, *model.latent_shape)
    t = torch.tensor([0.9, 0.2])
    with torch.no_grad():
        a = model.velocity(x, t, model.encode_prompts(["a photo of a cross", ""]))
        b = loaded.velocity(x, t, loaded.encode_prompts(["a photo of a cross", ""]))
    assert torch.equal(a, b)
    # a directory holding one weights file loads too
    assert torch.equal(TinyFlowModel.load(tmp_path).net.patch_out.weight, model.net.patch_out.weight)


def test_load_missing_file_has_clear_error(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors.*not found"):
        TinyFlowModel.load(missing)
    with pytest.raises(FileNotFoundError, match="no .safetensors file"):
        TinyFlowModel.load(tmp_path)
    TinyFlowModel(TinyDiTConfig(**SMALL)).save(tmp_path, name="m")
    (tmp_path / "m.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"m\.json.*missing"):
        TinyFlowModel.load(tmp_path / "m.safetensors")


SHIPPED = ASSET_DIR / f"{SHIPPED_NAME}.safetensors"


@pytest.mark.skipif(not SHIPPED.exists(), reason=f"shipped checkpoint models/assets/{SHIPPED.name} not produced yet (pretraining)")
def test_shipped_checkpoint_small_and_fast():
    assert SHIPPED.stat().st_size <= 20 * 2**20
    t0 = time.perf_counter()
    model = TinyFlowModel.load(None)
    assert time.perf_counter() - t0 < 2.0
    assert model.latent_shape == (3, 32, 32)
    with torch.no_grad():
        v = model.velocity(torch.randn(1, *model.latent_shape), torch.tensor([0.5]), model.encode_prompts(["a photo of a red circle"]))
    assert torch.isfinite(v).all()


# ---------------------------------------------------------------------------------------------------------------
# LoRA (peft) on the tiny model: model.trainable=lora
# ---------------------------------------------------------------------------------------------------------------


def _inputs(model: TinyFlowModel, batch: int = 3, seed: int = 0):
    """x_t: (B, 3, R, R); t: (B,); cond of B prompts."""
    g = torch.Generator().manual_seed(seed)
    R = model.cfg.resolution
    x = torch.randn(batch, 3, R, R, generator=g)
    t = torch.rand(batch, generator=g)
    cond = model.encode_prompts(["a photo of a red circle", "a photo of two blue squares", ""][:batch])
    return x, t, cond


def _lora_model(rank: int = 4) -> tuple[TinyFlowModel, TinyFlowModel]:
    """(plain, the same weights + a LoRA adapter whose B is perturbed so that the adapter changes the velocity)."""
    pytest.importorskip("peft")
    plain = _perturbed_model()
    lora = TinyFlowModel(plain.cfg)
    lora.net.load_state_dict(plain.net.state_dict())
    lora.add_lora(rank, 2.0 * rank)
    return plain, lora


def test_lora_starts_as_the_base_model_and_wraps_only_the_block_linears():
    plain, lora = _lora_model()
    names = [n for n, _ in lora.net.named_parameters() if "lora_" in n]
    wrapped = sorted({n.split(".lora_")[0] for n in names})
    # 4 linears per block (qkv, proj, mlp.0, mlp.2); each gets lora_A and lora_B
    assert len(wrapped) == 4 * plain.cfg.depth and len(names) == 2 * len(wrapped)
    assert all(n.startswith("blocks.") for n in wrapped)
    x, t, cond = _inputs(plain)
    with torch.no_grad():
        # B = 0 at init: the same velocity up to float summation order (x·W and x·W + 0·(x·A))
        torch.testing.assert_close(lora.velocity(x, t, cond), plain.velocity(x, t, cond), atol=1e-6, rtol=1e-6)


def test_lora_merged_state_dict_reproduces_the_adapter_and_reference_disables_it():
    plain, lora = _lora_model()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in lora.net.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    x, t, cond = _inputs(plain)
    with torch.no_grad():
        v_lora = lora.velocity(x, t, cond)
        v_base = plain.velocity(x, t, cond)
        assert (v_lora - v_base).abs().max() > 1e-3  # the adapter acts
        merged = TinyFlowModel(plain.cfg)
        merged.net.load_state_dict(lora.merged_state_dict())  # strict: plain keys only
        torch.testing.assert_close(merged.velocity(x, t, cond), v_lora, atol=1e-5, rtol=1e-5)
    # the reference context = the base model; requires_grad flags come back exactly
    lora.net.requires_grad_(False)
    for n, p in lora.net.named_parameters():
        p.requires_grad_("lora_" in n)
    flags = {n: p.requires_grad for n, p in lora.net.named_parameters()}
    with torch.no_grad(), lora.reference() as ref:
        torch.testing.assert_close(ref.velocity(x, t, cond), v_base, atol=1e-6, rtol=1e-6)
    assert {n: p.requires_grad for n, p in lora.net.named_parameters()} == flags
    with torch.no_grad():
        assert torch.equal(lora.velocity(x, t, cond), v_lora)  # adapter back on
    assert not hasattr(plain, "reference")  # full fine-tunes: the trainer keeps a frozen copy instead


def test_lora_save_writes_a_plain_model(tmp_path):
    plain, lora = _lora_model()
    with torch.no_grad():
        for n, p in lora.net.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)
    path = lora.save(tmp_path, name="merged")
    back = TinyFlowModel.load(path)
    x, t, cond = _inputs(plain)
    with torch.no_grad():
        torch.testing.assert_close(back.velocity(x, t, cond), lora.velocity(x, t, cond), atol=1e-5, rtol=1e-5)


def test_lora_bad_targets_one_line_error():
    pytest.importorskip("peft")
    with pytest.raises(ValueError, match=r"model.lora_targets=\['nope'\] matched no linear layer of the tiny DiT.*use names like"):
        _perturbed_model().add_lora(4, 8.0, ["nope"])


def test_lora_without_peft_one_line_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(ValueError, match=r"^model.trainable=lora needs peft: pip install 'flowcredit\[diffusers\]'$"):
        _perturbed_model().add_lora(4, 8.0)
