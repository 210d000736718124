"""FLUX.2 adapter (models/flux2.py) vs the stock Flux2Pipeline ([dev]) and Flux2KleinPipeline ([klein]) on tiny
components built from config (tests/models/tiny_flux2.py: offline, CPU, fp32).

What must hold: the adapter's ODE samples are the pipelines' own (same initial latents, the pipelines' sigmas and
empirical mu, [dev]'s embedded guidance, [klein]'s true CFG) within 1e-4 relative, latents and decoded images; the
rollout log-probs are recomputed exactly on-policy (ratio 1); LoRA training through Trainer runs 2 iterations
with the grpo and the nft objective; the LoRA export (export, export_checkpoint, `flowcredit export`) loads into a
FRESH pipeline with `load_lora_weights` and reproduces flowcredit's samples; the presets load and carry the recipe;
`--help-config` lists the family.
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

import tiny_flux2 as tf

from flowcredit.samplers.policy import policy_velocity
from flowcredit.samplers.rollout import rollout, sample_ode
from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import SamplerParams, sampler_step
from flowcredit.types import cond_index, cond_repeat

PROMPTS = ["a red cat", "a blue dog"]
GUIDANCE = {"flux2": 1.0, "flux2_klein": 3.0}  # [dev] is guidance-distilled (no CFG); [klein] base uses true CFG
CASES = [("flux2", 1.0), ("flux2_klein", 1.0), ("flux2_klein", 3.0)]
REL = 1e-4  # the parity bound: max |Δ| ≤ 1e-4 · max |reference| in fp32


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {kind: tf.load_adapter(kind).eval() for kind in tf.KINDS}


@pytest.fixture(scope="module")
def pipes():
    return {kind: tf.load_pipeline(kind, tf.tiny_model_dir(kind)) for kind in tf.KINDS}


def pipe_latents(pipe, model, x0, cfg_scale, T, output_type="latent"):
    """The pipeline's own samples from flowcredit's initial latents (the pipelines take the (B, 4C, h/2, w/2) grid)."""
    return pipe(prompt=PROMPTS, num_inference_steps=T, latents=model.unpack(x0.clone()), output_type=output_type,
                **model.pipeline_kwargs(cfg_scale)).images


def as_pipeline_latent(model, x):
    """flowcredit's packed latents in the layout of the pipeline's output_type="latent" (klein returns VAE latents)."""
    return x if model.variant == "dev" else model.to_vae_latents(x)


# ------------------------------------------------------------------------------------------------ layout, grid
def test_variant_is_read_from_the_folder(models, tmp_path):
    from flowcredit.models.flux2 import Flux2FlowModel, Flux2KleinFlowModel, resolve_variant

    assert resolve_variant(tf.tiny_model_dir("flux2")) == "dev"
    assert resolve_variant(tf.tiny_model_dir("flux2_klein")) == "klein"
    assert resolve_variant("black-forest-labs/FLUX.2-klein-base-4B") == "klein"
    assert resolve_variant("black-forest-labs/FLUX.2-dev") == "dev"
    with pytest.raises(ValueError, match="valid: auto, dev, klein"):
        resolve_variant(tf.tiny_model_dir("flux2"), "schnell")
    other = tmp_path / "kv"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinKVPipeline"}))
    with pytest.raises(ValueError, match="holds a Flux2KleinKVPipeline"):
        resolve_variant(other)
    assert type(models["flux2"]) is Flux2FlowModel and type(models["flux2_klein"]) is Flux2KleinFlowModel
    assert models["flux2"].pipeline_name == "Flux2Pipeline"
    assert models["flux2_klein"].pipeline_name == "Flux2KleinPipeline"
    assert models["flux2"].embedded_guidance == 4.0 and models["flux2_klein"].embedded_guidance is None
    assert not models["flux2_klein"].is_distilled
    with pytest.raises(ValueError, match="no guidance embedding"):
        Flux2FlowModel.from_pretrained(tf.tiny_model_dir("flux2_klein"), embedded_guidance=2.0)


@pytest.mark.parametrize("kind", tf.KINDS)
def test_packed_latent_layout(models, pipes, kind):
    model, pipe = models[kind], pipes[kind]
    n = tf.RESOLUTION // 2  # VAE factor 1 here, then 2×2 patches
    assert model.latent_shape == (n * n, 16)
    grid = torch.randn(3, 16, n, n)
    packed = pipe._pack_latents(grid)
    assert torch.equal(model.pack(grid), packed) and torch.equal(model.unpack(packed), grid)
    ids = pipe._prepare_latent_ids(grid)
    assert torch.equal(model.img_ids, ids[0])
    assert torch.equal(model.unpack(packed), pipe._unpack_latents_with_ids(packed, ids))
    assert model.to_vae_latents(packed).shape == (3, 4, tf.RESOLUTION, tf.RESOLUTION)


@pytest.mark.parametrize("kind", tf.KINDS)
def test_time_grid_is_the_schedulers_and_a_shifted_uniform_grid(models, kind):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    model = models[kind]
    for T in (3, 6):
        g = model.time_grid(T)
        assert g.shape == (T + 1,) and g[0] == 1 and g[-1] == 0
        assert model.mu(T) == compute_empirical_mu(model.latent_shape[0], T)  # depends on the step count too
        assert model.equivalent_shift(T) == pytest.approx(math.exp(model.mu(T)))
        assert (g - time_grid(T, model.equivalent_shift(T), "uniform")).abs().max() <= 1e-6
    assert model.mu(3) != model.mu(6)


# --------------------------------------------------------------------------------------------- pipeline parity
@pytest.mark.parametrize("kind,cfg_scale", CASES)
def test_ode_samples_equal_pipeline(models, pipes, kind, cfg_scale):
    """Same initial latents, the pipeline's own sigmas / mu and guidance form: latents and images agree."""
    model, pipe = models[kind], pipes[kind]
    T = 4
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), cfg_scale, init_noise=x0)
    ref = pipe_latents(pipe, model, x0, cfg_scale, T)
    assert torch.equal(pipe.scheduler.sigmas, model.time_grid(T))  # the grid the pipeline just sampled on
    mine = as_pipeline_latent(model, ours)
    assert mine.shape == ref.shape
    assert rel_err(mine, ref) <= REL
    img = pipe_latents(pipe, model, x0, cfg_scale, T, output_type="pt")
    ours_img = model.decode(ours)
    assert ours_img.dtype == torch.float32 and ours_img.shape == img.shape == (2, 3, tf.RESOLUTION, tf.RESOLUTION)
    assert (ours_img - img).abs().max() <= 1e-5


