"""Wan adapter vs the stock WanPipeline on tiny components built from config (offline, CPU, fp32).

What must hold: the protocol latent is the pipeline's 5-D video latent (C, F, h, w) with F ≥ 2 latent frames; the
adapter's ODE samples are the pipeline's (with its Euler scheduler of the hub's flow shift) within 1e-4 relative,
with and without CFG, for the Wan 2.1 and the Wan 2.2 TI2V-5B (per-token timesteps) layouts; decode returns the
pipeline's frames; rollout log-probs are recomputed exactly on-policy (ratio 1) with CFG; LoRA trains 2 iterations
through Trainer with the grpo and the nft objectives, frames scored by an image reward through FrameMeanReward;
the LoRA export (live, checkpoint, CLI) loads into a fresh WanPipeline and reproduces flowcredit's samples; the
presets load; a two-expert Wan 2.2 A14B folder is refused in one line.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_wan as tw

from flowcredit.samplers.policy import policy_velocity
from flowcredit.samplers.rollout import rollout, sample_ode
from flowcredit.samplers.schedules import time_grid
from flowcredit.samplers.sde import SamplerParams, sampler_step
from flowcredit.types import cond_index, cond_repeat

PROMPTS = ["a red cat", "a blue dog"]
T = 3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (the 1e-4 relative criterion)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _pipe_latents(pipe, model, x0, guidance, steps=T):
    return pipe(prompt=PROMPTS, latents=x0.clone(), output_type="latent", num_inference_steps=steps,
                guidance_scale=guidance, **model.pipeline_kwargs()).frames


@pytest.fixture(scope="module", params=tw.LAYOUTS)
def model_and_pipe(request):
    torch.set_num_threads(1)
    model = tw.load_adapter(request.param).eval()
    return request.param, model, tw.load_pipeline(request.param, model)


def test_video_latent_layout_and_time_grid(model_and_pipe):
    layout, model, pipe = model_and_pipe
    C, F, h, w = model.latent_shape
    vss = pipe.vae_scale_factor_spatial
    assert F == (tw.NUM_FRAMES - 1) // pipe.vae_scale_factor_temporal + 1 >= 2
    assert C == pipe.transformer.config.in_channels
    assert (h, w) == (model.height // vss, model.width // vss) and h != w
    shift = 3.0 if layout == "wan21" else 5.0  # wan21 ships the hub's UniPC(flow_shift 3): replaced by Euler, shift 3
    assert type(model.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and model.shift == shift
    assert model.pipeline.scheduler is model.scheduler and model.expand_timesteps == (layout == "wan22_5b")
    for steps in (3, 10):
        g = model.time_grid(steps)
        assert g.shape == (steps + 1,) and g[0] == 1 and g[-1] == 0
        assert (g - time_grid(steps, shift, "diffusers")).abs().max() <= 1e-6


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_ode_samples_and_frames_equal_pipeline(model_and_pipe, guidance):
    _, model, pipe = model_and_pipe
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = sample_ode(model, PROMPTS, model.time_grid(4), guidance, init_noise=x0)
    ref = _pipe_latents(pipe, model, x0, guidance, steps=4)
    assert ref.shape == ours.shape == (2, *model.latent_shape)
    assert _rel(ours, ref) <= (0.0 if guidance == 1.0 else 1e-4)  # CFG: the pipeline encodes "" once per sample
    frames = pipe(prompt=PROMPTS, latents=x0.clone(), output_type="pt", num_inference_steps=4, guidance_scale=guidance,
                  **model.pipeline_kwargs()).frames
    ours_frames = model.decode(ours)
    assert ours_frames.dtype == torch.float32
    assert ours_frames.shape == frames.shape == (2, tw.NUM_FRAMES, 3, model.height, model.width)
    assert (ours_frames - frames).abs().max() <= 1e-5  # decode in chunks of 1 vs the pipeline's batch of 2


@pytest.mark.parametrize("batch", [1, 3])
def test_on_policy_parity_with_cfg(batch):
    """Rollout log π_old == log π_θ recomputed by policy_velocity + sampler_step(x_next=...) on 5-D latents."""
    model = tw.load_adapter("wan21").eval()
    prompts = [f"shape {i % 2}" for i in range(batch)]
    w = 4.5
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
            assert torch.equal(lp, traj.log_probs[:, j])  # same batch, same code: bit-identical
            for b in range(batch):  # the trainer's micro-batches regroup samples
                i = torch.tensor([b])
                vb = policy_velocity(model, traj.latents[i, j], t[i], cond_index(cond, i), cond_index(uncond, i), w)
                lpb = sampler_step(params, traj.latents[i, j], vb, t[i], tn[i], x_next=traj.latents[i, j + 1]).log_prob
                assert (lpb - traj.log_probs[i, j]).abs().max() <= 1e-5


def test_lora_targets_reference_and_trainable_subsets():
    lora = tw.load_adapter("wan21", trainable="lora")
    names = [n for n, p in lora.net.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    layers = {n.split(".lora_")[0].split(".", 2)[2] for n in names}  # e.g. attn1.to_q
    assert layers == {f"attn{a}.{p}" for a in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")}
    with torch.no_grad():
        for p in lora.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
        x = torch.randn(1, *lora.latent_shape)
        cond = lora.encode_prompts(["a"])
        t = torch.tensor([0.6])
        with lora.reference() as ref:
            v_ref = ref.velocity(x, t, cond)
        assert torch.equal(v_ref, tw.load_adapter("wan21").velocity(x, t, cond))  # adapter disabled == the base
        assert (lora.velocity(x, t, cond) - v_ref).abs().max() > 1e-3
    m = tw.load_adapter("wan21", trainable="all")
    mod = {n for n, p in m.net.named_parameters() if p in set(m.configure_trainable("modulation"))}
    time_path = ("condition_embedder.time_embedder.", "condition_embedder.time_proj.")
    assert mod and all(n.endswith("scale_shift_table") or n.startswith(time_path) for n in mod)
    assert sum(n.endswith("scale_shift_table") for n in mod) == len(m.net.blocks) + 1
    blocks = {n for n, p in m.net.named_parameters() if p in set(m.configure_trainable("blocks"))}
    assert blocks and all(n.startswith("blocks.") for n in blocks)


def test_bf16_autocast_and_gradient_checkpointing():
    m = tw.load_adapter("wan21", precision="bf16", trainable="lora")
    assert m.net.dtype == torch.bfloat16 and m.vae.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in m.trainable_parameters())
    x = torch.randn(2, *m.latent_shape, generator=torch.Generator().manual_seed(2))
    v = m.velocity(x[:1], torch.tensor([0.5]), m.encode_prompts(["a"]))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    grads = []
    for ckpt in (False, True):  # fp32: the same gradients with and without recomputation
        g = tw.load_adapter("wan21", trainable="lora", gradient_checkpointing=ckpt).train()
        torch.manual_seed(0)
        for p in g.trainable_parameters():
            torch.nn.init.normal_(p, std=0.1)
        (g.velocity(x, torch.tensor([0.7, 0.2]), g.encode_prompts(PROMPTS)) ** 2).mean().backward()
        grads.append([p.grad for p in g.trainable_parameters()])
    assert g.net.is_gradient_checkpointing
    assert all((a - b).abs().max() <= 1e-6 for a, b in zip(*grads))


def test_frame_mean_reward_scores_frames_as_images():
    from flowcredit.models.wan import FrameMeanReward

    r = FrameMeanReward("tiny_diffusers:BrightnessReward", frame_stride=2)
    video = torch.rand(2, 5, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    out = r(video, ["a", "b"], [{}, {}], group_ids=torch.tensor([0, 0]))
    expected = video[:, ::2].mean(dim=(2, 3, 4)).mean(dim=1)  # frames 0, 2, 4 scored, then averaged per clip
    assert out.scores.shape == (2,) and torch.allclose(out.scores, expected) and out.info["frames_scored"] == 3
    images = video[:, 0]
    assert torch.equal(r(images, ["a", "b"], [{}, {}]).scores, images.mean(dim=(1, 2, 3)))  # images pass through


def test_two_expert_folder_is_refused_before_loading(tmp_path):
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.factory import build_model
    from flowcredit.models.wan import TwoExpertsUnsupported

    d = tmp_path / "a14b"
    shutil.copytree(tw.tiny_model_dir("wan21"), d)
    index = json.loads((d / "model_index.json").read_text())
    index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    (d / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(TwoExpertsUnsupported) as e:
        build_model(ModelCfg(name="wan", path=str(d), precision="fp32"))
    assert "\n" not in str(e.value) and "transformer_2" in str(e.value) and "TI2V-5B" in str(e.value)


def test_missing_component_is_named(tmp_path):
    from flowcredit.config.schema import ModelCfg
    from flowcredit.models.diffusers_common import ModelLayoutError
    from flowcredit.models.factory import build_model

    d = tmp_path / "broken"
    shutil.copytree(tw.tiny_model_dir("wan21"), d)
    shutil.rmtree(d / "text_encoder")
    with pytest.raises(ModelLayoutError) as e:
        build_model(ModelCfg(name="wan", path=str(d), precision="fp32"))
    msg = str(e.value)
    assert "\n" not in msg and "'text_encoder/'" in msg and "WanPipeline" in msg and "scheduler/" in msg


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA trained for 2 iterations by Trainer (flow_grpo + grpo, CFG 4.5, lr 1e-2 so the adapter moves)."""
    from flowcredit.trainer.loop import Trainer

    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("run-wan")
    tr = Trainer(tw.train_config("flow_grpo", run, "optim.ema_decay=0"))
    tr.setup()
    before = {n: p.detach().clone() for n, p in tr.model.net.named_parameters() if p.requires_grad}
    res = tr.train()
    tr.model.eval()
    return tr, run, before, res


