"""Evaluation: ODE samples with fixed per-line noise, scored by a reward, written in GenEval's layouts.

`flowcredit eval`, the trainer's final `eval.json` and its periodic evaluations all call `evaluate()`, so the
numbers mean the same thing everywhere. The noise of prompt line i depends only on (seed, i), never on the
batch composition, so two models evaluated with the same seed see the same x_T.

Output folder (GenEval's, SHAPES_BENCHMARK.md §1.2):
    <out>/<index:05d>/metadata.jsonl   the record (one JSON object)
    <out>/<index:05d>/samples/0000.png
    <out>/results.jsonl                GenEval's columns + strict, reward
    <out>/summary.json                 per-tag and overall (unweighted tag mean) for correct and strict
    <out>/grid.png                     a grid of the first 128 samples, each with its prompt as caption

A video model (decode → frames (B, F, 3, H, W), e.g. wan) keeps the layout: each `samples/0000.png` is the clip as an
animated PNG (APNG, lossless; a viewer without APNG shows the first frame), `grid.png` shows the first frames, and
the reward scores the frames (`flowcredit eval` wraps an image reward in `models.wan.FrameMeanReward`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..samplers.rollout import sample_ode
from ..shapes.prompts import PromptSet
from ..types import FlowModel, to_uint8_hwc


def line_noise(seed: int, indices: Sequence[int], latent_shape: tuple[int, ...]) -> torch.Tensor:
    """Fixed initial noise per prompt line. Returns (len(indices), *latent_shape) fp32."""
    out = []
    for i in indices:
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([int(seed), int(i), 7]).generate_state(1)[0]))
        out.append(torch.randn(latent_shape, generator=g))
    return torch.stack(out)


def make_grid(images: np.ndarray, ncol: int = 16, pad: int = 1) -> np.ndarray:
    """(N, H, W, 3) uint8 → one (rows·(H+pad), ncol·(W+pad), 3) uint8 grid."""
    n, h, w, _ = images.shape
    ncol = max(1, min(ncol, n))
    rows = (n + ncol - 1) // ncol
    grid = np.full((rows * (h + pad) + pad, ncol * (w + pad) + pad, 3), 255, dtype=np.uint8)
    for k in range(n):
        r, c = divmod(k, ncol)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + c * (w + pad) : pad + c * (w + pad) + w] = images[k]
    return grid


def _wrap(text: str, font, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap of ``text`` to ``width`` pixels in ``font``; a word wider than the width is split; more than
    ``max_lines`` lines end in '...'."""
    lines: list[str] = []
    cur = ""
    for word in text.split():
        cand = f"{cur} {word}" if cur else word
        if font.getlength(cand) <= width:
            cur = cand
            continue
        if cur:
            lines.append(cur)
        cur = word
        while len(cur) > 1 and font.getlength(cur) > width:  # hard-split a word that cannot fit on one line
            k = len(cur) - 1
            while k > 1 and font.getlength(cur[:k]) > width:
                k -= 1
            lines.append(cur[:k])
            cur = cur[k:]
    if cur:
        lines.append(cur)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and font.getlength(last + "...") > width:
            last = last[:-1]
        lines[-1] = last + "..."
    return lines