def test_guidance_forms(models):
    """[dev]: the embedded guidance changes the velocity (one call per step); [klein]: none, and no CFG on [dev]."""
    dev = models["flux2"]
    x = torch.randn(1, *dev.latent_shape)
    cond, t = dev.encode_prompts(["a"]), torch.tensor([0.5])
    with torch.no_grad():
        v1 = dev.velocity(x, t, cond)
        dev.embedded_guidance = 1.0
        try:
            v2 = dev.velocity(x, t, cond)
        finally:
            dev.embedded_guidance = 4.0
    assert (v1 - v2).abs().max() > 1e-4
    assert dev.pipeline_kwargs()["guidance_scale"] == 4.0
    with pytest.raises(ValueError, match="no true CFG"):
        dev.pipeline_kwargs(3.0)
    assert models["flux2_klein"].pipeline_kwargs(3.0)["guidance_scale"] == 3.0
    assert not models["flux2_klein"].net.config.guidance_embeds


@pytest.mark.parametrize("kind", tf.KINDS)
def test_on_policy_parity(models, kind):
    """Rollout log π_old == log π_θ recomputed by policy_velocity + sampler_step (ratio 1), CFG for [klein]."""
    model = models[kind]
    batch, T, w = 3, 3, GUIDANCE[kind]
    prompts = [f"shape {i % 2}" for i in range(batch)]
    grid = model.time_grid(T)
    params = SamplerParams(name="flow_sde")
    cond = model.encode_prompts(prompts)
    uncond = cond_repeat(model.encode_prompts([""]), batch)
    traj = rollout(model, prompts, [{}] * batch, torch.arange(batch) // 2, timesteps=grid, sampler=params,
                   guidance_scale=w, generator=torch.Generator().manual_seed(0), cond=cond, uncond=uncond)
    assert traj.latents.shape == (batch, T + 1, *model.latent_shape) and traj.step_mask.any()
    with torch.no_grad():
        for j in range(T):
            t, tn = grid[j].expand(batch), grid[j + 1].expand(batch)
            v = policy_velocity(model, traj.latents[:, j], t, cond, uncond, w)
            lp = sampler_step(params, traj.latents[:, j], v, t, tn, x_next=traj.latents[:, j + 1]).log_prob
            assert torch.equal(lp, traj.log_probs[:, j])
            for b in range(batch):  # micro-batches regroup samples: per-sample recompute
                i = torch.tensor([b])
                vb = policy_velocity(model, traj.latents[i, j], t[i], cond_index(cond, i), cond_index(uncond, i), w)
                lpb = sampler_step(params, traj.latents[i, j], vb, t[i], tn[i], x_next=traj.latents[i, j + 1]).log_prob
                assert (lpb - traj.log_probs[i, j]).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------------ LoRA, trainables
