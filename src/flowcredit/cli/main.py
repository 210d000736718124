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

import sys
import warnings

from ..config.resolve import DEFAULT_PRESET, PRESET_DIR, resolve_train_config  # noqa: F401  (re-exported)
from .common import _device_problem, _fail, _format_warning, _os_error


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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    previous, warnings.formatwarning = warnings.formatwarning, _format_warning  # restored: main runs in tests too
    try:
        if args and args[0] == "serve-reward":  # its own parser: flowcredit serve-reward NAME --host --port ...
            from ..rewards.server import main_serve

            return main_serve(args[1:])
        from .parser import build_parser

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
