"""`flowcredit` command line: train | eval | sample | prompts | render | pretrain | compare | export | convert |
serve-reward.

    flowcredit train                                  # the embedded default: tiny model, shapes, DiffusionNFT, CPU
    flowcredit train tiny_stepwise run.iterations=50  # a preset + key=value overrides
    flowcredit train method=vgpo                      # method=X alone picks the preset tiny_X
    flowcredit train objective=awm method=vgpo        # objective=X picks tiny_X first (its recipe), method on top
    flowcredit train my.yaml optim.lr=1e-5            # a YAML file (may say `base: tiny_flow_grpo`)
    flowcredit train --help-config                    # every key, its type, default and help
    flowcredit train resume=runs/x [key=value ...]    # continue a run from its newest valid checkpoint
    flowcredit eval --checkpoint runs/x --cfg 4.5     # GenEval layout + results.jsonl + summary.json + grid.png
    flowcredit sample "a cat" --checkpoint runs/sd3-run [--model-path DIR]      # any family: the run's model + weights
    flowcredit eval model.name=sd3 model.path=DIR --reward pickscore --prompts p.txt  # a base model, a reward
    flowcredit convert --trust runs/x/checkpoints/iter000010.pt   # an old pickle checkpoint → safetensors + JSON

Bad input prints one line `error: ...` naming the field, where it came from and the fix, and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from ..config.resolve import DEFAULT_PRESET, PRESET_DIR, resolve_train_config  # noqa: F401  (re-exported)

_PACKAGE = Path(__file__).resolve().parent.parent


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """A warning raised by flowcredit's own code as one line `warning: ...` (it names the file and what happens, e.g.
    a damaged checkpoint skipped on resume), not Python's `path:line: UserWarning: ...` plus a source line; any other
    warning keeps Python's format."""
    if Path(filename).resolve().is_relative_to(_PACKAGE):
        return f"warning: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _os_error(e: OSError) -> str:
    """A file-system error in a few words: '[Errno 28] No space left on device: 'runs/x/metrics.jsonl''."""
    what = f"[Errno {e.errno}] {e.strerror}" if e.errno is not None and e.strerror else f"{type(e).__name__}: {e}"
    return what + (f": '{e.filename}'" if e.filename else "")