def test_lora_targets_reference_and_modulation(models):
    from flowcredit.models.flux2 import FLUX2_MODULATION

    lora = tf.load_adapter("flux2_klein", trainable="lora")
    names = {n.split(".lora_")[0] for n, p in lora.net.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n, p in lora.net.named_parameters() if p.requires_grad)
    assert names == {
        *(f"transformer_blocks.0.{t}" for t in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                                                "attn.to_add_out", "ff.linear_in", "ff.linear_out",
                                                "ff_context.linear_in", "ff_context.linear_out")),
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_out",
    }
    with torch.no_grad():
        for p in lora.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
        x = torch.randn(1, *lora.latent_shape)
        cond, t = lora.encode_prompts(["a"]), torch.tensor([0.6])
        with lora.reference() as ref:
            v_ref = ref.velocity(x, t, cond)
        assert torch.equal(v_ref, models["flux2_klein"].velocity(x, t, cond))
        assert (lora.velocity(x, t, cond) - v_ref).abs().max() > 1e-3
    full = tf.load_adapter("flux2", trainable="all")
    params = full.configure_trainable("modulation")
    mod = {n for n, p in full.net.named_parameters() if p.requires_grad}
    assert params and len(params) == len(mod) and {n.split(".")[0] for n in mod} == set(FLUX2_MODULATION)
    assert any(n.startswith("time_guidance_embed.guidance_embedder.") for n in mod)  # [dev]'s guidance embedding


def test_gradient_checkpointing_and_bf16():
    """The [dev] preset trains with gradient checkpointing: same LoRA gradients; bf16 autocast: fp32 velocities."""
    grads = []
    for ckpt in (False, True):
        m = tf.load_adapter("flux2", trainable="lora", gradient_checkpointing=ckpt).train()
        torch.manual_seed(0)
        for p in m.trainable_parameters():
            torch.nn.init.normal_(p, std=0.1)
        x = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(2))
        (m.velocity(x, torch.tensor([0.7, 0.2]), m.encode_prompts(PROMPTS)) ** 2).mean().backward()
        grads.append([p.grad for p in m.trainable_parameters()])
    assert m.net.is_gradient_checkpointing
    assert all((a - b).abs().max() <= 1e-6 for a, b in zip(*grads))
    b = tf.load_adapter("flux2_klein", precision="bf16", trainable="lora")
    assert b.net.dtype == torch.bfloat16 and b.vae.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in b.trainable_parameters())
    v = b.velocity(torch.randn(1, *b.latent_shape), torch.tensor([0.5]), b.encode_prompts(["a"]))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    assert torch.isfinite(b.decode(v.detach())).all()


