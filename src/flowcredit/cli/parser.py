"""The `flowcredit` argument parser: one builder per command (the commands are in main.py, inference.py and
commands.py)."""

from __future__ import annotations

import argparse

from .commands import cmd_compare, cmd_convert, cmd_export, cmd_pretrain, cmd_prompts, cmd_render
from .inference import cmd_eval, cmd_sample
from .main import cmd_train


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand with its options (`serve-reward` has its own parser, rewards/server.py)."""
    ap = argparse.ArgumentParser(
        prog="flowcredit",
        description="RL fine-tuning of flow-matching text-to-image models with step-level credit assignment.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve-reward",
        help="serve a registered reward over HTTP (JSON, never pickle): serve-reward NAME --port 8765 [--token T]",
    )

    for add in (_add_train, _add_eval, _add_sample, _add_data, _add_checkpoints, _add_compare, _add_pretrain):
        add(sub)
    return ap


def _add_train(sub) -> None:
    """`flowcredit train`."""
    t = sub.add_parser(
        "train",
        help="train with a preset/YAML and key=value overrides (default: the embedded DiffusionNFT job, tiny_nft)",
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


def model_args(p, reward: bool = False) -> None:
    """The model/checkpoint/sampling options shared by `eval` and `sample`."""
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


def _add_eval(sub) -> None:
    """`flowcredit eval`."""
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
        help="shapes:test | shapes:test_unique | shapes:train | shapes:val | shapes:fit | file.jsonl | file.txt "
        "(plain prompts need a reward that reads no metadata); default: an sd3/flux run's run.eval_prompts, "
        "else shapes:test",
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


def _add_sample(sub) -> None:
    """`flowcredit sample`."""
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


def _add_data(sub) -> None:
    """`flowcredit prompts` and `flowcredit render`."""
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


def _add_checkpoints(sub) -> None:
    """`flowcredit export` and `flowcredit convert`."""
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


def _add_compare(sub) -> None:
    """`flowcredit compare`."""
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


def _add_pretrain(sub) -> None:
    """`flowcredit pretrain`: one option per PretrainConfig field, plus the fresh model's size."""
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
