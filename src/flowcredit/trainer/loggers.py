"""Metric sinks beside ``metrics.jsonl`` (the record of truth): TensorBoard and, optionally, Weights & Biases.

``run.loggers`` picks them: None (the default) = ``[tensorboard]``, best effort (a missing tensorboard is skipped);
naming a logger explicitly makes it required (missing package → one-line error with the pip command).

    loggers = build_loggers(["tensorboard", "wandb"], run_dir, dataclasses.asdict(cfg))
    for lg in loggers:
        lg.log_scalars(iteration, {"reward_mean": 0.41, "seconds/rollout": 2.3})
    ...
    for lg in loggers:
        lg.close()

W&B works without network with ``WANDB_MODE=offline`` (runs are written under ``<run>/wandb/`` and can be uploaded
later with ``wandb sync``). The project comes from ``WANDB_PROJECT`` (default ``flowcredit``), the run name from the
run folder; the W&B run id is kept in ``<run>/wandb_id.txt`` so ``flowcredit train resume=RUN`` continues the same
W&B run. Only rank 0 builds loggers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

KNOWN = ("tensorboard", "wandb")
DEFAULT = ("tensorboard",)


class Logger(Protocol):
    """A metric sink: scalars by name at an iteration, then close."""

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record ``scalars`` (name → finite float) at iteration ``step``."""

    def close(self) -> None:
        """Flush and release the sink."""


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The loggable scalars of one metrics.jsonl record: every finite int/float except ``iteration``, plus the phase
    timings of ``record["seconds"]`` as ``seconds/<phase>``. Lists (per-step curves) and strings stay in the jsonl."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k != "iteration" and isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[k] = float(v)
    for k, v in (record.get("seconds") or {}).items():
        if isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[f"seconds/{k}"] = float(v)
    return out


class TensorBoardLogger:
    """Scalars to ``<run>/tb`` (``torch.utils.tensorboard.SummaryWriter``)."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """Scalars to a Weights & Biases run (``wandb`` imported here, so it stays an optional extra).

    Args:
        out_dir: the run folder: W&B files go to ``out_dir/wandb``, the run id to ``out_dir/wandb_id.txt``.
        config: the resolved training config (shown in the W&B UI).
    """

    def __init__(self, out_dir: str | Path, config: Mapping[str, Any] | None = None):
        try:
            import wandb
        except ImportError:
            raise ValueError("run.loggers: 'wandb' is not installed; pip install wandb (WANDB_MODE=offline logs "
                             "without network), or remove wandb from run.loggers") from None
        out = Path(out_dir)
        id_file = out / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "flowcredit"), name=out.name, dir=str(out),
                              id=run_id, resume="allow", config=dict(config or {}))
        id_file.write_text(run_id + "\n")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def check_logger_names(names: Sequence[str] | None) -> None:
    """ValueError (one line) for an unknown name in ``run.loggers``; called before the run folder is written."""
    unknown = [n for n in (names or []) if n not in KNOWN]
    if unknown:
        raise ValueError(f"run.loggers: unknown logger {unknown[0]!r}; choose from {', '.join(KNOWN)}")
    if "wandb" in (names or []):
        import importlib.util
        import sys

        if "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None:
            raise ValueError("run.loggers: 'wandb' is not installed; pip install wandb, or remove it from run.loggers")


def build_loggers(
    names: Sequence[str] | None, out_dir: str | Path, config: Mapping[str, Any] | None = None
) -> list[Logger]:
    """The loggers of ``run.loggers`` for run folder ``out_dir``.

    Args:
        names: logger names (``tensorboard``, ``wandb``); None = the default ``[tensorboard]``, skipped if tensorboard
            is not installed (metrics.jsonl is always written).
        out_dir: the run folder.
        config: the resolved config as a dict, for loggers that record it (W&B).

    Raises:
        ValueError: (one line) an unknown name, or a named logger whose package is missing (with the pip command).
    """
    explicit = names is not None
    wanted = list(DEFAULT if names is None else names)
    unknown = [n for n in wanted if n not in KNOWN]
    if unknown:
        raise ValueError(f"run.loggers: unknown logger {unknown[0]!r}; choose from {', '.join(KNOWN)}")
    out: list[Logger] = []
    for name in dict.fromkeys(wanted):  # each once, in the given order
        if name == "tensorboard":
            try:
                out.append(TensorBoardLogger(Path(out_dir) / "tb"))
            except Exception:  # noqa: BLE001 - the default logger is best effort; a named one must work
                if explicit:
                    raise ValueError("run.loggers: 'tensorboard' is not installed; pip install tensorboard, or remove "
                                     "it from run.loggers (metrics.jsonl is always written)") from None
        else:
            out.append(WandbLogger(out_dir, config))
    return out


def write_metrics(metrics_f, loggers: list, iteration: int, stats: dict[str, Any]) -> None:
    """One metrics.jsonl line (every stat not starting with "_") and its scalars to every logger."""
    rec = {"iteration": iteration, **{k: v for k, v in stats.items() if not k.startswith("_")}}
    metrics_f.write(json.dumps(rec) + "\n")
    metrics_f.flush()
    if loggers:
        scalars = scalars_of(rec)  # finite numbers + seconds/<phase>
        for logger in loggers:
            logger.log_scalars(iteration, scalars)


def save_grid(images, prompts: list[str], group_size: int, grids_dir: Path, iteration: int) -> None:
    """`grids/iterNNNNN.png`: one row per prompt group (G samples), its prompt as the row's caption; the prompts
    also go to `grids/iterNNNNN.txt`. images: (B, 3, H, W) in [0, 1], group-major like `prompts` (B,); a video
    model's frames (B, F, 3, H, W) show each clip's first frame."""
    from ..eval.evaluate import caption_grid, first_frames, save_png
    from ..types import to_uint8_hwc

    u8 = to_uint8_hwc(first_frames(images)).numpy()
    save_png(caption_grid(u8, list(prompts), ncol=group_size, scale=3), grids_dir / f"iter{iteration:05d}.png")
    (grids_dir / f"iter{iteration:05d}.txt").write_text("\n".join(prompts[::group_size]) + "\n")
