"""Qwen-Image adapter vs the stock QwenImagePipeline on tiny components built from config (offline, CPU, fp32).

What must hold (issue "The models people train now, and the official recipes, exactly", Qwen-Image): the adapter's
ODE samples are the pipeline's (same init latents, the pipeline's own sigmas with dynamic μ and terminal stretch, its
true CFG with the negative prompt and the norm rescale) within 1e-4 relative; rollout log-probs are recomputed
exactly on-policy (ratio 1) with true CFG at batch 1 and 4; LoRA training runs 2 iterations through Trainer with
objective grpo and nft; the LoRA export (export, export_checkpoint, `flowcredit export`) loads into a FRESH
QwenImagePipeline with `load_lora_weights` and reproduces flowcredit's samples; the presets load; --help-config lists
the family.
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

import tiny_qwen_image as tq

from flowcredit.samplers.policy import policy_velocity
from flowcredit.samplers.rollout import rollout, sample_ode
from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import SamplerParams, sampler_step
from flowcredit.types import cond_index

PROMPTS = ["a red cat", "a blue dog with a hat"]  # different lengths: padded batch + mask
W = 4.0  # flow_grpo's true_cfg_scale for Qwen-Image
T = 3
REL = 1e-4  # the tolerance: max |Δ| / max |reference|, fp32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tq.load_adapter(true_cfg_scale=W).eval()


@pytest.fixture(scope="module")
def pipe():
    return tq.load_pipeline()


def _pipe_latents(pipe, model, x0, prompts=PROMPTS, steps=T):
    kw = dict(prompt=list(prompts), num_inference_steps=steps, latents=x0.clone(), output_type="latent",
              **model.pipeline_kwargs(len(prompts)))
    return pipe(**kw).images


def test_tokenizer_and_layout(model, pipe):
    tok = pipe.tokenizer
    ids = tok(pipe.prompt_template_encode.format("a cat")).input_ids
    assert pipe.prompt_template_encode_start_idx == 34 and tok.decode(ids[:34]).endswith("<|im_start|>user\n")
    n = tq.RESOLUTION // pipe.vae_scale_factor // 2
    assert model.latent_shape == (n * n, 16)
    z = torch.randn(3, 4, 2 * n, 2 * n)
    packed = pipe._pack_latents(z, 3, 4, 2 * n, 2 * n)
    assert torch.equal(model.pack(z), packed) and torch.equal(model.unpack(packed), z)
    assert torch.equal(model.unpack(packed)[:, :, None],
                       pipe._unpack_latents(packed, tq.RESOLUTION, tq.RESOLUTION, pipe.vae_scale_factor))


def test_time_grid_is_the_pipelines(model, pipe):
    x0 = torch.randn(1, *model.latent_shape)
    for steps in (3, 10):
        _pipe_latents(pipe, model, x0, PROMPTS[:1], steps)
        g = model.time_grid(steps)
        assert torch.equal(g, pipe.scheduler.sigmas)  # the sigmas QwenImagePipeline.__call__ just stepped with
        assert g[0] == 1 and g[-1] == 0 and g[-2] == pytest.approx(0.02)  # Qwen-Image's shift_terminal
        # = the trainer's uniform grid at shift exp(mu), stretched so its last non-zero time is 0.02
        u = time_grid(steps, model.equivalent_shift, "uniform")[:-1].double()
        stretched = 1 - (1 - u) / ((1 - u[-1]) / (1 - 0.02))
        assert (g[:-1].double() - stretched).abs().max() <= 1e-6
    assert model.equivalent_shift == pytest.approx(math.exp(model.mu))


@pytest.mark.parametrize("w", [1.0, W])
def test_ode_samples_equal_pipeline(pipe, w):
    m = tq.load_adapter(true_cfg_scale=w).eval()
    x0 = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = sample_ode(m, PROMPTS, m.time_grid(4), 1.0, init_noise=x0)  # flowcredit's CFG off: the model's own CFG
    ref = _pipe_latents(pipe, m, x0, steps=4)
    assert ref.shape == ours.shape == (2, *m.latent_shape)
    assert _rel(ours, ref) <= REL and (ours - x0).abs().max() > 0.1
    img = pipe(prompt=PROMPTS, num_inference_steps=4, latents=x0.clone(), output_type="pt",
               **m.pipeline_kwargs(2)).images
    ours_img = m.decode(ours)
    assert ours_img.dtype == torch.float32 and ours_img.shape == img.shape == (2, 3, tq.RESOLUTION, tq.RESOLUTION)
    assert (ours_img - img).abs().max() <= REL


def test_true_cfg_is_the_pipelines_form(model):
    cond = model.encode_prompts(PROMPTS)
    assert set(cond) == {"prompt_embeds", "prompt_mask", "negative_embeds", "negative_mask"}
    assert cond["prompt_mask"].sum(1).tolist()[0] < cond["prompt_mask"].shape[1]  # the short prompt is padded
    x = torch.randn(2, *model.latent_shape)
    t = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        v = model.velocity(x, t, cond)
        one = tq.load_adapter(true_cfg_scale=1.0).eval()
        c = one.velocity(x, t, one.encode_prompts(PROMPTS))
        u = one.velocity(x, t, one.encode_prompts([model.negative_prompt] * 2))
    m = u + W * (c - u)
    assert (v - m * c.norm(dim=-1, keepdim=True) / m.norm(dim=-1, keepdim=True)).abs().max() <= 1e-5
    assert (v - m).abs().max() > 1e-3  # not flowcredit's linear CFG
    with pytest.raises(ValueError, match="guide twice"):  # sampler.guidance_scale != 1 asks for "" → refused
        model.encode_prompts([""])


@pytest.mark.parametrize("batch", [1, 4])
def test_on_policy_parity_with_true_cfg(model, batch):
    """Rollout log π_old == log π_θ recomputed by policy_velocity + sampler_step(x_next=...) (ratio exactly 1)."""
    prompts = [PROMPTS[i % 2] for i in range(batch)]
    grid = model.time_grid(T)
    params = SamplerParams(name="flow_sde")
    cond = model.encode_prompts(prompts)
    traj = rollout(model, prompts, [{}] * batch, torch.arange(batch) // 2, timesteps=grid, sampler=params,
                   guidance_scale=1.0, generator=torch.Generator().manual_seed(0), cond=cond, uncond=None)
    assert traj.step_mask.any()
    with torch.no_grad():
        for j in range(T):
            t, tn = grid[j].expand(batch), grid[j + 1].expand(batch)
            v = policy_velocity(model, traj.latents[:, j], t, cond, None, 1.0)
            lp = sampler_step(params, traj.latents[:, j], v, t, tn, x_next=traj.latents[:, j + 1]).log_prob
            assert torch.equal(lp, traj.log_probs[:, j])  # same batch, same code: bit-identical
            for b in range(batch):  # the trainer's micro-batches regroup samples: per-sample recompute
                i = torch.tensor([b])
                vb = policy_velocity(model, traj.latents[i, j], t[i], cond_index(cond, i), None, 1.0)
                lpb = sampler_step(params, traj.latents[i, j], vb, t[i], tn[i], x_next=traj.latents[i, j + 1]).log_prob
                assert (lpb - traj.log_probs[i, j]).abs().max() <= 1e-5


def test_lora_targets_reference_and_modulation():
    lora = tq.load_adapter(trainable="lora", true_cfg_scale=W)
    names = [n for n, p in lora.net.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert any(".img_mlp.net.2.lora_" in n for n in names) and any(".attn.add_q_proj.lora_" in n for n in names)
    with torch.no_grad():
        for p in lora.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
        x = torch.randn(1, *lora.latent_shape)
        cond = lora.encode_prompts(["a"])
        t = torch.tensor([0.6])
        with lora.reference() as ref:
            v_ref = ref.velocity(x, t, cond)
        assert torch.equal(v_ref, tq.load_adapter(true_cfg_scale=W).velocity(x, t, cond))
        assert (lora.velocity(x, t, cond) - v_ref).abs().max() > 1e-3
    m = tq.load_adapter(trainable="all")
    m.configure_trainable("modulation")
    mod = {n for n, p in m.net.named_parameters() if p.requires_grad}
    assert {n.split(".")[1] for n in mod if ".img_mod." in n} == {"0", "1"} and any(".txt_mod." in n for n in mod)
    assert all(n.startswith(("time_text_embed.", "norm_out.")) or ".img_mod." in n or ".txt_mod." in n for n in mod)


def test_preflight_probe_counts_the_internal_cfg():
    from flowcredit.trainer import preflight

    per_pair = []
    for w in (1.0, W):
        preflight._PROBE_CACHE.clear()  # keyed by the ModelCfg, which does not hold from_pretrained's kwargs here
        per_pair.append(preflight.probe_activations(tq.load_adapter(trainable="lora", true_cfg_scale=w))[1])
    preflight._PROBE_CACHE.clear()
    assert per_pair[1] > 1.6 * per_pair[0]  # two branches per pair are saved for the backward


def test_missing_component_is_named(tmp_path):
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.diffusers_common import ModelLayoutError
    from flowcredit.models.factory import build_model

    d = tmp_path / "broken"
    shutil.copytree(tq.tiny_model_dir(), d)
    shutil.rmtree(d / "text_encoder")
    with pytest.raises(ModelLayoutError) as e:
        build_model(ModelCfg(name=tq.KIND, path=str(d), precision="fp32"))
    msg = str(e.value)
    assert "\n" not in msg and "'text_encoder/'" in msg and "QwenImagePipeline" in msg and "tokenizer/" in msg


# ---------------------------------------------------------------------------------------------------- training


def _train(tmp_path, objective: str, *extra: str):
    from flowcredit.trainer.loop import Trainer

    over = ["objective.name=nft", "sampler.name=ode"] if objective == "nft" else []
    cfg = tq.train_config("flow_grpo", tmp_path / "run", *over, *extra)
    tr = Trainer(cfg)
    tr.setup()
    before = {n: p.detach().clone() for n, p in tr.model.net.named_parameters() if p.requires_grad}
    res = tr.train()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return tr, res, recs, before


@pytest.mark.parametrize("objective", ["grpo", "nft"])
def test_lora_trains_two_iterations(tmp_path, objective):
    tr, res, recs, before = _train(tmp_path, objective)
    assert res["iterations"] == 2 and len(recs) == 2
    assert tr.model.true_cfg_scale == W and tr.model.latent_shape == (16, 16)
    for r in recs:
        assert r["pairs_trained"] > 0
        assert torch.isfinite(torch.tensor([r["loss"], r["kl"], r["reward_mean"]])).all()
        if objective == "grpo":
            assert r["parity_max_abs_dlogp"] <= 1e-5
    assert recs[1]["kl"] > 0  # the LoRA moved away from the reference (adapter disabled)
    assert all("lora_" in n for n in before)
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in tr.model.net.named_parameters() if n in before)
    assert moved > 0


# ------------------------------------------------------------------------------------------------------ export


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA trained for 2 iterations by Trainer (flow_grpo, true CFG 4, lr 1e-2 so the adapter moves)."""
    from flowcredit.trainer.loop import Trainer

    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("run-qwen-image")
    tr = Trainer(tq.train_config("flow_grpo", run, "optim.ema_decay=0"))
    tr.setup()
    tr.train()
    tr.model.eval()
    return tr, run