def _device_problem(device: str, key: str = "run.device") -> str | None:
    """One line when `run.device` (or `key`) names a device this machine's torch cannot use, else None."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        return f"{key}={device!r} is not a torch device ({e}); use cpu or cuda[:N]"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return (
                f"{key}={device}, but torch {torch.__version__} sees no CUDA device here; use {key}=cpu "
                "or a CUDA build of torch on a machine with a GPU"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"{key}={device}, but this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def cmd_train(ns) -> int:
    from ..config import ConfigError, describe
    from ..config.schema import TrainConfig
    from ..trainer.faults import RunStopped, TrainingError
    from ..trainer.loop import Trainer

    if ns.help_config:  # the schema, then every registry's implementations and their options (generated)
        from ..config.registry import describe_registries

        print(describe(TrainConfig))
        print(describe_registries())
        return 0
    cfg = None
    try:
        cfg, name = resolve_train_config(ns.args)
        bad_device = _device_problem(cfg.run.device)
        if bad_device:
            return _fail(bad_device)
        trainer = Trainer(cfg, preset_name=name)
        trainer.setup()
    except (ConfigError, TrainingError, ValueError, FileNotFoundError, NotImplementedError) as e:
        return _fail(str(e))
    except OSError as e:  # the run folder cannot be made: a file in the way, not writable, disk full
        out = cfg.run.out_dir if cfg is not None and cfg.run.out_dir else "runs/<preset>-<time>"
        return _fail(
            f"{_os_error(e)} while setting up the run (run.out_dir={out}); give run.out_dir a folder you can write, "
            "on a disk with free space"
        )
    main_rank = trainer.dist.is_main
    if getattr(ns, "warm_baseline", False):
        if trainer.evaluation is None or not (cfg.run.eval_baseline and cfg.run.eval_baseline_cache):
            return _fail(
                "--warm-baseline needs run.eval_baseline=true, run.eval_at_end=true and "
                "run.eval_baseline_cache=FOLDER (it fills that cache)"
            )
        cache = trainer.evaluation.warm_baseline()
        if main_rank:
            print(f"initial model's evaluation cached: {cache}")
        return 0
    if main_rank:
        print(f"run folder: {trainer.out}")
    try:
        result = trainer.train()
    except RunStopped as e:  # a fault the run cannot survive; the last checkpoint is intact
        print(f"\nerror: {e}", file=sys.stderr)  # \n: never on the line of an unfinished progress bar
        trainer.dist.close(barrier=False)
        return 3
    except OSError as e:  # disk full / folder gone or read-only mid-run: checkpoints are renamed into place when whole
        print(
            f"\nerror: {_os_error(e)} after iteration {trainer.iteration}; the last complete checkpoint is intact (a "
            f"checkpoint counts only once fully written); free space or fix the folder, then continue with: "
            f"flowcredit train resume={trainer.out}",
            file=sys.stderr,
        )
        trainer.dist.close(barrier=False)
        return 3
    if result.get("stopped"):
        if main_rank:
            print(
                f"stopped by {result['stopped']} after iteration {result['iterations']}; checkpoint written. "
                f"Continue with: flowcredit train resume={trainer.out}"
            )
        return 0
    if not main_rank:
        return 0
    ev = result.get("eval")
    if ev:
        t = ev["trained"]
        line = (
            f"eval ({cfg.run.eval_prompts}, cfg {cfg.run.eval_guidance}, {cfg.run.eval_steps} ODE steps): "
            f"reward {t['reward_mean']:.4f}"
        )
        if "strict_overall" in t:
            line += f", strict overall {t['strict_overall']:.4f}"
        if "delta" in ev:
            line += "  (Δ vs initial: " + ", ".join(f"{k} {v:+.4f}" for k, v in ev["delta"].items()) + ")"
        print(line)
    print(f"done: {result['iterations']} iterations in {result['train_seconds']:.0f} s; see {trainer.out}")
    return 0


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


def cmd_prompts(ns) -> int:
    from ..shapes.prompts import SplitSpec, write_prompt_files

    paths = write_prompt_files(ns.out_dir, ns.resolution, SplitSpec(seed=ns.seed))
    for k, p in paths.items():
        print(f"{k}: {p} ({sum(1 for _ in open(p))} lines)")
    return 0


def cmd_render(ns) -> int:
    from ..eval.evaluate import save_png
    from ..shapes.prompts import PromptFileError, check_shapes_vocab, load_prompts
    from ..shapes.render import render_record
    from ..shapes.vocab import get_world

    try:
        ps = load_prompts(ns.prompts)
        world = get_world(ns.resolution)
        for i, m in enumerate(ps.metadata):
            if "include" not in m:
                raise PromptFileError(
                    f"{ps.source}: line {i + 1} has no GenEval metadata; render needs .jsonl records"
                )
            check_shapes_vocab(m, world, f"{ps.source} record {i + 1}")
    except (PromptFileError, ValueError) as e:
        return _fail(str(e))
    out = Path(ns.out_dir)
    for i, m in enumerate(ps.metadata):
        d = out / f"{i:05d}"
        (d / "samples").mkdir(parents=True, exist_ok=True)
        (d / "metadata.jsonl").write_text(json.dumps(m) + "\n")
        for k in range(ns.n_samples):
            save_png(render_record(m, ns.seed, i, k, ns.resolution), d / "samples" / f"{k:04d}.png")
    print(f"rendered {len(ps) * ns.n_samples} ground-truth images to {out}")
    return 0


def cmd_pretrain(ns) -> int:
    from ..models.pretrain import PretrainConfig, pretrain, validate

    kw = {k: v for k, v in vars(ns).items() if k in PretrainConfig.__dataclass_fields__ and v is not None}
    model = {}
    if ns.width:
        model["width"] = ns.width
    if ns.depth:
        model["depth"] = ns.depth
    cfg = PretrainConfig(**kw, model=model)
    from ..checkpoints import CheckpointError

    try:
        validate(cfg)
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    try:
        pretrain(cfg)
    except CheckpointError as e:  # resuming from a damaged or pickle checkpoint
        return _fail(str(e))
    return 0


def cmd_convert(ns) -> int:
    """An old pickle checkpoint → the safetensors + JSON format, only with --trust (`trainer/convert.py`)."""
    from ..checkpoints import CheckpointError
    from ..trainer.convert import convert_legacy

    if not ns.trust:
        return _fail(
            f"convert reads the pickle '{ns.old}', and pickles can run code; only if you trust its origin, "
            f"rerun as: flowcredit convert --trust {ns.old}" + (f" {ns.new}" if ns.new else "")
        )
    try:
        out = convert_legacy(ns.old, ns.new)
    except (CheckpointError, FileNotFoundError) as e:
        return _fail(str(e))
    print(f"converted {ns.old} to {out} (tensors.safetensors + state.json + manifest.json)")
    return 0


def cmd_compare(ns) -> int:
    from ..compare.report import write_report
    from ..compare.study import execute, load_study, study_from_presets
    from ..config import ConfigError

    try:
        if len(ns.study) == 1 and (ns.study[0].endswith((".yaml", ".yml")) or not ns.study[0].startswith("tiny_")):
            study = load_study(ns.study[0])
            if ns.seeds:
                study.seeds = ns.seeds
            if ns.iterations:
                study.iterations = ns.iterations
        else:
            study = study_from_presets(
                ns.study, ns.seeds or [0, 1, 2], ns.iterations or 40, ns.eval_every, ns.override
            )
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    out = Path(ns.out or f"results/{Path(ns.study[0]).stem}")
    args = [a for a in sys.argv[2:] if a != "--report-only"]  # the command that makes (and resumes) the runs
    command = "flowcredit compare " + " ".join(args or ns.study)
    if not ns.report_only:
        results = execute(study, out, parallel=ns.parallel, threads=ns.threads, reuse=[Path(d) for d in ns.reuse])
        failed = [r for r in results if r[1] != 0]
        if failed:
            print(f"{len(failed)} run(s) failed: {failed}; rerun the same command to resume", file=sys.stderr)
    path = write_report(study, out, command)
    print(f"report: {path}")
    return 0


def cmd_export(ns) -> int:
    """A trained checkpoint → diffusers format (LoRA via save_lora_weights, full fine-tunes via save_pretrained),
    or, for the tiny model, a .safetensors + JSON pair loadable by `--checkpoint`."""
    try:
        p = Path(ns.checkpoint)
        run = p if (p / "checkpoints").is_dir() else p.parent.parent  # a run folder, or runs/x/checkpoints/iterN
        cfg_path = run / "config.yaml"
        name = "tiny"
        if cfg_path.exists():
            import yaml

            try:
                doc = yaml.safe_load(cfg_path.read_text())
                name = ((doc.get("model") or {}) if isinstance(doc, dict) else {}).get("name", "tiny")
            except (yaml.YAMLError, AttributeError) as e:
                raise ValueError(
                    f"'{cfg_path}' is not a readable run config ({type(e).__name__}); fix or remove it"
                ) from None
        if name == "tiny":
            model = load_any_model(ns.checkpoint, "fp32")
            out = model.save(ns.out, name=ns.name)
        else:
            from ..models.export import export_checkpoint

            out = export_checkpoint(ns.checkpoint, ns.out, use_ema=not ns.no_ema, model_path=ns.model_path)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return _fail(str(e))
    print(f"exported to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="flowcredit",
        description="RL fine-tuning of flow-matching text-to-image models with step-level credit assignment.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve-reward",
        help="serve a registered reward over HTTP (JSON, never pickle): serve-reward NAME --port 8765 [--token T]",
    )

    t = sub.add_parser(
        "train", help="train with a preset/YAML and key=value overrides (default: the embedded tiny Flow-GRPO job)"
    )
    t.add_argument("args", nargs="*", help="[PRESET|file.yaml] key=value ...")
    t.add_argument("--help-config", action="store_true", help="list every config key with its type, default and help")
    t.add_argument(
        "--warm-baseline",
        action="store_true",
        help="only evaluate the initial model into run.eval_baseline_cache (if not there yet) and stop; "
        "`flowcredit compare` runs it before time-budgeted runs",
    )
    t.set_defaults(fn=cmd_train)

    def model_args(p, reward: bool = False):
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="model.KEY=VALUE",
            help="model settings the way `flowcredit train` takes them, e.g. model.name=sd3 model.path=DIR (no "
            "--checkpoint: that base model), or overrides of an sd3/flux run's own model section"
            + ("; reward.KEY=VALUE likewise (reward.options.model=DIR)" if reward else ""),
        )
        p.add_argument(
            "--checkpoint",
            default=None,
            help="a run folder or checkpoints/iterNNNNNN folder of any model family (an sd3/flux run is rebuilt from "
            "its config.yaml's model section, base model at its model.path, and its LoRA or full weights), or a tiny "
            "model .safetensors (default: the model of the model.* overrides, else the shipped tiny model)",
        )
        p.add_argument(
            "--cfg",
            type=float,
            default=None,
            help="classifier-free guidance scale (FLUX: true CFG; its distilled guidance is "
            "model.options.embedded_guidance); default: an sd3/flux run's run.eval_guidance, else 1.0",
        )
        p.add_argument(
            "--steps",
            type=int,
            default=None,
            help="ODE steps on the model's own time grid (sd3/flux: its scheduler's sigmas); default: an sd3/flux "
            "run's run.eval_steps, else 40",
        )
        p.add_argument("--seed", type=int, default=0, help="noise seed: the noise of line i depends on (seed, i) only")
        p.add_argument(
            "--precision",
            choices=["auto", "fp32", "bf16"],
            default=None,
            help="autocast dtype of the model; auto = bf16 only where the hardware runs it fast; default: an sd3/flux "
            "run's model.precision, else fp32",
        )
        p.add_argument("--no-ema", action="store_true", help="the raw weights even if the run kept an EMA")
        p.add_argument("--model-path", default=None, help="base model folder if it moved since training (sd3/flux)")
        p.add_argument(
            "--device", default=None, help="torch device (default: cpu for the tiny model, the GPU if any for "
            "sd3/flux)"
        )

    e = sub.add_parser(
        "eval",
        help="score a model on a prompt file or split (GenEval layout + summary)",
        description="Sample every prompt line once (fixed per-line noise, ODE) and score it. What it scores: "
        "--reward NAME / reward.* overrides if given; else an sd3/flux run's own reward (its config.yaml reward "
        "section: what the run trained and evaluated with); else the shapes verifier (GenEval correct/strict "
        "summary; meaningful for the tiny model on shapes prompts only, so an sd3/flux model without a run needs "
        "--reward). Writes <out>/NNNNN/samples/0000.png, results.jsonl, summary.json (settings: reward, model) and "
        "grid.png. A video model (wan): each 0000.png is the clip as an animated PNG, grid.png shows first frames, "
        "and an image reward scores every frame, averaged per clip (models.wan.FrameMeanReward; a wan run's own "
        "FrameMeanReward as configured).",
    )
    model_args(e, reward=True)
    e.add_argument(
        "--prompts",
        default=None,
        help="shapes:test | shapes:test_unique | shapes:train | file.jsonl | file.txt (plain prompts need a reward "
        "that reads no metadata); default: an sd3/flux run's run.eval_prompts, else shapes:test",
    )
    e.add_argument(
        "--reward",
        default=None,
        help="a registered reward (flowcredit.rewards.registry: shapes, pickscore, clipscore, imagereward, remote, "
        "...) or 'module:Class'; options as reward.options.KEY=VALUE; default: see above",
    )
    e.add_argument("--out", default=None, help="output folder")
    e.add_argument("--limit", type=int, default=None, help="only the first N prompt lines")
    e.add_argument(
        "--batch-size", type=int, default=None,
        help="images per sampling batch (default: 64 tiny, 8 sd3/flux, 2 clips wan)"
    )
    e.add_argument("--threads", type=int, default=0)
    e.set_defaults(fn=cmd_eval)

    s = sub.add_parser(
        "sample",
        help="draw images for one prompt (any model family; a video model (wan): clips, written as animations)",
    )
    s.add_argument("prompt")
    model_args(s)
    s.add_argument("--n", type=int, default=8)
    s.add_argument(
        "--out",
        default="samples.png",
        help="the image grid (PNG); a video model (wan): the grid animated (clip k in cell k; .png = animated PNG, "
        ".gif = GIF, 16 fps), each clip also as <stem>-NNN<suffix> beside it",
    )
    s.add_argument(
        "--save-tensors",
        default=None,
        metavar="FILE",
        help="also write the decoded images, float32 (N, 3, H, W) in [0, 1], as 'images' in a .safetensors file (a "
        "video model: its frames (N, F, 3, H, W) as 'frames')",
    )
    s.set_defaults(fn=cmd_sample)

    p = sub.add_parser("prompts", help="write the shapes benchmark prompt files (GenEval + flow_grpo layouts)")
    p.add_argument("out_dir")
    p.add_argument("--resolution", type=int, default=32, choices=[32, 64])
    p.add_argument("--seed", type=int, default=43)
    p.set_defaults(fn=cmd_prompts)

    r = sub.add_parser("render", help="write ground-truth images for a prompt file in GenEval's folder layout")
    r.add_argument("prompts", help="shapes:test or a .jsonl file")
    r.add_argument("out_dir")
    r.add_argument("--resolution", type=int, default=32, choices=[32, 64])
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--n-samples", type=int, default=1)
    r.set_defaults(fn=cmd_render)

    x = sub.add_parser(
        "export", help="export a trained checkpoint (diffusers LoRA / save_pretrained, or tiny .safetensors)"
    )
    x.add_argument("checkpoint", help="run folder or checkpoints/iterNNNNNN folder")
    x.add_argument("out", help="output folder")
    x.add_argument("--name", default="tiny_rl", help="file stem for tiny-model exports")
    x.add_argument("--no-ema", action="store_true", help="export the raw weights even if the run kept an EMA")
    x.add_argument("--model-path", default=None, help="base model folder if it moved since training (real models)")
    x.set_defaults(fn=cmd_export)

    cv = sub.add_parser(
        "convert",
        help="rewrite a trusted old pickle checkpoint (.pt) as safetensors + JSON: convert --trust OLD.pt [NEW]",
    )
    cv.add_argument("old", help="an old checkpoints/iterNNNNNN.pt or pretraining state.pt")
    cv.add_argument(
        "new",
        nargs="?",
        default=None,
        help="the checkpoint folder to write (default: iterNNNNNN.pt → iterNNNNNN beside it, state.pt → "
        "checkpoints/stepNNNNNN)",
    )
    cv.add_argument(
        "--trust",
        action="store_true",
        help="you trust the file's origin (required: it is a pickle; read with torch's restricted unpickler)",
    )
    cv.set_defaults(fn=cmd_convert)

    c = sub.add_parser("compare", help="run presets × seeds (or a study YAML) with a shared budget and write a report")
    c.add_argument("study", nargs="+", help="a study YAML / name (flowcredit/studies) or several presets")
    c.add_argument("--out", default=None, help="report folder (default results/<study>)")
    c.add_argument("--seeds", type=int, nargs="*", default=None)
    c.add_argument("--iterations", type=int, default=None)
    c.add_argument("--eval-every", type=int, default=10)
    c.add_argument("--override", action="append", default=[], help="key=value applied to every arm (repeatable)")
    c.add_argument("--parallel", type=int, default=1, help="runs at a time")
    c.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = cores / parallel)")
    c.add_argument(
        "--reuse",
        action="append",
        default=[],
        metavar="DIR",
        help="copy, instead of retraining, any run whose resolved config equals a finished run's under DIR "
        "(repeatable)",
    )
    c.add_argument("--report-only", action="store_true", help="only (re)write the report from finished runs")
    c.set_defaults(fn=cmd_compare)

    from ..models.pretrain import PretrainConfig

    pt = sub.add_parser("pretrain", help="flow-matching pretraining of the tiny model (resumable)")
    for name, f in PretrainConfig.__dataclass_fields__.items():
        if name == "model":
            continue
        hlp = f"{f.metadata['help']} (default: {f.default!r})"
        if isinstance(f.default, bool):
            pt.add_argument(f"--{name}", type=lambda v: v.lower() in ("1", "true", "yes"), default=None, help=hlp)
        else:
            pt.add_argument(f"--{name}", type=type(f.default), default=None, help=hlp)
    pt.add_argument("--width", type=int, default=None, help="model width of a fresh model (default: TinyDiTConfig's)")
    pt.add_argument("--depth", type=int, default=None, help="number of DiT blocks of a fresh model")
    pt.set_defaults(fn=cmd_pretrain)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    previous, warnings.formatwarning = warnings.formatwarning, _format_warning  # restored: main runs in tests too
    try:
        if args and args[0] == "serve-reward":  # its own parser: flowcredit serve-reward NAME --host --port ...
            from ..rewards.server import main_serve

            return main_serve(args[1:])
        parser = build_parser()
        ns, extra = parser.parse_known_args(args)
        if extra:  # sample/eval: key=value after an option (argparse leaves a later positional group unparsed)
            if getattr(ns, "overrides", None) is None or any(a.startswith("-") for a in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            ns.overrides = [*ns.overrides, *extra]
        return int(ns.fn(ns) or 0)
    finally:
        warnings.formatwarning = previous


if __name__ == "__main__":
    sys.exit(main())
