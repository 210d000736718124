"""The data and checkpoint commands: `prompts`, `render`, `pretrain`, `convert`, `compare`, `export`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import _fail
from .inference import load_any_model


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
