"""Shared by the command-line modules: one-line errors and warnings, device checks."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

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
