"""`flowcredit eval` and `flowcredit sample`: load any model family (a run folder, a checkpoint, a base model
from model.* keys, or the shipped tiny model), sample with fixed per-line noise, score and write.
"""

from __future__ import annotations

from pathlib import Path

from .common import _device_problem, _fail


def load_any_model(path: str | None, precision: str = "fp32"):
    """`models.loading.load_any_model` (imported on use: torch stays off the CLI's start-up path)."""
    from ..models.loading import load_any_model as _load

    return _load(path, precision)


def _inference_overrides(ns, sections: tuple[str, ...]) -> list[str] | str:
    """The `key=value` arguments of sample/eval, each of one of `sections`; else the one-line error text."""
    out = []
    for o in ns.overrides:
        key = o.split("=", 1)[0].strip()
        if "=" not in o:
            quote = 'quote a prompt with spaces (flowcredit sample "a red circle" ...), '
            hint = quote if ns.command == "sample" else ""
            return f"unexpected argument '{o}'; {hint}give a run as --checkpoint DIR and settings as key=value"
        if key.split(".", 1)[0] not in sections:
            allowed = " and ".join(f"{s}.*" for s in sections)
            return (
                f"'{o}': flowcredit {ns.command} takes {allowed} overrides only (e.g. model.name=sd3 model.path=DIR), "
                "the way flowcredit train reads them; the other sections are training settings"
            )
        out.append(o)
    return out


def _load_for_inference(ns, overrides: list[str]):
    """(ModelSource, settings) of sample/eval: the model to load and the sampler settings the flags leave unset.

    Unset flags of an sd3/flux run take the run's own evaluation settings (run.eval_steps, run.eval_guidance,
    run.eval_prompts, the reward section); everything else the flags' fixed defaults (40 steps, CFG 1.0,
    shapes:test)."""
    from ..models.loading import resolve_model_source

    src = resolve_model_source(
        ns.checkpoint, overrides, precision=ns.precision, use_ema=not ns.no_ema, model_path=ns.model_path
    )
    rc = src.config.run if src.from_run else None
    settings = {
        "steps": ns.steps if ns.steps is not None else (rc.eval_steps if rc else 40),
        "guidance": ns.cfg if ns.cfg is not None else (rc.eval_guidance if rc else 1.0),
    }
    if ns.device:
        bad = _device_problem(ns.device, "--device")
        if bad:
            raise ValueError(bad)
    return src, settings


def _loaded_line(src, settings) -> str:
    grid = "its scheduler's time grid" if src.family != "tiny" else "the shifted uniform grid"
    line = f"model: {src.describe()}; {settings['steps']} ODE steps on {grid}, CFG {settings['guidance']}"
    if src.family == "flux":
        emb = src.config.model.options.get("embedded_guidance")
        line += f", embedded guidance {3.5 if emb is None else emb}"
    return line


def _scores_shapes(reward) -> bool:
    """The reward is (or mixes in) the shapes verifier."""
    from ..rewards.shapes import ShapesReward

    parts = [reward, *(fn for fn, _ in getattr(reward, "parts", None) or [])]  # rewards.mix: (reward, weight)
    return any(isinstance(r, ShapesReward) for r in parts)


def _is_video_model(model) -> bool:
    """A text-to-video model (wan): its decode returns frames (B, F, 3, H, W); its latent is (C, F, h, w)."""
    return getattr(model, "num_frames", None) is not None and len(tuple(model.latent_shape)) == 4


def _frame_reward(reward):
    """A video model's reward: an image reward (a name given to --reward / reward.name, or a run's image reward)
    scores each frame and is averaged per clip (`models.wan.FrameMeanReward`, every frame); a FrameMeanReward (a wan
    run's own reward) is kept as it is."""
    from ..models.wan import FrameMeanReward

    return reward if isinstance(reward, FrameMeanReward) else FrameMeanReward.around(reward)