def caption_grid(images: np.ndarray, captions: Sequence[str], ncol: int = 16, *, scale: int = 3, pad: int = 2,
                 max_lines: int = 4, font_size: int = 10) -> np.ndarray:
    """A grid with each image's prompt written under it: (N, H, W, 3) uint8 + N captions → one uint8 image.

    Images are enlarged ``scale``× (nearest neighbour, as ``save_png`` does) so the text has room. Consecutive cells
    of a row with the same caption (a training grid's row = one prompt × G samples) share one caption spanning them;
    otherwise each cell gets its own, wrapped to the cell width (at most ``max_lines`` lines). Black text on white.

    Args:
        images: (N, H, W, 3) uint8.
        captions: N strings (the prompts); "" leaves a cell uncaptioned.
        ncol: cells per row.

    Returns:
        (sum over rows of (scale·H + pad + caption height_r) + pad, ncol·(scale·W + pad) + pad, 3) uint8.
    """
    from PIL import Image, ImageDraw, ImageFont

    n, h, w, _ = images.shape
    if len(captions) != n:
        raise ValueError(f"caption_grid: {n} images but {len(captions)} captions")
    ncol = max(1, min(ncol, n))
    rows = (n + ncol - 1) // ncol
    big = images.repeat(scale, axis=1).repeat(scale, axis=2)  # (N, scale·H, scale·W, 3)
    ch, cw = h * scale, w * scale
    font = ImageFont.load_default(size=font_size)  # FreeType (Pillow >= 10.1), the bitmap font without it
    ascent, descent = font.getmetrics() if hasattr(font, "getmetrics") else (font_size, 2)
    line_h = ascent + descent + 1
    layout = []  # per row: [(first col, last col, wrapped lines)]
    for r in range(rows):
        cells = list(range(r * ncol, min(n, (r + 1) * ncol)))
        groups: list[list[int]] = []
        for k in cells:
            if groups and captions[k] == captions[groups[-1][0]]:
                groups[-1].append(k)
            else:
                groups.append([k])
        row = []
        for g in groups:
            c0, c1 = g[0] - r * ncol, g[-1] - r * ncol
            width = (c1 - c0 + 1) * (cw + pad) - pad - 2
            row.append((c0, c1, _wrap(str(captions[g[0]]), font, width, max_lines)))
        layout.append(row)
    cap_h = [max((len(lines) for *_, lines in row), default=0) * line_h for row in layout]
    height = sum(ch + pad + c for c in cap_h) + pad
    grid = np.full((height, ncol * (cw + pad) + pad, 3), 255, dtype=np.uint8)
    y = pad
    tops = []
    for r in range(rows):
        for k in range(r * ncol, min(n, (r + 1) * ncol)):
            x = pad + (k - r * ncol) * (cw + pad)
            grid[y : y + ch, x : x + cw] = big[k]
        tops.append(y + ch)
        y += ch + pad + cap_h[r]
    img = Image.fromarray(grid)
    draw = ImageDraw.Draw(img)
    for r, row in enumerate(layout):
        for c0, _, lines in row:
            for i, line in enumerate(lines):
                draw.text((pad + c0 * (cw + pad) + 1, tops[r] + 1 + i * line_h), line, fill=(0, 0, 0), font=font)
    return np.asarray(img)


def save_png(array: np.ndarray, path: str | Path, scale: int = 1) -> None:
    img = Image.fromarray(array)
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.Resampling.NEAREST)
    img.save(path)


ANIMATION_SUFFIXES = (".png", ".gif")  # animated PNG (lossless) and GIF (256-colour palette), both written by PIL


def is_video(images: torch.Tensor) -> bool:
    """Decoded output of a video model: frames (B, F, 3, H, W) (images are (B, 3, H, W))."""
    return images.ndim == 5


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """(B, F, 3, H, W) float frames in [0, 1] → (B, F, H, W, 3) uint8 (`to_uint8_hwc` frame by frame)."""
    b, f, c, h, w = video.shape
    return to_uint8_hwc(video.reshape(b * f, c, h, w)).numpy().reshape(b, f, h, w, c)


def first_frames(images: torch.Tensor) -> torch.Tensor:
    """Each clip's first frame (B, 3, H, W) of video frames (B, F, 3, H, W); images are returned as they are."""
    return images[:, 0] if is_video(images) else images