def test_grpo_trains_two_lora_iterations_on_video_latents(trained):
    tr, run, before, res = trained
    assert res["iterations"] == 2 and len(tr.model.latent_shape) == 4 and tr.model.latent_shape[1] >= 2
    recs = _records(run)
    assert len(recs) == 2
    for r in recs:
        assert r["parity_max_abs_dlogp"] <= 1e-5 and r["pairs_trained"] > 0 and 0 < r["reward_mean"] < 1
        assert torch.isfinite(torch.tensor([r["loss"], r["kl"], r["reward_mean"]])).all()
    assert recs[1]["kl"] > 0  # the LoRA moved away from the reference (adapter disabled)
    assert all("lora_" in n for n in before)
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.model.net.named_parameters()
               if n in before) > 0
    assert (run / "checkpoints" / "iter000002" / "manifest.json").is_file()


@pytest.mark.parametrize("method", ["flow_grpo", "stepwise"])
def test_nft_trains_two_lora_iterations_on_video_latents(tmp_path, method):
    """The forward-process objective on 5-D latents; with stepwise credit the x̂0 estimates are decoded to frames
    and scored through FrameMeanReward too (trainer/intermediate.py)."""
    from flowcredit.trainer.loop import Trainer

    cfg = tw.train_config(method, tmp_path / "run", "objective.name=nft", "sampler.name=ode",
                          "sampler.guidance_scale=1.0", "optim.kl_beta=1e-4", "run.checkpoint_every=0")
    tr = Trainer(cfg)
    tr.setup()
    before = {n: p.detach().clone() for n, p in tr.model.net.named_parameters() if p.requires_grad}
    assert tr.train()["iterations"] == 2
    recs = _records(tmp_path / "run")
    assert len(recs) == 2 and all(r["pairs_trained"] > 0 and bool(torch.isfinite(torch.tensor(r["loss"])))
                                  for r in recs)
    assert max((p.detach() - before[n]).abs().max().item() for n, p in tr.model.net.named_parameters()
               if n in before) > 0


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_lora_export_loads_into_fresh_pipeline(trained, tmp_path, guidance):
    from flowcredit.models.export import LORA_WEIGHTS, export

    tr, _, _, _ = trained
    model = tr.model
    out = export(model, tmp_path / "lora")
    info = json.loads((out / "flowcredit_export.json").read_text())
    assert (out / LORA_WEIGHTS).is_file() and info["family"] == "wan" and info["format"] == "diffusers-lora"
    assert info["lora"]["folded_scales"] == [2.0] and info["scheduler"]["shift"] == 3.0
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), guidance, init_noise=x0)
    pipe = tw.load_pipeline("wan21", model)  # a fresh stock pipeline + the scheduler flowcredit samples with
    base = _pipe_latents(pipe, model, x0, guidance)
    pipe.load_lora_weights(str(out))
    loaded = _pipe_latents(pipe, model, x0, guidance)
    assert _rel(ours, base) > 1e-3  # the LoRA changed the samples ...
    assert _rel(ours, loaded) <= (0.0 if guidance == 1.0 else 1e-4)  # ... and the deployed pipeline reproduces them