def test_lora_export_loads_into_fresh_pipeline(trained, tmp_path):
    from flowcredit.models.export import LORA_WEIGHTS, export

    tr, _ = trained
    model = tr.model
    out = export(model, tmp_path / "lora")
    info = json.loads((out / "flowcredit_export.json").read_text())
    assert info["family"] == tq.KIND and info["format"] == "diffusers-lora" and info["lora"]["folded_scales"] == [2.0]
    assert info["true_cfg_scale"] == W and (out / LORA_WEIGHTS).is_file()
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), 1.0, init_noise=x0)
    pipe = tq.load_pipeline()
    base = _pipe_latents(pipe, model, x0)
    pipe.load_lora_weights(str(out))
    loaded = _pipe_latents(pipe, model, x0)
    assert _rel(ours, base) > 1e-3  # the LoRA changed the samples ...
    assert _rel(ours, loaded) <= REL  # ... and the deployed pipeline reproduces them


def test_checkpoint_and_cli_export_equal_live_export(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    from flowcredit.cli.main import main
    from flowcredit.models.export import LORA_WEIGHTS, export, export_checkpoint

    tr, run = trained
    a = load_file(str(export(tr.model, tmp_path / "live") / LORA_WEIGHTS))
    b = load_file(str(export_checkpoint(run, tmp_path / "ckpt") / LORA_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in a)
    assert main(["export", str(run), str(tmp_path / "cli")]) == 0
    assert f"exported to {tmp_path / 'cli'}" in capsys.readouterr().out
    c = load_file(str(tmp_path / "cli" / LORA_WEIGHTS))
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)
    x0 = torch.randn(2, *tr.model.latent_shape, generator=torch.Generator().manual_seed(7))
    ours = sample_ode(tr.model, PROMPTS, tr.model.time_grid(T), 1.0, init_noise=x0)
    pipe = tq.load_pipeline()
    pipe.load_lora_weights(str(tmp_path / "cli"))
    assert _rel(ours, _pipe_latents(pipe, tr.model, x0)) <= REL


# ----------------------------------------------------------------------------------------------------- presets


def test_trainer_steps_on_the_pipelines_own_grid_with_sampler_grid_model(tmp_path):
    """sampler.grid=model: the rollout grid is model.time_grid (the scheduler's sigmas with its dynamic shift and
    terminal stretch), which no uniform grid at any sampler.shift reproduces."""
    from flowcredit.samplers.schedules import time_grid
    from flowcredit.trainer.loop import Trainer

    tr = Trainer(tq.train_config("flow_grpo", tmp_path / "run", "sampler.grid=model"))
    tr.setup()
    T = tr.cfg.sampler.num_steps
    own = tr.model.time_grid(T)
    assert torch.equal(tr.timesteps, own.float().cpu()) and tr.timesteps[0] == 1 and tr.timesteps[-1] == 0
    uniform = time_grid(T, tr.model.equivalent_shift, "uniform")
    assert (uniform - own).abs().max() > 1e-3  # the terminal stretch: not the uniform grid at exp(mu)


@pytest.mark.parametrize("name", ["qwen_image_flow_grpo", "qwen_image_nft"])
def test_presets_load_and_mirror_the_recipes(name):
    from flowcredit.cli.main import PRESET_DIR
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    cfg = load_config(TrainConfig, name, [], preset_dirs=[PRESET_DIR])
    mc, s = cfg.model, cfg.sampler
    assert mc.name == "qwen_image" and mc.trainable == "lora" and mc.precision == "bf16" and cfg.run.device == "cuda"
    assert mc.options["resolution"] == 512 and s.guidance_scale == 1.0 and cfg.run.eval_guidance == 1.0
    assert s.grid == "model"  # the pipeline's own sigmas: dynamic shift exp(mu) = 1.7138 at 512 px + terminal stretch
    assert cfg.optim.lr == 3e-4 and cfg.run.eval_steps == 50
    if name == "qwen_image_flow_grpo":  # flow_grpo config/grpo.py:pickscore_qwenimage + scripts/train_qwenimage.py
        assert mc.options["true_cfg_scale"] == 4.0 and mc.options["negative_prompt"] == " "
        assert (mc.lora_rank, mc.lora_alpha) == (64, 128.0) and mc.gradient_checkpointing
        assert cfg.method == "flow_grpo" and cfg.objective.name == "grpo" and s.name == "flow_sde"
        assert s.noise_level == 1.2 and s.num_steps == 10 and cfg.data.group_size == 16
        assert cfg.optim.kl_beta == 0 and cfg.optim.clip_range == 1e-4 and cfg.credit.adv_clip == 5.0
        assert cfg.reward.name == "pickscore" and cfg.optim.ema_decay == 0
    else:  # no published DiffusionNFT recipe for Qwen-Image: sd35m_nft's structure, CFG-free
        assert mc.options.get("true_cfg_scale", 1.0) == 1.0 and cfg.objective.name == "nft" and s.name == "ode"
        assert cfg.objective.options["beta"] == 1.0 and cfg.optim.kl_beta == 1e-4 and s.num_steps == 10


def test_help_config_lists_the_family(capsys):
    from flowcredit.cli.main import main

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "qwen_image" in out and "true_cfg_scale" in out and "negative_prompt" in out
