"""Z-Image adapter vs the stock ZImagePipeline on tiny components built from config (offline, CPU, fp32).

What must hold: the adapter's ODE samples are the pipeline's (same initial latents, the pipeline's own sigmas and
shift / μ, its CFG form c + g·(c − u) with g = w − 1), ≤ 1e-4 relative; the ragged Qwen3 prompt embeddings are the
pipeline's; rollout log-probs are recomputed on-policy (ratio 1) with CFG at batch 1 and 4; LoRA trains 2 iterations
through Trainer with the grpo and nft objectives; its export (export / export_checkpoint / `flowcredit export`)
loads with ZImagePipeline.load_lora_weights and reproduces flowcredit's samples; the zimage_nft preset loads and is
the sd35m_nft recipe with Z-Image's pipeline settings; `--help-config` lists the family.
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

import tiny_zimage as tz

from flowcredit.samplers.policy import policy_velocity
from flowcredit.samplers.rollout import rollout, sample_ode
from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import SamplerParams, sampler_step
from flowcredit.types import cond_index, cond_repeat

# 28 and 40 Qwen tokens with the chat template: the transformer pads the captions to 32 and 64 (attention masks)
PROMPTS = ["a red cat", "a blue dog with a hat"]
T = 4


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _pipe_latents(pipe, model, x0, w, prompts=PROMPTS, steps=T, output_type="latent"):
    """ZImagePipeline's own sampling; `prompt` is copied (ZImagePipeline._encode_prompt rewrites the list in place)."""
    kw = dict(prompt=list(prompts), num_inference_steps=steps, latents=x0.clone(), output_type=output_type,
              **model.pipeline_kwargs(), **model.pipeline_guidance(w))
    return pipe(**kw).images


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tz.load_adapter().eval()


@pytest.fixture(scope="module")
def pipe():
    return tz.load_pipeline()


def test_layout_time_grid_and_guidance_form(model):
    assert model.latent_shape == (16, 8, 8) and model.image_seq_len == 16 and model.max_sequence_length == tz.MAX_SEQ
    assert model.equivalent_shift == tz.SHIFT  # static shift: the uniform grid shifted by the scheduler's 6.0
    for steps in (3, 8):
        g = model.time_grid(steps)
        assert g.shape == (steps + 1,) and g[0] == 1 and g[-1] == 0
        assert (g - time_grid(steps, tz.SHIFT, "uniform")).abs().max() <= 1e-6
    assert model.pipeline_guidance(5.0) == {"guidance_scale": 4.0}  # c + 4·(c − u) = u + 5·(c − u)
    assert model.pipeline_guidance(1.0) == {"guidance_scale": 0.0}  # the pipeline's CFG off


def test_prompt_embeddings_are_the_pipelines_ragged_list(model, pipe):
    prompts = list(PROMPTS)
    cond = model.encode_prompts(prompts)
    assert prompts == PROMPTS  # the adapter hands the pipeline a copy
    ref, _ = pipe.encode_prompt(list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=tz.MAX_SEQ)
    assert cond["prompt_embeds"].shape == (2, tz.MAX_SEQ, 32) and cond["prompt_len"].tolist() == [28, 40]
    for i, r in enumerate(ref):
        n = int(cond["prompt_len"][i])
        assert n == r.shape[0] and torch.equal(cond["prompt_embeds"][i, :n], r)
        assert not cond["prompt_embeds"][i, n:].any()


@pytest.mark.parametrize("w", [1.0, 5.0])  # 5.0 = ZImagePipeline guidance_scale 4 (the Z-Image card's setting)
def test_ode_samples_equal_pipeline(model, pipe, w):
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), w, init_noise=x0)
    ref = _pipe_latents(pipe, model, x0, w)
    assert torch.equal(pipe.scheduler.sigmas, model.time_grid(T))  # the grid the pipeline itself just used
    assert ref.shape == ours.shape == (2, *model.latent_shape)
    assert _rel(ours, ref) <= 1e-4 and (ours - ref).abs().max() <= (0.0 if w == 1.0 else 1e-5)
    assert (ours - x0).abs().max() > 0.1  # the model moved the latents
    img = _pipe_latents(pipe, model, x0, w, output_type="pt")
    ours_img = model.decode(ours)
    assert ours_img.dtype == torch.float32 and ours_img.shape == img.shape == (2, 3, tz.RESOLUTION, tz.RESOLUTION)
    assert (ours_img - img).abs().max() <= 1e-5


