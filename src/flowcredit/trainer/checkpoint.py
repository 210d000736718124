"""Checkpoints that survive kill -9 and torn disks: atomic writes, a manifest with a sha256, and fallback.

A checkpoint ``checkpoints/iterNNNNNN.pt`` is valid iff its manifest ``iterNNNNNN.json`` exists and records the
file's size and sha256. The write order makes every crash point safe:

    1. torch.save → ``iterNNNNNN.pt.tmp``, flush + fsync          (crash: a stray .tmp, ignored and removed later)
    2. sha256 of the .tmp; rename → ``iterNNNNNN.pt``              (crash: a .pt without manifest → not trusted)
    3. manifest → ``.json.tmp``, fsync, rename; fsync the folder  (now the checkpoint counts)
    4. older checkpoints beyond ``keep`` are deleted              (only after the new one is complete)

``find_latest`` walks from the newest checkpoint down and returns the first that verifies; a truncated or corrupt
one (size or checksum differs from the manifest, unreadable manifest, no manifest) is skipped with a warning. A run
folder written before manifests existed (no .json at all) is accepted unverified, with a warning.

Checkpoints do not depend on the layout. Under FSDP (``dist.fsdp``) the model, optimizer and EMA states are gathered
to full tensors on rank 0 (``model_state``, ``optimizer_state``, ``full_tensors``), in the same layout as an unsharded
run, and sharded again on load (``load_model_state``, ``load_optimizer_state``, ``shard_like``), so a checkpoint moves
between FSDP and plain runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

FORMAT_VERSION = 1
_CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def manifest_path(path: Path) -> Path:
    return Path(path).with_suffix(".json")


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def verify(path: Path) -> str | None:
    """None when ``path`` matches its manifest; else a short description of the problem."""
    path = Path(path)
    man = manifest_path(path)
    if not path.exists():
        return "file missing"
    if not man.exists():
        return "no manifest (the write was interrupted)"
    try:
        m = json.loads(man.read_text())
        size, digest = int(m["bytes"]), str(m["sha256"])
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"unreadable manifest ({e})"
    actual = path.stat().st_size
    if actual != size:
        return f"{actual} bytes on disk, manifest says {size} (truncated)"
    if sha256_file(path) != digest:
        return "sha256 differs from the manifest (corrupt)"
    return None


def save(state: dict[str, Any], path: Path, *, iteration: int, keep: int = 2, fault: Callable[[str], None] | None = None) -> Path:
    """Write ``state`` to ``path`` with the protocol above; skip if a valid checkpoint is already there."""
    path = Path(path)
    d = path.parent
    d.mkdir(parents=True, exist_ok=True)
    if path.exists() and verify(path) is None:
        return path
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if fault is not None:
        fault("checkpoint")  # test hook: data written, not yet visible
    digest, size = sha256_file(tmp), tmp.stat().st_size
    man = manifest_path(path)
    if man.exists():
        man.unlink()  # a stale manifest of a corrupt file being replaced must not vouch for the new one mid-write
    os.replace(tmp, path)
    if fault is not None:
        fault("checkpoint_manifest")  # test hook: visible, manifest missing
    manifest = {"format": FORMAT_VERSION, "file": path.name, "iteration": int(iteration), "bytes": size, "sha256": digest,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    _write_atomic(man, (json.dumps(manifest, indent=1) + "\n").encode())
    _fsync_dir(d)
    prune(d, keep)
    return path


def prune(d: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (and their manifests) and stray temp files."""
    for t in d.glob("*.tmp"):
        t.unlink(missing_ok=True)
    for old in sorted(d.glob("iter*.pt"))[:-keep] if keep > 0 else []:
        manifest_path(old).unlink(missing_ok=True)
        old.unlink(missing_ok=True)