def save_animation(frames: np.ndarray, path: str | Path, *, fps: float = 16.0, scale: int = 1) -> None:
    """(F, H, W, 3) uint8 frames → one animated image, looping, at `fps` (Wan's 16 by default): an animated PNG for a
    .png path (lossless), a GIF for .gif (PIL's palette quantisation). PIL merges consecutive identical frames into
    one longer frame.

    Raises:
        ValueError: another suffix.
    """
    path = Path(path)
    if path.suffix.lower() not in ANIMATION_SUFFIXES:
        raise ValueError(f"'{path}': an animation is written as .png (animated PNG) or .gif, not '{path.suffix}'")
    imgs = [Image.fromarray(f) for f in frames]
    if scale > 1:
        imgs = [im.resize((im.width * scale, im.height * scale), Image.Resampling.NEAREST) for im in imgs]
    imgs[0].save(path, save_all=True, append_images=imgs[1:], duration=max(1, round(1000 / fps)), loop=0)


@torch.no_grad()
def generate(
    model: FlowModel,
    prompts: Sequence[str],
    *,
    steps: int,
    guidance: float,
    seed: int,
    indices: Sequence[int] | None = None,
    batch_size: int = 64,
    shift: float = 3.0,
) -> torch.Tensor:
    """ODE samples for prompts with per-line fixed noise. Returns `model.decode`'s output: (N, 3, H, W) float images
    in [0, 1], or a video model's frames (N, F, 3, H, W)."""
    indices = list(range(len(prompts))) if indices is None else list(indices)
    out = []
    for s in range(0, len(prompts), batch_size):
        chunk = list(prompts[s : s + batch_size])
        noise = line_noise(seed, indices[s : s + batch_size], tuple(model.latent_shape))
        # real models sample on their scheduler's own grid (diffusers parity); the tiny model on the shifted uniform
        # grid
        grid = model.time_grid(steps) if hasattr(model, "time_grid") else steps
        x0 = sample_ode(model, chunk, steps=grid, guidance_scale=guidance, init_noise=noise, shift=shift)
        out.append(model.decode(x0))
    return torch.cat(out)