def test_checkpoint_and_cli_export_equal_live_export_and_load(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    from flowcredit.cli.main import main
    from flowcredit.models.export import LORA_WEIGHTS, export, export_checkpoint

    tr, run, _, _ = trained
    live = load_file(str(export(tr.model, tmp_path / "live") / LORA_WEIGHTS))
    ckpt = load_file(str(export_checkpoint(run, tmp_path / "ckpt") / LORA_WEIGHTS))
    assert main(["export", str(run), str(tmp_path / "cli")]) == 0
    assert f"exported to {tmp_path / 'cli'}" in capsys.readouterr().out
    cli = load_file(str(tmp_path / "cli" / LORA_WEIGHTS))
    assert live.keys() == ckpt.keys() == cli.keys() and all(torch.equal(live[k], ckpt[k]) for k in live)
    assert all(torch.equal(live[k], cli[k]) for k in live)
    assert all(k.startswith("transformer.blocks.") and (".lora_A." in k or ".lora_B." in k) for k in live)
    x0 = torch.randn(2, *tr.model.latent_shape, generator=torch.Generator().manual_seed(6))
    ours = sample_ode(tr.model, PROMPTS, tr.model.time_grid(T), 1.0, init_noise=x0)
    pipe = tw.load_pipeline("wan21", tr.model)
    pipe.load_lora_weights(str(tmp_path / "cli"))
    assert _rel(ours, _pipe_latents(pipe, tr.model, x0, 1.0)) <= 1e-6


def test_full_finetune_export_round_trip(tmp_path):
    """save_pretrained writes the adapter's pipeline, Euler scheduler included: from_pretrained reproduces samples."""
    from diffusers import WanPipeline

    from flowcredit.models.export import export

    model = tw.load_adapter("wan21", trainable="all").eval()
    with torch.no_grad():
        for p in model.net.blocks[0].parameters():
            p.add_(0.02 * torch.randn_like(p))
    pipe = WanPipeline.from_pretrained(str(export(model, tmp_path / "full")), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(7))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), 1.0, init_noise=x0)
    assert _rel(ours, _pipe_latents(pipe, model, x0, 1.0)) <= 1e-6


