"""Export: a LoRA trained by flowcredit (Trainer, 2 iterations) loads into a FRESH stock pipeline with
`load_lora_weights` and reproduces flowcredit's own ODE samples; `fuse_lora` within 1e-5; full fine-tunes
round-trip through `save_pretrained` / `from_pretrained`; trainer checkpoints export too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_diffusers as td  # noqa: E402

from flowcredit.samplers.rollout import sample_ode  # noqa: E402

PROMPTS = ["a red cat", "a blue dog"]
T = 3


def _pipe_samples(pipe, model, x0, guidance):
    kw = dict(prompt=PROMPTS, num_inference_steps=T, latents=x0.clone(), output_type="latent", **model.pipeline_kwargs())
    if model.family == "sd3":
        kw["guidance_scale"] = guidance
    elif guidance != 1.0:
        kw.update(negative_prompt="", true_cfg_scale=guidance)
    return pipe(**kw).images


@pytest.fixture(scope="module", params=["sd3", "flux"])
def trained(request, tmp_path_factory):
    """A LoRA trained for 2 iterations by Trainer (flow_grpo, lr 1e-2 so the adapter moves visibly)."""
    from flowcredit.trainer.loop import Trainer

    torch.set_num_threads(1)
    kind = request.param
    run = tmp_path_factory.mktemp(f"run-{kind}")
    tr = Trainer(td.train_config(kind, "flow_grpo", run, "optim.ema_decay=0"))
    tr.setup()
    tr.train()
    tr.model.eval()
    return kind, tr, run


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_lora_export_loads_into_fresh_pipeline(trained, tmp_path, guidance):
    from flowcredit.models.export import LORA_WEIGHTS, export

    kind, tr, _ = trained
    model = tr.model
    out = export(model, tmp_path / "lora")
    assert (out / LORA_WEIGHTS).is_file()
    info = json.loads((out / "flowcredit_export.json").read_text())
    assert info["family"] == kind and info["format"] == "diffusers-lora" and info["lora"]["folded_scales"] == [2.0]

    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(5))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), guidance, init_noise=x0)
    pipe = td.load_pipeline(kind, td.tiny_model_dir(kind))
    base = _pipe_samples(pipe, model, x0, guidance)
    pipe.load_lora_weights(str(out))
    loaded = _pipe_samples(pipe, model, x0, guidance)
    assert (ours - base).abs().max() > 1e-3  # the LoRA changed the samples ...
    # ... and the deployed pipeline reproduces them: bit for bit without CFG; with CFG to the same 1e-6 level as the
    # base model's parity (the pipeline encodes "" in a batch of B, we encode it once: last-bit text-encoder noise).
    assert (ours - loaded).abs().max() <= (0.0 if guidance == 1.0 else 1e-5)
    pipe.fuse_lora()
    fused = _pipe_samples(pipe, model, x0, guidance)
    assert (ours - fused).abs().max() <= 1e-5
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    assert (_pipe_samples(pipe, model, x0, guidance) - base).abs().max() <= 1e-5  # unfuse: weight rounding


def test_checkpoint_export_equals_live_export(trained, tmp_path):
    from safetensors.torch import load_file

    from flowcredit.models.export import LORA_WEIGHTS, export, export_checkpoint

    kind, tr, run = trained
    a = load_file(str(export(tr.model, tmp_path / "live") / LORA_WEIGHTS))
    b = load_file(str(export_checkpoint(run, tmp_path / "ckpt") / LORA_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in a)


def test_cli_export_of_a_real_model_run_loads_into_its_pipeline(trained, tmp_path, capsys):
    """`flowcredit export RUN OUT` on an SD3 / FLUX LoRA run: the same file as `export_checkpoint` (the EMA-less
    weights here), and the family's stock pipeline loads it and reproduces flowcredit's ODE samples of it."""
    from safetensors.torch import load_file

    from flowcredit.cli.main import main
    from flowcredit.models.export import LORA_WEIGHTS, export_checkpoint

    kind, tr, run = trained
    assert main(["export", str(run), str(tmp_path / "cli")]) == 0
    assert f"exported to {tmp_path / 'cli'}" in capsys.readouterr().out
    a = load_file(str(tmp_path / "cli" / LORA_WEIGHTS))
    b = load_file(str(export_checkpoint(run, tmp_path / "api") / LORA_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x0 = torch.randn(2, *tr.model.latent_shape, generator=torch.Generator().manual_seed(5))
    ours = sample_ode(tr.model, PROMPTS, tr.model.time_grid(T), 1.0, init_noise=x0)
    pipe = td.load_pipeline(kind, td.tiny_model_dir(kind))
    pipe.load_lora_weights(str(tmp_path / "cli"))
    assert (ours - _pipe_samples(pipe, tr.model, x0, 1.0)).abs().max() <= 1e-6


def test_full_finetune_export_round_trip(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from flowcredit.models.export import export

    model = td.load_adapter("sd3", trainable="all").eval()
    with torch.no_grad():
        for p in model.net.transformer_blocks[0].parameters():
            p.add_(0.02 * torch.randn_like(p))
    out = export(model, tmp_path / "full")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(out), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(6))
    ours = sample_ode(model, PROMPTS, model.time_grid(T), 1.0, init_noise=x0)
    assert (ours - _pipe_samples(pipe, model, x0, 1.0)).abs().max() <= 1e-6
    only = export(model, tmp_path / "transformer_only", transformer_only=True)
    assert (only / "transformer" / "config.json").is_file() and not (only / "vae").exists()