def evaluate(
    model: FlowModel,
    prompt_set: PromptSet,
    *,
    reward=None,
    steps: int = 40,
    guidance: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
    shift: float = 3.0,
    out_dir: str | Path | None = None,
    write_samples: bool = True,
    limit: int | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Sample every prompt line once and score it.

    Args:
        model: any FlowModel.
        prompt_set: prompts + metadata (shapes/GenEval records get the verifier's correct/strict summary).
        reward: a RewardFn; None = the shapes verifier reward.
        steps, guidance, seed, shift: ODE sampler settings (Flow-GRPO evaluates with 40 ODE steps).
        out_dir: if given, write GenEval's folder layout, results.jsonl, summary.json and grid.png there.
        limit: evaluate only the first `limit` lines.
        info: more entries for the summary's "settings" (`flowcredit eval`: the reward's name and the model).

    Returns:
        summary dict: reward mean, per-tag reward, GenEval summary for `correct` and `strict`, settings.
    """
    if reward is None:
        from ..rewards.shapes import ShapesReward

        reward = ShapesReward()
    n = len(prompt_set) if limit is None else min(limit, len(prompt_set))
    prompts, meta = prompt_set.prompts[:n], prompt_set.metadata[:n]
    images = generate(model, prompts, steps=steps, guidance=guidance, seed=seed, batch_size=batch_size, shift=shift)
    video = is_video(images)
    score_t, rows = _score_rows(reward, images, prompts, meta, video)
    summary: dict[str, Any] = {
        "num_images": n,
        **({"num_frames": int(images.shape[1])} if video else {}),
        "reward_mean": float(score_t.mean()),
        "settings": {"steps": steps, "guidance": guidance, "seed": seed, "shift": shift, "prompts": prompt_set.source,
                     **(info or {})},
    }
    tags: dict[str, list[float]] = {}
    for row in rows:
        tags.setdefault(row["tag"], []).append(row["reward"])
    summary["reward_by_tag"] = {t: float(np.mean(v)) for t, v in tags.items()}
    if rows and "correct" in rows[0]:
        from ..shapes.geneval import summarize

        g = summarize(rows)
        summary["geneval"] = g
        summary["correct_overall"] = g["correct"]["overall"]
        summary["strict_overall"] = g["strict"]["overall"]
        summary["strict_by_tag"] = {t: v["accuracy"] for t, v in g["strict"]["tags"].items()}
    if out_dir is not None:
        _write_outputs(Path(out_dir), images, prompts, meta, rows, summary, write_samples)
    return summary


def _score_rows(reward, images: torch.Tensor, prompts: list[str], meta: list[dict], video: bool
                ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Scores (n,) of images (n, 3, H, W) or clips (n, F, 3, H, W) in reward calls of ≈ 256 images, and one
    results.jsonl row per line (GenEval's fields; correct / strict / reason / details when the reward has them)."""
    n, scores, rows = len(prompts), [], []
    chunk = max(1, 256 // images.shape[1]) if video else 256  # ≈ 256 images per reward call: clips × frames
    for s in range(0, n, chunk):
        ro = reward(images[s : s + chunk], prompts[s : s + chunk], meta[s : s + chunk])
        scores.append(ro.scores)
        results = ro.info.get("results")
        for k in range(len(ro.scores)):
            i = s + k
            row = {
                "filename": f"{i:05d}/samples/0000.png",
                "tag": meta[i].get("tag", ""),
                "prompt": prompts[i],
                "reward": float(ro.scores[k]),
                "metadata": json.dumps(meta[i]),
            }
            if results is not None:
                r = results[k]
                row.update(
                    correct=bool(r.correct), strict=bool(r.strict), reason=r.reason, details=json.dumps(r.details)
                )
            rows.append(row)
    return torch.cat(scores), rows


def _write_outputs(out: Path, images: torch.Tensor, prompts: list[str], meta: list[dict], rows: list[dict[str, Any]],
                   summary: dict[str, Any], write_samples: bool) -> None:
    """GenEval's folder layout (NNNNN/metadata.jsonl, NNNNN/samples/0000.png; a clip as an animated PNG),
    results.jsonl, summary.json and grid.png (the first 128 samples with their prompts) under `out`."""
    n, video = len(prompts), is_video(images)
    out.mkdir(parents=True, exist_ok=True)
    u8 = to_uint8_hwc(first_frames(images)).numpy()  # a video: the grid shows the first frames
    clips = to_uint8_frames(images) if video and write_samples else None
    if write_samples:
        for i in range(n):
            d = out / f"{i:05d}"
            (d / "samples").mkdir(parents=True, exist_ok=True)
            (d / "metadata.jsonl").write_text(json.dumps(meta[i]) + "\n")
            if clips is not None:
                save_animation(clips[i], d / "samples" / "0000.png")  # the clip as an animated PNG
            else:
                save_png(u8[i], d / "samples" / "0000.png")
    with open(out / "results.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    m = min(n, 128)
    save_png(caption_grid(u8[:m], prompts[:m], ncol=16, scale=3), out / "grid.png")  # the prompt under each sample


def tag_balanced_subset(prompt_set: PromptSet, n: int) -> PromptSet:
    """A fixed subset of ≈ n lines with the tags interleaved (for cheap periodic evaluation)."""
    by_tag: dict[str, list[int]] = {}
    for i, m in enumerate(prompt_set.metadata):
        by_tag.setdefault(m.get("tag", ""), []).append(i)
    order: list[int] = []
    k = 0
    while len(order) < min(n, len(prompt_set)):
        for t in by_tag:
            if k < len(by_tag[t]) and len(order) < n:
                order.append(by_tag[t][k])
        k += 1
    return PromptSet(
        [prompt_set.prompts[i] for i in order],
        [prompt_set.metadata[i] for i in order],
        prompt_set.source + f"[balanced {n}]",
    )
