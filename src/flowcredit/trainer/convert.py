"""`flowcredit convert --trust OLD.pt [NEW]`: rewrite a trusted legacy pickle checkpoint as a safe folder.

The only place that reads a pickle, and even here through torch's restricted unpickler (`weights_only=True`) with
only numpy's array reconstruction allowed beyond torch's own types, so no code in the file runs; the result is a
checkpoint folder in the format of `flowcredit/checkpoints.py` (safetensors + JSON + sha256 manifest).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..checkpoints import CheckpointError, save


def _legacy_globals() -> list:
    """The only globals the old pickle checkpoints need beyond torch's own: numpy arrays (the numpy RNG state)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return [_reconstruct, np.ndarray, np.dtype, *{type(np.dtype(c)) for c in "?bBhHiIlLqQefdg"}]


def default_converted_path(old: Path) -> Path:
    """Where ``flowcredit convert`` writes by default: ``iterNNNNNN.pt`` → ``iterNNNNNN`` beside it."""
    old = Path(old)
    return old.with_suffix("")


def convert_legacy(old: str | Path, new: str | Path | None = None) -> Path:
    """Rewrite an old pickle checkpoint (``torch.save`` of a dict) as a checkpoint folder. The only pickle reader in
    flowcredit; the CLI calls it only with ``--trust``. It still uses torch's restricted unpickler
    (``weights_only=True``) with numpy's array reconstruction as the only extra global, so a file that needs anything
    else (a payload) is refused, never run.

    Args:
        old: the ``.pt`` file (a trainer ``iterNNNNNN.pt`` or a pretraining ``state.pt``).
        new: the checkpoint folder to write (default: ``iterNNNNNN.pt`` → ``iterNNNNNN``; ``state.pt`` →
            ``checkpoints/stepNNNNNN`` beside it). Must not exist.

    Returns:
        The new checkpoint folder.
    """
    old = Path(old)
    if not old.is_file():
        raise FileNotFoundError(f"'{old}' not found")
    try:
        with torch.serialization.safe_globals(_legacy_globals()):
            st = torch.load(old, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure of the restricted unpickler is one line
        try:
            allowed = {f"{g.__module__}.{g.__qualname__}" for g in _legacy_globals()}
            extra = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(old) if g not in allowed]
        except Exception:  # noqa: BLE001 - not even a torch zip file
            extra = []
        if extra:
            raise CheckpointError(
                f"'{old}' needs {', '.join(extra)} to load, which a flowcredit checkpoint never needs "
                f"(it may carry a payload); not converted"
            ) from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"'{old}' is not a readable torch checkpoint ({first}); not converted") from None
    if not isinstance(st, dict):
        raise CheckpointError(f"'{old}' holds a {type(st).__name__}, not a flowcredit checkpoint dict; not converted")
    if new is None:
        new = (
            old.parent / "checkpoints" / f"step{int(st.get('step', 0)):06d}"
            if old.name == "state.pt"
            else default_converted_path(old)
        )
    new = Path(new)
    if new.exists():
        raise CheckpointError(f"'{new}' already exists; give a new folder as the second argument")
    iteration = int(st.get("iteration", st.get("step", 0)) or 0)
    try:
        return save(st, new, iteration=iteration, keep=0)
    except TypeError as e:
        raise CheckpointError(f"'{old}': {e}; not converted") from None
