"""`flowcredit sample` / `flowcredit eval` on SD3 and FLUX.1 runs and base models (tiny components, offline).

A LoRA trained for 2 Trainer iterations (with an EMA) is sampled from its run folder: the CLI's images equal
flowcredit's own `sample_ode` of the trained model (EMA weights by default, raw ones with --no-ema) on the family's
own time grid with the same per-line noise, as tensors (--save-tensors) and as the PNG grid. `eval` writes its result
files with the run's own reward; the base model comes from `model.name=... model.path=...`; bad input is one
`error:` line with exit 2.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import tiny_diffusers as td

from flowcredit.cli.main import main
from flowcredit.eval.evaluate import line_noise, make_grid
from flowcredit.samplers.rollout import sample_ode
from flowcredit.types import to_uint8_hwc

PROMPT = "a red cat"
EVAL_STEPS = 3  # the runs' run.eval_steps: sample/eval take it when --steps is not given


def _guidance(kind: str) -> float:
    return 4.5 if kind == "sd3" else 1.0  # the runs' run.eval_guidance (FLUX.1: no true CFG, distilled guidance)


@pytest.fixture(scope="module", params=["sd3", "flux"])
def trained(request, tmp_path_factory):
    """A LoRA run trained for 2 iterations with an EMA of its weights (decay 0.5: EMA ≠ raw weights)."""
    from flowcredit.trainer.loop import Trainer

    torch.set_num_threads(1)
    kind = request.param
    run = tmp_path_factory.mktemp(f"run-{kind}")
    cfg = td.train_config(kind, "flow_grpo", run, "optim.ema_decay=0.5", f"run.eval_steps={EVAL_STEPS}",
                          f"run.eval_guidance={_guidance(kind)}")
    tr = Trainer(cfg)
    tr.setup()
    tr.train()
    tr.model.eval()
    return kind, tr, run


def _expected(tr, prompts, *, steps, guidance, seed, ema=True) -> torch.Tensor:
    """flowcredit's own ODE samples of the live trained model with `generate`'s per-line noise, decoded."""
    model = tr.model
    noise = line_noise(seed, range(len(prompts)), tuple(model.latent_shape))
    swap = tr.ema_weights.swapped_in(tr.trainable) if ema else contextlib.nullcontext()
    with swap, torch.no_grad():
        x0 = sample_ode(model, prompts, model.time_grid(steps), guidance, init_noise=noise)
        return model.decode(x0)


def _read(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(path))["images"]


def _png_cells(path: Path, n: int, size: int) -> np.ndarray:
    """The grid PNG (1-px padding, ×4) back to its (n, size, size, 3) cells."""
    img = np.asarray(Image.open(path).convert("RGB"))[::4, ::4]
    return np.stack([img[1 : 1 + size, 1 + k * (size + 1) : 1 + k * (size + 1) + size] for k in range(n)])


def _one_line_error(capsys, argv, *fragments) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def test_sample_of_a_run_equals_sample_ode_of_the_trained_model(trained, tmp_path, capsys):
    kind, tr, run = trained
    out, tensors = tmp_path / "grid.png", tmp_path / "x.safetensors"
    argv = ["sample", PROMPT, "--checkpoint", str(run), "--n", "2", "--out", str(out), "--save-tensors", str(tensors)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert f"model: {kind} (base {td.tiny_model_dir(kind)}) + " in stdout and "(EMA weights)" in stdout
    assert f"{EVAL_STEPS} ODE steps on its scheduler's time grid, CFG {_guidance(kind)}" in stdout
    want = _expected(tr, [PROMPT] * 2, steps=EVAL_STEPS, guidance=_guidance(kind), seed=0)
    got = _read(tensors)
    assert got.shape == want.shape == (2, 3, td.RESOLUTION, td.RESOLUTION)
    assert (got - want).abs().max() <= 1e-6
    cells = _png_cells(out, 2, td.RESOLUTION)
    assert np.array_equal(cells, to_uint8_hwc(want).numpy())  # the PNG: the same to_uint8 path
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")).shape[:2],
                          np.array(make_grid(cells, ncol=2).shape[:2]) * 4)
    # the raw (non-EMA) weights give other images: the EMA was really loaded
    raw = _expected(tr, [PROMPT] * 2, steps=EVAL_STEPS, guidance=_guidance(kind), seed=0, ema=False)
    assert (raw - want).abs().max() > 1e-4


def test_sample_of_a_checkpoint_folder_no_ema_and_flags(trained, tmp_path, capsys):
    kind, tr, run = trained
    ck = run / "checkpoints" / "iter000002"
    tensors = tmp_path / "x.safetensors"
    argv = ["sample", PROMPT, "--checkpoint", str(ck), "--no-ema", "--steps", "2", "--cfg", "2.0", "--seed", "3",
            "--n", "1", "--out", str(tmp_path / "g.png"), "--save-tensors", str(tensors)]
    assert main(argv) == 0
    assert "(raw weights)" in capsys.readouterr().out
    want = _expected(tr, [PROMPT], steps=2, guidance=2.0, seed=3, ema=False)
    assert (_read(tensors) - want).abs().max() <= 1e-6


def test_checkpoint_folder_outside_its_run_uses_the_model_it_recorded(trained, tmp_path):
    """Without the run's config.yaml the checkpoint's own ModelCfg rebuilds the model (as `flowcredit export`)."""
    kind, tr, run = trained
    alone = tmp_path / "kept" / "iter000002"
    shutil.copytree(run / "checkpoints" / "iter000002", alone)
    tensors = tmp_path / "x.safetensors"
    argv = ["sample", PROMPT, "--checkpoint", str(alone), "--steps", "2", "--n", "1", "--out", str(tmp_path / "g.png"),
            "--save-tensors", str(tensors)]
    assert main(argv) == 0
    want = _expected(tr, [PROMPT], steps=2, guidance=1.0, seed=0)  # no run: the flags' defaults (CFG 1.0)
    assert (_read(tensors) - want).abs().max() <= 1e-6


def test_eval_of_a_run_writes_results_with_the_runs_reward(trained, tmp_path, capsys):
    from flowcredit.shapes.prompts import load_prompts

    kind, tr, run = trained
    out = tmp_path / "ev"
    assert main(["eval", "--checkpoint", str(run), "--limit", "2", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "Mean reward (tiny_diffusers:BrightnessReward)" in stdout
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    ps = load_prompts("shapes:test")  # the run's run.eval_prompts
    assert [r["prompt"] for r in rows] == ps.prompts[:2]
    assert all((out / r["filename"]).is_file() for r in rows) and (out / "grid.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_images"] == 2 and "geneval" not in summary
    st = summary["settings"]
    reward = "tiny_diffusers:BrightnessReward"
    assert (st["steps"], st["guidance"], st["reward"]) == (EVAL_STEPS, _guidance(kind), reward)
    want = _expected(tr, ps.prompts[:2], steps=EVAL_STEPS, guidance=_guidance(kind), seed=0)
    brightness = want.float().mean(dim=(1, 2, 3))
    assert [r["reward"] for r in rows] == pytest.approx(brightness.tolist(), abs=1e-6)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_base_model_from_model_overrides(kind, tmp_path, capsys):
    torch.set_num_threads(1)
    base = td.load_adapter(kind, trainable="all").eval()
    opts = ["model.options.resolution=16"] if kind == "flux" else []  # FLUX's native size would be 128 px
    tensors = tmp_path / "x.safetensors"
    argv = ["sample", PROMPT, f"model.name={kind}", f"model.path={td.tiny_model_dir(kind)}", *opts, "--steps", "2",
            "--n", "1", "--out", str(tmp_path / "g.png"), "--save-tensors", str(tensors)]
    assert main(argv) == 0
    noise = line_noise(0, [0], tuple(base.latent_shape))
    with torch.no_grad():
        want = base.decode(sample_ode(base, [PROMPT], base.time_grid(2), 1.0, init_noise=noise))
    assert (_read(tensors) - want).abs().max() <= 1e-6
    capsys.readouterr()
    # eval of a base model scores with the reward it is given ...
    out = tmp_path / "ev"
    argv = ["eval", f"model.name={kind}", f"model.path={td.tiny_model_dir(kind)}", *opts, "--steps", "2",
            "--limit", "1", "--reward", "tiny_diffusers:BrightnessReward", "--out", str(out)]
    assert main(argv) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == 1 and (out / "summary.json").is_file()
    # ... and without one it says what to give (the shapes verifier scores the tiny model's world only)
    _one_line_error(capsys, argv[:-4] + ["--out", str(tmp_path / "ev2")], "--reward NAME", "shapes verifier")
    assert not (tmp_path / "ev2").exists()


def test_moved_base_model_names_model_path_and_the_flag(trained, tmp_path, capsys):
    kind, tr, run = trained
    moved = tmp_path / "run"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("grids", "events*"))
    text = (moved / "config.yaml").read_text()
    assert str(td.tiny_model_dir(kind)) in text
    (moved / "config.yaml").write_text(text.replace(str(td.tiny_model_dir(kind)), str(tmp_path / "gone")))
    out = tmp_path / "g.png"
    argv = ["sample", PROMPT, "--checkpoint", str(moved), "--steps", "1", "--n", "1", "--out", str(out)]
    _one_line_error(capsys, argv, "model.path", str(tmp_path / "gone"), "--model-path", f"run '{moved}'")
    assert not out.exists()
    assert main([*argv, "--model-path", str(td.tiny_model_dir(kind))]) == 0 and out.is_file()


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["model.lora_rnk=4"], ["unknown key 'model.lora_rnk'", "did you mean 'lora_rank'"]),
        (["model.options.resolutio=16"], ["model.options.resolutio", "did you mean 'resolution'"]),
        (["optim.lr=1"], ["'optim.lr=1'", "model.* overrides only"]),
        (["model.name=sdd3"], ["model.name", "did you mean 'sd3'"]),
    ],
)
def test_bad_model_overrides_one_line_error(trained, tmp_path, capsys, args, fragments):
    _, _, run = trained
    out = tmp_path / "g.png"
    _one_line_error(capsys, ["sample", PROMPT, "--checkpoint", str(run), *args, "--out", str(out)], *fragments)
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["sample", PROMPT, "model.name=sd3"], ["model.name=sd3 needs model.path"]),
        (["sample", PROMPT, "model.name=flux", "model.pathh=x"], ["unknown key 'model.pathh'", "did you mean 'path'"]),
        (["eval", "model.name=sd3", "reward.nme=x"], ["unknown key 'reward.nme'", "did you mean 'name'"]),
        (["eval", "--reward", "pickscor", "model.name=sd3", f"model.path={td.tiny_model_dir('sd3')}"],
         ["unknown reward 'pickscor'", "did you mean 'pickscore'"]),
        (["eval", "model.name=sd3", f"model.path={td.tiny_model_dir('sd3')}", "--reward", "shapes", "--limit", "1"],
         ["reward 'shapes'", "draws 16-px images", "--reward NAME"]),
        (["eval", "optim.lr=1"], ["'optim.lr=1'", "model.* and reward.* overrides only"]),
        (["sample", PROMPT, "--checkpoint", "{tiny}", "model.lora_rank=4"],
         ["model.lora_rank", "tiny-model checkpoint"]),
        (["sample", "a", "cat"], ["unexpected argument 'cat'", "quote a prompt"]),
    ],
)
def test_bad_input_without_a_run_one_line_error(tmp_path, capsys, argv, fragments):
    from flowcredit.models.tiny import TinyDiTConfig, TinyFlowModel

    tiny = TinyFlowModel(TinyDiTConfig(width=32, depth=1, heads=2)).save(tmp_path, name="m")
    argv = [a.replace("{tiny}", str(tiny)) for a in argv] + ["--out", str(tmp_path / "o")]
    _one_line_error(capsys, argv, *fragments)
    assert not (tmp_path / "o").exists()