def cmd_eval(ns) -> int:
    import torch

    from ..config import ConfigError
    from ..eval.evaluate import evaluate
    from ..rewards.registry import reward_from_config
    from ..shapes.geneval import format_summary
    from ..shapes.prompts import PromptFileError, load_prompts

    overrides = _inference_overrides(ns, ("model", "reward"))
    if isinstance(overrides, str):
        return _fail(overrides)
    if ns.reward:
        overrides.append(f"reward.name={ns.reward}")
    reward_given = any(o.split("=", 1)[0].strip().split(".", 1)[0] == "reward" for o in overrides)
    try:
        if ns.prompts is not None:  # a bad prompt file is reported before anything is loaded
            prompts = load_prompts(ns.prompts)
        src, settings = _load_for_inference(ns, overrides)
        if ns.prompts is None:
            prompts = load_prompts(src.config.run.eval_prompts if src.from_run else "shapes:test")
        if src.family != "tiny" and not src.from_run and not reward_given:
            from ..rewards.registry import names

            raise ValueError(
                f"flowcredit eval of model.name={src.family} without a run to take the reward from needs --reward "
                f"NAME (registered: {', '.join(names())}; or a 'module:Class' path; options as "
                "reward.options.KEY=VALUE); the default shapes verifier scores only the tiny model's shapes world"
            )
        reward = reward_from_config(src.config.reward)
        check = getattr(reward, "check_prompts", None)  # a reward may require prompt metadata (shapes)
        if callable(check):
            check(prompts.metadata, prompts.source)
        model = src.load(ns.device)
        side = getattr(model, "resolution", None)  # sd3/flux: the image side in pixels
        if side is not None and _scores_shapes(reward):
            from ..shapes.vocab import WORLDS

            if side not in WORLDS:
                raise ValueError(
                    f"reward 'shapes' (the shapes verifier) scores {' or '.join(map(str, WORLDS))}-px images of the "
                    f"shapes world; this {src.family} model draws {side}-px images: give --reward NAME"
                )
        if _is_video_model(model):
            reward = _frame_reward(reward)
    except (ConfigError, PromptFileError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if src.family != "tiny":
        print(_loaded_line(src, settings))
    stem = Path(ns.checkpoint).stem if ns.checkpoint else ("shipped" if src.family == "tiny" else f"{src.family}-base")
    out = ns.out or f"eval_out/{stem}-cfg{settings['guidance']}-s{settings['steps']}"
    reward_name = src.config.reward.name
    batch = ns.batch_size if ns.batch_size is not None else (
        64 if src.family == "tiny" else 2 if _is_video_model(model) else 8)
    try:
        s = evaluate(
            model,
            prompts,
            reward=reward,
            steps=settings["steps"],
            guidance=settings["guidance"],
            seed=ns.seed,
            out_dir=out,
            limit=ns.limit,
            batch_size=batch,
            info={"reward": reward_name, "model": src.describe()},
        )
    except ValueError as e:  # a reward that refuses its input (RewardInputError, metadata it needs)
        return _fail(f"evaluating with reward '{reward_name}': {e}")
    if "geneval" in s:
        print(format_summary(s["geneval"], "correct"))
        print(f"Strict overall (exact counts, no extras): {s['strict_overall']:.5f}")
    print(f"Mean reward ({reward_name}): {s['reward_mean']:.5f}")
    print(f"written to {out}")
    return 0


def cmd_sample(ns) -> int:
    import numpy as np

    from ..config import ConfigError
    from ..eval.evaluate import (
        ANIMATION_SUFFIXES,
        generate,
        is_video,
        make_grid,
        save_animation,
        save_png,
        to_uint8_frames,
    )
    from ..types import to_uint8_hwc

    overrides = _inference_overrides(ns, ("model",))
    if isinstance(overrides, str):
        return _fail(overrides)
    try:
        src, settings = _load_for_inference(ns, overrides)
        model = src.load(ns.device)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    if src.family != "tiny":
        print(_loaded_line(src, settings))
    video = _is_video_model(model)
    out = Path(ns.out)
    if video and out.suffix.lower() not in ANIMATION_SUFFIXES:
        return _fail(
            f"--out {ns.out}: a {src.family} model draws video clips, written as animations: give --out FILE.png "
            "(animated PNG, lossless) or FILE.gif"
        )
    imgs = generate(model, [ns.prompt] * ns.n, steps=settings["steps"], guidance=settings["guidance"], seed=ns.seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    if is_video(imgs):  # frames (N, F, 3, H, W): an animated grid + each clip on its own
        clips = to_uint8_frames(imgs)  # (N, F, H, W, 3)
        scale = 4 if clips.shape[2] <= 64 else 1
        grids = np.stack([make_grid(clips[:, f], ncol=min(8, ns.n)) for f in range(clips.shape[1])])
        save_animation(grids, out, scale=scale)
        for k in range(ns.n):
            save_animation(clips[k], out.with_name(f"{out.stem}-{k:03d}{out.suffix}"), scale=scale)
    else:
        u8 = to_uint8_hwc(imgs).numpy()
        save_png(make_grid(u8, ncol=min(8, ns.n)), out, scale=4 if u8.shape[1] <= 64 else 1)
    if ns.save_tensors:
        from safetensors.torch import save_file

        Path(ns.save_tensors).parent.mkdir(parents=True, exist_ok=True)
        save_file({"frames" if is_video(imgs) else "images": imgs.detach().float().cpu().contiguous()},
                  ns.save_tensors)
    if is_video(imgs):
        print(f"wrote {ns.n} clips of {imgs.shape[1]} frames of '{ns.prompt}' to {out} (animated grid) and "
              f"{out.with_name(f'{out.stem}-000{out.suffix}')} ... (one per clip)")
    else:
        print(f"wrote {ns.n} samples of '{ns.prompt}' to {ns.out}")
    return 0