@pytest.mark.parametrize("missing", ["text_encoder", "tokenizer"])
def test_missing_component_is_named(tmp_path, missing):
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.diffusers_common import ModelLayoutError
    from flowcredit.models.factory import build_model

    d = tmp_path / "broken"
    shutil.copytree(tf.tiny_model_dir("flux2_klein"), d)
    shutil.rmtree(d / missing)
    with pytest.raises(ModelLayoutError) as e:
        build_model(ModelCfg(name="flux2", path=str(d), precision="fp32"))
    msg = str(e.value)
    assert "\n" not in msg and f"'{missing}/'" in msg and "Flux2KleinPipeline" in msg and "scheduler/" in msg


# ---------------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module", params=tf.KINDS)
def trained(request, tmp_path_factory):
    """A LoRA trained for 2 iterations by Trainer (objective grpo on flow_sde rollouts; [klein] with CFG 3)."""
    from flowcredit.trainer.loop import Trainer

    torch.set_num_threads(1)
    kind = request.param
    run = tmp_path_factory.mktemp(f"run-{kind}")
    tr = Trainer(tf.train_config(kind, run, "optim.ema_decay=0"))
    tr.setup()
    before = {n: p.detach().clone() for n, p in tr.model.net.named_parameters() if p.requires_grad}
    tr.train()
    tr.model.eval()
    return kind, tr, run, before


def test_grpo_trains_two_lora_iterations(trained):
    kind, tr, run, before = trained
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and tr.model.latent_shape == (64, 16)
    for r in recs:
        assert r["parity_max_abs_dlogp"] <= 1e-5 and r["pairs_trained"] > 0
        assert torch.isfinite(torch.tensor([r["loss"], r["kl"], r["reward_mean"]])).all()
    assert recs[1]["kl"] > 0  # the LoRA moved away from the reference (adapter disabled)
    assert before and all("lora_" in n for n in before)
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in tr.model.net.named_parameters() if n in before)
    assert moved > 0
    assert (run / "checkpoints" / "iter000002" / "manifest.json").is_file()


@pytest.mark.parametrize("kind", tf.KINDS)
def test_nft_trains_two_lora_iterations(tmp_path, kind):
    from flowcredit.trainer.loop import Trainer

    cfg = tf.train_config(kind, tmp_path / "run", "objective.name=nft", "sampler.name=ode",
                          "sampler.guidance_scale=1.0", "optim.kl_beta=1e-4", "run.checkpoint_every=0")
    tr = Trainer(cfg)
    tr.setup()
    before = {n: p.detach().clone() for n, p in tr.model.net.named_parameters() if p.requires_grad}
    assert tr.train()["iterations"] == 2
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(r["pairs_trained"] > 0 and math.isfinite(r["loss"]) for r in recs)
    moved = [(p.detach() - before[n]).abs().max().item() for n, p in tr.model.net.named_parameters() if n in before]
    assert moved and max(moved) > 0


# ------------------------------------------------------------------------------------------------------ export
def test_lora_export_loads_into_fresh_pipeline(trained, tmp_path):
    from flowcredit.models.export import LORA_WEIGHTS, export

    kind, tr, _, _ = trained
    model = tr.model
    out = export(model, tmp_path / "lora")
    info = json.loads((out / "flowcredit_export.json").read_text())
    assert (out / LORA_WEIGHTS).is_file() and info["format"] == "diffusers-lora" and info["family"] == "flux2"
    assert info["pipeline"] == model.pipeline_name and info["lora"]["folded_scales"] == [2.0]
    T = 3
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    pipe = tf.load_pipeline(kind, tf.tiny_model_dir(kind))
    scales = sorted({1.0, GUIDANCE[kind]})
    base = {w: pipe_latents(pipe, model, x0, w, T) for w in scales}
    pipe.load_lora_weights(str(out))
    for w in scales:
        ours = as_pipeline_latent(model, sample_ode(model, PROMPTS, model.time_grid(T), w, init_noise=x0))
        assert rel_err(ours, base[w]) > 1e-3  # the LoRA changed the samples ...
        assert rel_err(ours, pipe_latents(pipe, model, x0, w, T)) <= REL  # ... and the deployed pipeline has them