@pytest.mark.parametrize("name", ["wan_flow_grpo", "wan_nft"])
def test_presets_load_and_mirror_the_recipes(name):
    from flowcredit.cli.main import PRESET_DIR
    from flowcredit.config.load import load_config
    from flowcredit.config.schema import TrainConfig

    cfg = load_config(TrainConfig, name, [], preset_dirs=[PRESET_DIR])
    m = cfg.model
    assert m.name == "wan" and m.trainable == "lora" and (m.lora_rank, m.lora_alpha) == (32, 64.0)
    assert m.precision == "bf16" and m.gradient_checkpointing and cfg.run.device == "cuda"
    assert m.options == {"height": 240, "width": 416, "num_frames": 33, "max_sequence_length": 512}
    assert cfg.sampler.grid == "diffusers" and cfg.sampler.shift == 3.0 and cfg.sampler.timestep_fraction == 0.99
    assert cfg.data.group_size == 4 and cfg.data.prompts_per_iter == 4 and cfg.run.grid_every == 0
    assert cfg.reward.name == "flowcredit.models.wan:FrameMeanReward"
    assert cfg.reward.options == {"reward": "ocr", "frame_stride": 4}
    assert cfg.credit.options == {"std_scope": "group"} and cfg.credit.adv_clip == 5.0
    if name == "wan_flow_grpo":  # flow_grpo config/grpo.py:general_ocr_wan2_1 + scripts/train_wan2_1.py
        assert cfg.objective.name == "grpo" and cfg.sampler.name == "flow_sde" and cfg.sampler.num_steps == 20
        assert cfg.sampler.guidance_scale == 4.5 and cfg.run.eval_steps == 50 and cfg.run.seed == 42
        o = cfg.optim
        assert (o.lr, o.clip_range, o.kl_beta, o.updates_per_epoch, o.ema_decay) == (1e-4, 1e-3, 0.004, 2, 0.987)
    else:  # no published Wan NFT recipe: sd35m_nft's structure (DiffusionNFT sd3_geneval)
        assert cfg.objective.name == "nft" and cfg.sampler.name == "ode" and cfg.sampler.guidance_scale == 1.0
        assert cfg.sampler.num_steps == 10 and cfg.run.eval_steps == 40
        assert (cfg.optim.lr, cfg.optim.kl_beta, cfg.optim.ema_decay) == (3e-4, 1e-4, 0.9)


def test_help_config_lists_wan(capsys):
    from flowcredit.cli.main import main

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "model.name=wan:" in out
    for key in ("height", "width", "num_frames", "max_sequence_length", "flow_shift"):
        assert f"model.options.{key}" in out

