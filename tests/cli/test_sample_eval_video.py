"""`flowcredit sample` / `flowcredit eval` on a Wan (video) run and the base Wan model (tiny components, offline, CPU).

A LoRA trained for 1 Trainer iteration is sampled from its run folder: the clips (--save-tensors 'frames') equal
flowcredit's own `sample_ode` + `decode` of the trained model with `generate`'s per-line noise (≤ 1e-6), and so do the
animated grid and the per-clip animations (lossless animated PNG; GIF readable). `eval` scores each clip with the run's
own FrameMeanReward, or with an image reward given by name, wrapped frame by frame; it writes the animated samples,
results.jsonl, summary.json and a grid of first frames. The trainer's `save_grid` takes frames (first frames shown).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")
pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

import tiny_wan as tw

from flowcredit.cli.main import main
from flowcredit.eval.evaluate import line_noise, to_uint8_frames
from flowcredit.samplers.rollout import sample_ode

PROMPT = "a red cat"
STEPS = 3  # the run's run.eval_steps: sample/eval take it when --steps is not given
SIZE = [f"model.options.height={tw.HEIGHT}", f"model.options.width={tw.WIDTH}",
        f"model.options.num_frames={tw.NUM_FRAMES}", f"model.options.max_sequence_length={tw.MAX_SEQ}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Wan 2.1 LoRA run trained for 1 iteration (lr 1e-2: the adapter moves), CFG 4.5 in its evaluation settings,
    with the trainer's sample grids and end-of-run evaluation on (both take frames)."""
    from flowcredit.trainer.loop import Trainer

    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("run-wan")
    prompts = tmp_path_factory.mktemp("prompts") / "p.txt"
    prompts.write_text("a red cat\na blue dog\n")
    tr = Trainer(tw.train_config("flow_grpo", run, "optim.ema_decay=0", "run.iterations=1",
                                     f"run.eval_steps={STEPS}", "run.eval_guidance=4.5", "run.grid_every=1",
                                     "run.eval_at_end=true", f"run.eval_prompts={prompts}"))
    tr.setup()
    tr.train()
    tr.model.eval()
    return tr, run


def _expected(model, prompts, *, steps=STEPS, guidance=4.5, seed=0) -> torch.Tensor:
    noise = line_noise(seed, range(len(prompts)), tuple(model.latent_shape))
    with torch.no_grad():
        return model.decode(sample_ode(model, prompts, model.time_grid(steps), guidance, init_noise=noise))


def _frames(path: Path) -> np.ndarray:
    """Every frame of an animated image as (F, H, W, 3) uint8."""
    im = Image.open(path)
    out = []
    for k in range(getattr(im, "n_frames", 1)):
        im.seek(k)
        out.append(np.asarray(im.convert("RGB")))
    return np.stack(out)