def test_checkpoint_and_cli_export_equal_the_live_export_and_load(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    from flowcredit.cli.main import main
    from flowcredit.models.export import LORA_WEIGHTS, export, export_checkpoint

    kind, tr, run, _ = trained
    live = load_file(str(export(tr.model, tmp_path / "live") / LORA_WEIGHTS))
    ckpt = load_file(str(export_checkpoint(run, tmp_path / "ckpt") / LORA_WEIGHTS))
    assert main(["export", str(run), str(tmp_path / "cli")]) == 0
    assert f"exported to {tmp_path / 'cli'}" in capsys.readouterr().out
    cli = load_file(str(tmp_path / "cli" / LORA_WEIGHTS))
    assert live.keys() == ckpt.keys() == cli.keys()
    assert all(torch.equal(live[k], ckpt[k]) and torch.equal(live[k], cli[k]) for k in live)
    assert all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in live)
    assert any(k.startswith("transformer.single_transformer_blocks.0.attn.to_out.") for k in live)
    pipe = tf.load_pipeline(kind, tf.tiny_model_dir(kind))
    pipe.load_lora_weights(str(tmp_path / "cli"))
    x0 = torch.randn(2, *tr.model.latent_shape, generator=torch.Generator().manual_seed(6))
    ours = as_pipeline_latent(tr.model, sample_ode(tr.model, PROMPTS, tr.model.time_grid(3), 1.0, init_noise=x0))
    assert rel_err(ours, pipe_latents(pipe, tr.model, x0, 1.0, 3)) <= REL


# ------------------------------------------------------------------------------------------ presets, registry
@pytest.mark.parametrize("name,variant", [("flux2_nft", "dev"), ("flux2_klein_nft", "klein")])
def test_presets_load_and_carry_the_sd35m_nft_recipe(name, variant):
    """No paper publishes an RL recipe for FLUX.2: the presets are DiffusionNFT's SD3.5-M recipe (sd35m_nft) with
    FLUX.2's own pipeline settings: the time grid of the pipelines at 512 px and T = 10."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from flowcredit.cli.main import PRESET_DIR
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    cfg = load_config(TrainConfig, name, [], preset_dirs=[PRESET_DIR])
    ref = load_config(TrainConfig, "sd35m_nft", [], preset_dirs=[PRESET_DIR])
    m = cfg.model
    assert m.name == "flux2" and m.options["variant"] == variant and m.options["resolution"] == 512
    assert (m.trainable, m.precision, m.lora_rank, m.lora_alpha, m.lora_targets) == ("lora", "bf16", 32, 64.0, [])
    assert cfg.objective.name == "nft" and cfg.objective.options == ref.objective.options  # β 1, m 5, adaptive
    assert cfg.sampler.name == "ode" and cfg.sampler.guidance_scale == 1.0 and cfg.run.eval_guidance == 1.0
    assert (cfg.sampler.num_steps, cfg.run.eval_steps, cfg.sampler.timestep_fraction) == (10, 40, 0.99)
    assert (cfg.data.group_size, cfg.optim.lr, cfg.optim.kl_beta, cfg.optim.ema_decay) == (24, 3e-4, 1e-4, 0.9)
    assert cfg.reward == ref.reward and cfg.credit == ref.credit
    # Flux2Pipeline / Flux2KleinPipeline at 512 px: 1024 tokens, mu = compute_empirical_mu(1024, 10)
    assert cfg.sampler.grid == "uniform"
    assert cfg.sampler.shift == pytest.approx(math.exp(compute_empirical_mu(1024, 10)), abs=1e-4)
    if variant == "dev":
        assert m.options["embedded_guidance"] == 4.0 and m.gradient_checkpointing
    else:
        assert "embedded_guidance" not in m.options


def test_help_config_lists_the_family(capsys):
    from flowcredit.cli.main import main

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "model.name=flux2:" in out and "model.options.variant" in out and "model.options.embedded_guidance" in out
