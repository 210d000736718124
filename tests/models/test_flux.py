"""FLUX.1 adapter vs the stock FluxPipeline on tiny components built from config (offline, CPU, fp32).

The protocol latent is the packed (L, D) token sequence; these tests show the shape-generic samplers run on it:
ODE samples equal FluxPipeline's (embedded guidance, and true CFG with negative_prompt=""), on-policy parity with CFG
at batch 1 and 4, every method trains 2 iterations, a folder missing a component is named.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_diffusers as td  # noqa: E402

from flowcredit.samplers.policy import policy_velocity  # noqa: E402
from flowcredit.samplers.rollout import rollout, sample_ode  # noqa: E402
from flowcredit.samplers.schedules import time_grid  # noqa: E402
from flowcredit.samplers.sde import SamplerParams, sampler_step  # noqa: E402
from flowcredit.types import cond_index, cond_repeat  # noqa: E402

KIND = "flux"
PROMPTS = ["a red cat", "a blue dog"]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return td.load_adapter(KIND).eval()


@pytest.fixture(scope="module")
def pipe():
    return td.load_pipeline(KIND, td.tiny_model_dir(KIND))


def test_packed_latent_layout(model, pipe):
    n = td.RESOLUTION // 2  # VAE factor 1 here, then 2×2 packing
    assert model.latent_shape == (n * n, 16)
    z = torch.randn(3, 4, td.RESOLUTION, td.RESOLUTION)
    packed = pipe._pack_latents(z, 3, 4, td.RESOLUTION, td.RESOLUTION)
    assert torch.equal(model.pack(z), packed)
    assert torch.equal(model.unpack(packed), z)
    assert torch.equal(model.unpack(packed), pipe._unpack_latents(packed, td.RESOLUTION, td.RESOLUTION, pipe.vae_scale_factor))


def test_time_grid_is_the_schedulers_and_a_shifted_uniform_grid(model):
    mu = model.mu
    assert model.equivalent_shift == pytest.approx(math.exp(mu))
    for T in (3, 6):
        g = model.time_grid(T)
        assert g.shape == (T + 1,) and g[0] == 1 and g[-1] == 0
        assert (g - time_grid(T, model.equivalent_shift, "uniform")).abs().max() <= 1e-6


@pytest.mark.parametrize("true_cfg", [1.0, 3.0])
def test_ode_samples_equal_pipeline(model, pipe, true_cfg):
    T = 4
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), true_cfg, init_noise=x0)
    kw = dict(prompt=PROMPTS, num_inference_steps=T, **model.pipeline_kwargs())
    if true_cfg != 1.0:
        kw.update(negative_prompt="", true_cfg_scale=true_cfg)
    ref = pipe(latents=x0.clone(), output_type="latent", **kw).images
    assert ref.shape == ours.shape
    assert (ours - ref).abs().max() <= 1e-5
    img = pipe(latents=x0.clone(), output_type="pt", **kw).images
    ours_img = model.decode(ours)
    assert ours_img.shape == img.shape == (2, 3, td.RESOLUTION, td.RESOLUTION)
    assert (ours_img - img).abs().max() <= 1e-5


def test_embedded_guidance_is_used(model):
    x = torch.randn(1, *model.latent_shape)
    cond = model.encode_prompts(["a"])
    t = torch.tensor([0.5])
    with torch.no_grad():
        v1 = model.velocity(x, t, cond)
        old = model.embedded_guidance
        model.embedded_guidance = 1.0
        try:
            v2 = model.velocity(x, t, cond)
        finally:
            model.embedded_guidance = old
    assert (v1 - v2).abs().max() > 1e-4


@pytest.mark.parametrize("batch", [1, 4])
def test_on_policy_parity_with_cfg(model, batch):
    prompts = [f"shape {i % 2}" for i in range(batch)]
    T, w = 3, 3.0
    grid = model.time_grid(T)
    params = SamplerParams(name="flow_sde")
    cond = model.encode_prompts(prompts)
    uncond = cond_repeat(model.encode_prompts([""]), batch)
    traj = rollout(model, prompts, [{}] * batch, torch.arange(batch) // 2, timesteps=grid, sampler=params,
                   guidance_scale=w, generator=torch.Generator().manual_seed(0), cond=cond, uncond=uncond)
    assert traj.latents.shape == (batch, T + 1, *model.latent_shape)
    with torch.no_grad():
        for j in range(T):
            t, tn = grid[j].expand(batch), grid[j + 1].expand(batch)
            v = policy_velocity(model, traj.latents[:, j], t, cond, uncond, w)
            lp = sampler_step(params, traj.latents[:, j], v, t, tn, x_next=traj.latents[:, j + 1]).log_prob
            assert torch.equal(lp, traj.log_probs[:, j])
            for b in range(batch):
                i = torch.tensor([b])
                vb = policy_velocity(model, traj.latents[i, j], t[i], cond_index(cond, i), cond_index(uncond, i), w)
                lpb = sampler_step(params, traj.latents[i, j], vb, t[i], tn[i], x_next=traj.latents[i, j + 1]).log_prob
                assert (lpb - traj.log_probs[i, j]).abs().max() <= 1e-5


def test_lora_targets_and_reference():
    lora = td.load_adapter(KIND, trainable="lora")
    names = [n for n, p in lora.net.named_parameters() if p.requires_grad]
    assert any(".ff.net.2.lora_" in n for n in names) and any("single_transformer_blocks" in n for n in names)
    with torch.no_grad():
        for p in lora.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
        x = torch.randn(1, *lora.latent_shape)
        cond = lora.encode_prompts(["a"])
        t = torch.tensor([0.6])
        with lora.reference() as ref:
            v_ref = ref.velocity(x, t, cond)
        assert torch.equal(v_ref, td.load_adapter(KIND).velocity(x, t, cond))
        assert (lora.velocity(x, t, cond) - v_ref).abs().max() > 1e-3


def test_modulation_trains_the_conditioning_path_of_both_block_kinds():
    m = td.load_adapter(KIND, trainable="all")
    params = m.configure_trainable("modulation")
    names = {n for n, p in m.net.named_parameters() if p.requires_grad}
    assert params and len(params) == len(names)
    double = {n for n in names if n.startswith("transformer_blocks.")}
    single = {n for n in names if n.startswith("single_transformer_blocks.")}
    assert double and all(".norm1.linear." in n or ".norm1_context.linear." in n for n in double)
    assert single and all(".norm.linear." in n for n in single)
    assert {n for n in names if n.startswith("time_text_embed.")}  # timestep, guidance and pooled-text embeddings
    rest = names - double - single
    assert all(n.startswith(("time_text_embed.", "norm_out.linear.")) for n in rest)
    assert not any(".attn." in n or ".ff." in n or "proj_mlp" in n for n in names)
    with pytest.raises(ValueError, match="built with a LoRA adapter"):
        td.load_adapter(KIND, trainable="lora").configure_trainable("modulation")


@pytest.mark.parametrize("missing", ["text_encoder_2", "vae"])
def test_missing_component_is_named(tmp_path, missing):
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.diffusers_common import ModelLayoutError
    from flowcredit.models.factory import build_model

    d = tmp_path / "broken"
    shutil.copytree(td.tiny_model_dir(KIND), d)
    shutil.rmtree(d / missing)
    with pytest.raises(ModelLayoutError) as e:
        build_model(ModelCfg(name=KIND, path=str(d), precision="fp32"))
    msg = str(e.value)
    assert "\n" not in msg and f"'{missing}/'" in msg and "FluxPipeline" in msg
    assert "tokenizer_2/" in msg and "text_encoder_3" not in msg


@pytest.mark.parametrize("method", ["flow_grpo", "stepwise", "vgpo"])
def test_methods_train_two_iterations(tmp_path, method):
    from flowcredit.trainer.loop import Trainer

    cfg = td.train_config(KIND, method, tmp_path / "run")
    tr = Trainer(cfg)
    tr.setup()
    assert tr.model.latent_shape == (64, 16)
    res = tr.train()
    assert res["iterations"] == 2
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["parity_max_abs_dlogp"] <= 1e-5 and r["pairs_trained"] > 0
        assert torch.isfinite(torch.tensor([r["loss"], r["kl"], r["reward_mean"]])).all()
    assert recs[1]["kl"] > 0