def find_latest(d: Path, *, warn: bool = True) -> Path | None:
    """The newest checkpoint in ``d`` that verifies; corrupt/torn ones are skipped with a warning."""
    d = Path(d)
    cks = sorted(d.glob("iter*.pt"), reverse=True)
    legacy = bool(cks) and not any(d.glob("iter*.json"))
    for i, path in enumerate(cks):
        if legacy:
            if warn:
                warnings.warn(f"checkpoint {path} has no manifest (written by an older flowcredit); loading it unverified", stacklevel=2)
            return path
        problem = verify(path)
        if problem is None:
            return path
        if warn:
            nxt = cks[i + 1].name if i + 1 < len(cks) else "none (starting from scratch)"
            warnings.warn(f"checkpoint {path} is unusable: {problem}; falling back to the previous one: {nxt}", stacklevel=2)
    return None


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False, map_location="cpu")


def truncate_jsonl(path: Path, iteration: int) -> int:
    """Keep the records of ``path`` with ``iteration`` <= the given one (a resumed run redoes the later ones, so no
    line is ever duplicated); a torn last line is dropped. Returns the number of lines removed."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            ok = int(rec["iteration"]) <= iteration
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        _write_atomic(path, "".join(x + "\n" for x in keep).encode())
    return dropped


def rng_states() -> dict[str, Any]:
    """Every global RNG of this process: torch (CPU and CUDA), numpy, python."""
    import random

    import numpy as np

    st: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_states(st: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(st["cuda"])
        except (RuntimeError, IndexError):  # a different GPU count: keep the fresh CUDA states
            pass


# ------------------------------------------------------------------------------------------ FSDP: full state dicts
def _is_fsdp(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _full_options():
    # torch.distributed.checkpoint.state_dict: full_state_dict gathers DTensor shards to full tensors; with cpu_offload
    # only rank 0 receives them (the others get {}), so no other rank holds a full copy in memory.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``net.state_dict()``; for an FSDP-sharded network the full state dict on rank 0 (CPU tensors, same keys) and
    {} on the other ranks. Collective under FSDP: every rank calls it."""
    if not _is_fsdp(net):
        return net.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(net, options=_full_options())


def load_model_state(net: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (from any layout) into ``net``; an FSDP-sharded network keeps its rank's shard of each
    tensor. Every rank passes the full dict (every rank reads the checkpoint)."""
    if not _is_fsdp(net):
        net.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(net, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state(net: torch.nn.Module, opt, names: Sequence[str]) -> dict[str, Any]:
    """``opt.state_dict()``; under FSDP the full optimizer state on rank 0 ({} elsewhere), converted from the
    parameter-name keys of ``get_optimizer_state_dict`` to the plain layout (keys = indices into ``names``, the
    optimizer's parameter order), so an FSDP checkpoint resumes unsharded and vice versa. Collective under FSDP."""
    if not _is_fsdp(net):
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(net, opt, options=_full_options())
    if not osd:
        return {}
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[k]: v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]],
    }


def load_optimizer_state(net: torch.nn.Module, opt, names: Sequence[str], state: dict[str, Any]) -> None:
    """Load a plain-layout optimizer state dict (from any layout); under FSDP each rank keeps its shard."""
    if not _is_fsdp(net):
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    osd = {
        "state": {names[int(i)]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(net, opt, osd, options=StateDictOptions(full_state_dict=True))


def full_tensors(tensors: Sequence[torch.Tensor], keep: bool) -> list[torch.Tensor] | None:
    """Full CPU copies of ``tensors`` (e.g. the EMA weights): a DTensor shard is all-gathered (collective, one tensor
    at a time, so a rank never holds more than one full tensor on the device). ``keep``: this rank keeps the copies
    (rank 0); elsewhere returns None."""
    from torch.distributed.tensor import DTensor

    out = []
    for t in tensors:
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out.append(full.detach().to("cpu", copy=True))
    return out if keep else None


def shard_like(tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Full tensors (each the shape of the full parameter) placed like ``params``: a DTensor parameter gets this
    rank's shard (sliced locally: every rank holds the full tensor, so ``src_data_rank=None`` skips communication),
    a plain one the tensor on its device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = []
    for t, p in zip(tensors, params):
        if isinstance(p, DTensor):
            out.append(distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None))
        else:
            out.append(t.to(p.device))
    return out