def test_sample_of_a_wan_run_writes_clips_equal_to_sample_ode(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    tr, run = trained
    ev = json.loads((run / "eval.json").read_text())  # the trainer's end-of-run evaluation of the clips
    assert ev["trained"]["num_frames"] == tw.NUM_FRAMES and 0 < ev["trained"]["reward_mean"] < 1
    assert (run / "grids" / "iter00001.png").is_file() and (run / "eval" / "grid.png").is_file()
    out, tens = tmp_path / "s.png", tmp_path / "s.safetensors"
    assert main(["sample", PROMPT, "--checkpoint", str(run), "--n", "2", "--out", str(out),
                 "--save-tensors", str(tens)]) == 0
    printed = capsys.readouterr().out
    assert "wan (base" in printed and "2 clips of 5 frames" in printed
    frames = load_file(str(tens))["frames"]
    want = _expected(tr.model, [PROMPT] * 2)
    assert frames.shape == want.shape == (2, tw.NUM_FRAMES, 3, tw.HEIGHT, tw.WIDTH)
    assert (frames - want).abs().max() <= 1e-6
    clips = to_uint8_frames(want)  # (2, F, H, W, 3)
    grid = _frames(out)[:, ::4, ::4]  # ×4 nearest neighbour, 1-px padding between the cells
    assert grid.shape[0] == tw.NUM_FRAMES
    for k in range(2):
        x = 1 + k * (tw.WIDTH + 1)
        assert np.array_equal(grid[:, 1 : 1 + tw.HEIGHT, x : x + tw.WIDTH], clips[k])
        assert np.array_equal(_frames(tmp_path / f"s-{k:03d}.png")[:, ::4, ::4], clips[k])
    gif = tmp_path / "g.gif"
    assert main(["sample", PROMPT, "--checkpoint", str(run), "--n", "1", "--out", str(gif)]) == 0
    assert _frames(gif).shape == (tw.NUM_FRAMES, 4 * tw.HEIGHT + 2 * 4, 4 * tw.WIDTH + 2 * 4, 3)
    assert _frames(tmp_path / "g-000.gif").shape == (tw.NUM_FRAMES, 4 * tw.HEIGHT, 4 * tw.WIDTH, 3)
    assert main(["sample", PROMPT, "--checkpoint", str(run), "--out", str(tmp_path / "x.jpg")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out") and ".gif" in err and err.count("\n") == 1


def _read_eval(out: Path, n: int) -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(rows) == n and summary["num_images"] == n and summary["num_frames"] == tw.NUM_FRAMES
    for i, row in enumerate(rows):
        assert row["filename"] == f"{i:05d}/samples/0000.png" and (out / f"{i:05d}" / "metadata.jsonl").is_file()
        assert Image.open(out / row["filename"]).n_frames == tw.NUM_FRAMES  # the clip, animated
    grid = Image.open(out / "grid.png")
    assert getattr(grid, "n_frames", 1) == 1 and grid.width == 2 + n * (3 * tw.WIDTH + 2)  # first frames, ×3
    return rows, summary


def test_eval_of_a_wan_run_scores_clips_with_its_reward_or_a_wrapped_image_reward(trained, tmp_path, capsys):
    tr, run = trained
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat\na blue dog\n")
    want = _expected(tr.model, ["a red cat", "a blue dog"])
    for args, stride in (([], 2), (["--reward", "tiny_diffusers:BrightnessReward"], 1)):
        out = tmp_path / f"eval{stride}"
        assert main(["eval", "--checkpoint", str(run), "--prompts", str(prompts), "--out", str(out), *args]) == 0
        assert f"written to {out}" in capsys.readouterr().out
        rows, summary = _read_eval(out, 2)
        # the run's reward: FrameMeanReward(brightness, frame_stride 2); --reward: every frame, averaged
        score = want[:, ::stride].float().mean(dim=(2, 3, 4)).mean(dim=1)
        assert np.allclose([r["reward"] for r in rows], score.numpy(), atol=1e-6)
        assert summary["settings"]["steps"] == STEPS and summary["settings"]["guidance"] == 4.5
        first = _frames(out / "00001" / "samples" / "0000.png")
        assert np.array_equal(first, to_uint8_frames(want)[1])


def test_eval_and_sample_of_the_base_wan_model(tmp_path, capsys):
    base = ["model.name=wan", f"model.path={tw.tiny_model_dir('wan21')}", *SIZE]
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red cat\n")
    assert main(["eval", *base, "--prompts", str(prompts), "--steps", "2", "--out", str(tmp_path / "e")]) == 2
    assert "needs --reward" in capsys.readouterr().err
    assert main(["eval", *base, "--prompts", str(prompts), "--steps", "2", "--reward",
                 "tiny_diffusers:BrightnessReward", "--out", str(tmp_path / "e")]) == 0
    rows, summary = _read_eval(tmp_path / "e", 1)
    assert summary["settings"]["reward"] == "tiny_diffusers:BrightnessReward" and 0 < rows[0]["reward"] < 1
    model = tw.load_adapter("wan21").eval()
    want = _expected(model, ["a red cat"], steps=2, guidance=1.0)
    assert abs(rows[0]["reward"] - float(want.mean())) <= 1e-6
    assert main(["sample", PROMPT, *base, "--steps", "2", "--n", "1", "--out", str(tmp_path / "b.png")]) == 0
    assert np.array_equal(_frames(tmp_path / "b-000.png")[:, ::4, ::4], to_uint8_frames(want)[0])


def test_save_grid_shows_first_frames_of_clips(tmp_path):
    from flowcredit.eval.evaluate import caption_grid
    from flowcredit.trainer.loggers import save_grid
    from flowcredit.types import to_uint8_hwc

    video = torch.rand(4, 3, 3, 8, 10, generator=torch.Generator().manual_seed(0))
    prompts = ["a", "a", "b", "b"]
    save_grid(video, prompts, 2, tmp_path, 7)
    got = np.asarray(Image.open(tmp_path / "iter00007.png").convert("RGB"))
    assert np.array_equal(got, caption_grid(to_uint8_hwc(video[:, 0]).numpy(), prompts, ncol=2, scale=3))
    assert (tmp_path / "iter00007.txt").read_text() == "a\nb\n"