def test_dynamic_shift_scheduler_uses_the_pipelines_mu(model, pipe):
    """The released schedulers shift statically; with `use_dynamic_shifting` both sides use mu = calculate_shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    dyn = FlowMatchEulerDiscreteScheduler.from_config(model.scheduler.config, use_dynamic_shifting=True)
    old = model.scheduler, pipe.scheduler
    model.scheduler, pipe.scheduler = dyn, FlowMatchEulerDiscreteScheduler.from_config(dyn.config)
    try:
        assert model.equivalent_shift == pytest.approx(math.exp(model.mu))
        assert (model.time_grid(T) - time_grid(T, model.equivalent_shift, "uniform")).abs().max() <= 1e-6
        x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(3))
        ours = sample_ode(model, PROMPTS, model.time_grid(T), 1.0, init_noise=x0)
        ref = _pipe_latents(pipe, model, x0, 1.0)
        assert torch.equal(pipe.scheduler.sigmas, model.time_grid(T)) and torch.equal(ours, ref)
    finally:
        model.scheduler, pipe.scheduler = old


@pytest.mark.parametrize("batch", [1, 4])
def test_on_policy_parity_with_cfg(model, batch):
    """Rollout log π_old == log π_θ recomputed by policy_velocity + sampler_step(x_next=...) (ratio 1); the batch mixes
    caption lengths (the transformer's masked path), so per-sample recomputes regroup differently padded batches."""
    prompts = [PROMPTS[i % 2] for i in range(batch)]
    w = 5.0
    grid = model.time_grid(3)
    params = SamplerParams(name="flow_sde")
    cond = model.encode_prompts(prompts)
    uncond = cond_repeat(model.encode_prompts([""]), batch)
    traj = rollout(model, prompts, [{}] * batch, torch.arange(batch) // 2, timesteps=grid, sampler=params,
                   guidance_scale=w, generator=torch.Generator().manual_seed(0), cond=cond, uncond=uncond)
    assert traj.step_mask.any() and traj.latents.shape == (batch, 4, *model.latent_shape)
    with torch.no_grad():
        for j in range(3):
            t, tn = grid[j].expand(batch), grid[j + 1].expand(batch)
            v = policy_velocity(model, traj.latents[:, j], t, cond, uncond, w)
            lp = sampler_step(params, traj.latents[:, j], v, t, tn, x_next=traj.latents[:, j + 1]).log_prob
            assert torch.equal(lp, traj.log_probs[:, j])
            for b in range(batch):
                i = torch.tensor([b])
                vb = policy_velocity(model, traj.latents[i, j], t[i], cond_index(cond, i), cond_index(uncond, i), w)
                lpb = sampler_step(params, traj.latents[i, j], vb, t[i], tn[i], x_next=traj.latents[i, j + 1]).log_prob
                assert (lpb - traj.log_probs[i, j]).abs().max() <= 1e-5


def test_lora_targets_reference_checkpointing_and_trainable_sets():
    lora = tz.load_adapter(trainable="lora")
    names = [n for n, p in lora.net.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and ".attention.to_" in n for n in names)
    assert {n.split(".")[0] for n in names} == {"layers", "noise_refiner", "context_refiner"}
    base = tz.load_adapter()
    x = torch.randn(2, *lora.latent_shape, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([0.8, 0.3])
    cond = lora.encode_prompts(PROMPTS)
    with torch.no_grad():
        for p in lora.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
        with lora.reference() as ref:
            v_ref = ref.velocity(x, t, cond)
        assert torch.equal(v_ref, base.velocity(x, t, cond))  # adapter disabled == the base model
        assert (lora.velocity(x, t, cond) - v_ref).abs().max() > 1e-3
    grads = []
    for ckpt in (False, True):  # the transformer's own gradient checkpointing: same LoRA gradients
        m = tz.load_adapter(trainable="lora", gradient_checkpointing=ckpt).train()
        with torch.no_grad():
            for p, q in zip(m.trainable_parameters(), lora.trainable_parameters()):
                p.copy_(q)
        (m.velocity(x, t, cond) ** 2).mean().backward()
        grads.append([p.grad for p in m.trainable_parameters()])
    assert m.net.is_gradient_checkpointing and all((a - b).abs().max() <= 1e-6 for a, b in zip(*grads))
    full = tz.load_adapter(trainable="modulation")
    mod = {n for n, p in full.net.named_parameters() if p.requires_grad}
    assert mod and all(n.startswith("t_embedder.") or ".adaLN_modulation." in n for n in mod)
    assert {n.split(".")[0] for n in mod} == {"t_embedder", "layers", "noise_refiner", "all_final_layer"}
    full.configure_trainable("blocks")
    blocks = {n.split(".")[0] for n, p in full.net.named_parameters() if p.requires_grad}
    assert blocks == {"layers", "noise_refiner", "context_refiner"}
    assert not any(p.requires_grad for p in full.vae.parameters()) and not any(
        p.requires_grad for p in full.text_encoders.parameters())
    with pytest.raises(ValueError, match="built with a LoRA adapter"):
        lora.configure_trainable("blocks")


def test_bf16_autocast_returns_fp32():
    m = tz.load_adapter(precision="bf16", trainable="lora")
    assert m.net.dtype == torch.bfloat16 and m.vae.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in m.trainable_parameters())
    v = m.velocity(torch.randn(1, *m.latent_shape), torch.tensor([0.5]), m.encode_prompts(["a"]))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


@pytest.mark.parametrize("missing", ["text_encoder", "tokenizer"])
def test_missing_component_is_named(tmp_path, missing):
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.diffusers_common import ModelLayoutError
    from flowcredit.models.factory import build_model

    d = tmp_path / "broken"
    shutil.copytree(tz.tiny_model_dir(), d)
    shutil.rmtree(d / missing)
    with pytest.raises(ModelLayoutError) as e:
        build_model(ModelCfg(name="zimage", path=str(d), precision="fp32"))
    msg = str(e.value)
    assert "\n" not in msg and f"'{missing}/'" in msg and "ZImagePipeline" in msg and "text_encoder_2" not in msg


# ---------------------------------------------------------------------------------------------------------------
# Training through Trainer (LoRA, 2 iterations) and the LoRA export
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA trained for 2 iterations by Trainer (flow_grpo credit, grpo objective, CFG w=2, lr 1e-2)."""
    from flowcredit.trainer.loop import Trainer

    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("run-zimage")
    tr = Trainer(tz.train_config("flow_grpo", run, "optim.ema_decay=0"))
    tr.setup()
    before = {n: p.detach().clone() for n, p in tr.model.net.named_parameters() if p.requires_grad}
    res = tr.train()
    tr.model.eval()
    return tr, run, before, res


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_grpo_trains_two_iterations_with_lora(trained):
    tr, run, before, res = trained
    assert res["iterations"] == 2 and tr.cfg.objective.name == "grpo" and tr.model.latent_shape == (16, 8, 8)
    recs = _metrics(run)
    assert len(recs) == 2
    for r in recs:
        assert r["parity_max_abs_dlogp"] <= 1e-5 and r["pairs_trained"] > 0
        assert torch.isfinite(torch.tensor([r["loss"], r["kl"], r["reward_mean"]])).all()
    assert recs[1]["kl"] > 0  # the LoRA moved away from the reference (adapter disabled)
    assert before and all("lora_" in n for n in before)
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in tr.model.net.named_parameters() if n in before)
    assert moved > 0
    assert (run / "checkpoints" / "iter000002" / "manifest.json").is_file()


def test_nft_trains_two_iterations_with_lora(tmp_path):
    from flowcredit.trainer.loop import Trainer

    cfg = tz.train_config("flow_grpo", tmp_path / "run", "objective.name=nft", "sampler.name=ode",
                          "sampler.guidance_scale=1.0", "optim.kl_beta=1e-4")
    tr = Trainer(cfg)
    tr.setup()
    before = {n: p.detach().clone() for n, p in tr.model.net.named_parameters() if p.requires_grad}
    assert tr.train()["iterations"] == 2 and tr.cfg.objective.name == "nft"
    recs = _metrics(tmp_path / "run")
    assert len(recs) == 2 and all(r["pairs_trained"] > 0 and math.isfinite(r["loss"]) for r in recs)
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.model.net.named_parameters()
               if n in before) > 0


def test_memory_preflight_probe_runs_on_the_ragged_cond(model):
    from flowcredit.trainer.preflight import probe_activations

    fixed, per_pair = probe_activations(model, guidance=5.0)
    assert per_pair > 0 and fixed >= 0


@pytest.mark.parametrize("w", [1.0, 5.0])
def test_lora_export_loads_into_fresh_pipeline_and_reproduces_samples(trained, tmp_path, w):
    from flowcredit.models.export import LORA_WEIGHTS, export

    model = trained[0].model
    out = export(model, tmp_path / "lora")
    assert (out / LORA_WEIGHTS).is_file()
    info = json.loads((out / "flowcredit_export.json").read_text())
    assert info["family"] == "zimage" and info["pipeline"] == "ZImagePipeline" and info["format"] == "diffusers-lora"
    assert info["lora"]["folded_scales"] == [2.0]
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), w, init_noise=x0)
    pipe = tz.load_pipeline()
    base = _pipe_latents(pipe, model, x0, w)
    pipe.load_lora_weights(str(out))
    loaded = _pipe_latents(pipe, model, x0, w)
    assert (ours - base).abs().max() > 1e-3  # the LoRA changed the samples ...
    assert _rel(ours, loaded) <= 1e-4 and (ours - loaded).abs().max() <= (0.0 if w == 1.0 else 1e-5)  # ... reproduced
    pipe.fuse_lora()
    assert _rel(ours, _pipe_latents(pipe, model, x0, w)) <= 1e-4


def test_checkpoint_and_cli_export_equal_the_live_export(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    from flowcredit.cli.main import main
    from flowcredit.models.export import LORA_WEIGHTS, export, export_checkpoint

    tr, run, _, _ = trained
    live = load_file(str(export(tr.model, tmp_path / "live") / LORA_WEIGHTS))
    ck = load_file(str(export_checkpoint(run, tmp_path / "ckpt") / LORA_WEIGHTS))
    assert main(["export", str(run), str(tmp_path / "cli")]) == 0
    assert f"exported to {tmp_path / 'cli'}" in capsys.readouterr().out
    cli = load_file(str(tmp_path / "cli" / LORA_WEIGHTS))
    for other in (ck, cli):
        assert live.keys() == other.keys() and all(torch.equal(live[k], other[k]) for k in live)
    assert all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in live)
    x0 = torch.randn(2, *tr.model.latent_shape, generator=torch.Generator().manual_seed(6))
    ours = sample_ode(tr.model, PROMPTS, tr.model.time_grid(T), 1.0, init_noise=x0)
    pipe = tz.load_pipeline()
    pipe.load_lora_weights(str(tmp_path / "cli"))
    assert _rel(ours, _pipe_latents(pipe, tr.model, x0, 1.0)) <= 1e-4


def test_cli_sample_of_the_run_equals_sample_ode_of_the_trained_model(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    from flowcredit.cli.main import main
    from flowcredit.eval.evaluate import line_noise

    tr, run, _, _ = trained
    tensors = tmp_path / "x.safetensors"
    argv = ["sample", PROMPTS[0], "--checkpoint", str(run), "--steps", "2", "--cfg", "5.0", "--n", "1",
            "--out", str(tmp_path / "g.png"), "--save-tensors", str(tensors)]
    assert main(argv) == 0
    assert "model: zimage (base " in capsys.readouterr().out
    noise = line_noise(0, range(1), tuple(tr.model.latent_shape))
    with torch.no_grad():
        want = tr.model.decode(sample_ode(tr.model, PROMPTS[:1], tr.model.time_grid(2), 5.0, init_noise=noise))
    assert (load_file(str(tensors))["images"] - want).abs().max() <= 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Preset and registry
# ---------------------------------------------------------------------------------------------------------------


def test_zimage_nft_preset_is_the_sd35m_nft_recipe_with_zimage_pipeline_settings():
    from flowcredit.cli.main import PRESET_DIR
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    z = load_config(TrainConfig, "zimage_nft", [], preset_dirs=[PRESET_DIR])
    sd = load_config(TrainConfig, "sd35m_nft", [], preset_dirs=[PRESET_DIR])
    assert "NO PUBLISHED RECIPE" in (Path(PRESET_DIR) / "zimage_nft.yaml").read_text()
    for section in ("objective", "credit", "data", "reward", "optim", "run"):  # the recipe itself is SD3.5-M's
        assert getattr(z, section) == getattr(sd, section), section
    assert z.objective.name == "nft" and z.objective.options["beta"] == 1.0 and z.optim.lr == 3e-4
    assert (z.data.group_size, z.sampler.num_steps, z.run.eval_steps) == (24, 10, 40)
    m = z.model
    assert (m.name, m.trainable, m.precision, m.lora_rank, m.lora_alpha, m.lora_targets) == (
        "zimage", "lora", "bf16", 32, 64.0, [])
    assert m.gradient_checkpointing and m.options == {"resolution": 512, "max_sequence_length": 512}
    # Z-Image's pipeline grid: linspace(1, 1/T, T) through the static shift 6.0 = the uniform grid at shift 6
    assert (z.sampler.grid, z.sampler.shift, z.sampler.guidance_scale, z.sampler.name) == ("uniform", 6.0, 1.0, "ode")
    for key in ("noise_level", "timestep_fraction", "train_steps_per_sample", "train_step_draw"):
        assert getattr(z.sampler, key) == getattr(sd.sampler, key), key


def test_help_config_lists_the_family(capsys):
    from flowcredit.cli.main import main

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out.splitlines()
    i = out.index("  model.name=zimage: Z-Image / Z-Image-Turbo (Tongyi-MAI) through diffusers")
    assert out[i + 1].startswith("    model.options.resolution: int | null = null")
    assert any(line.startswith("    model.options.max_sequence_length:") for line in out[i + 1: i + 5])
