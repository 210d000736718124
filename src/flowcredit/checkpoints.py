"""Checkpoints that cannot run code and survive kill -9 and torn disks: safetensors + JSON, atomic, checksummed.

A checkpoint is a folder ``checkpoints/iterNNNNNN/`` with three files:

    tensors.safetensors   every tensor of the state (weights, optimizer moments, EMA, RNG byte states, credit state)
    state.json            everything else: the nested structure with references to the tensors, ints/floats/strings,
                          numpy RNG states, optimizer hyper-parameters (``flatten`` / ``unflatten`` below)
    manifest.json         format, version, iteration and the size + sha256 of the two files above

Neither format can execute code when read (safetensors is a JSON header + raw bytes; JSON is data), so a checkpoint
from anywhere is safe to load. Old pickle checkpoints (``iterNNNNNN.pt``, ``state.pt``) are refused with a message;
``flowcredit convert --trust OLD.pt`` rewrites a trusted one (``trainer/convert.py``: torch's restricted unpickler,
``weights_only=True``, with only numpy's array reconstruction allowed, so even then no code in the file runs).

The write order makes every crash point safe (the rename is the commit):

    1. tensors + state → ``iterNNNNNN.tmp/``, each flushed + fsynced      (crash: a stray .tmp, ignored, removed later)
    2. sha256 of both → ``iterNNNNNN.tmp/manifest.json``, fsync           (crash: same)
    3. rename ``iterNNNNNN.tmp`` → ``iterNNNNNN``; fsync the folder       (now the checkpoint counts)
    4. older checkpoints beyond ``keep`` are deleted                       (only after the new one is complete)

``find_latest`` walks from the newest checkpoint down and returns the first that verifies; a damaged one (size or
checksum differs from its manifest, missing or unreadable manifest, a pickle ``.pt``) is skipped with a warning that
names it and the one used instead. If checkpoints exist but none is intact, it raises ``CheckpointError``: a run never
restarts from scratch silently. An interrupted write (only a ``.tmp`` folder) never counted; it is reported and
ignored.

What goes INTO a checkpoint (RNG states, model/optimizer/EMA states gathered under FSDP) is `trainer/state.py`.
Checkpoints do not depend on the layout. Under FSDP (``dist.fsdp``) the model, optimizer and EMA states are gathered
to full tensors on rank 0 (``model_state``, ``optimizer_state``, ``full_tensors``), in the same layout as an unsharded
run, and sharded again on load (``load_model_state``, ``load_optimizer_state``, ``shard_like``), so a checkpoint moves
between FSDP and plain runs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "flowcredit-checkpoint"
FORMAT_VERSION = 2
TENSORS = "tensors.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
FILES = (TENSORS, STATE)
_CHUNK = 1 << 22
_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__items__", "__bytes__", "__float__")


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message is one line naming the file and what to do."""


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
    """The manifest of checkpoint folder ``path``."""
    return Path(path) / MANIFEST


def legacy_hint(path: Path) -> str:
    """The one-line refusal of a pickle checkpoint, with the command that converts a trusted one."""
    return (
        f"'{path}' is a pickle checkpoint (the format before safetensors); pickles can run code when loaded, so "
        f"flowcredit does not read them. If you trust its origin, convert it: flowcredit convert --trust {path}"
    )


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


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- nested state ⇄ (tensors, JSON)
def flatten(state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state into the tensors (for safetensors) and a JSON-able skeleton that references them.

    Plain JSON values (str, int, bool, None, finite float, lists, dicts with str keys) stay as they are; the rest is
    tagged with a one-key dict: ``{"__tensor__": name}`` (the tensor, moved to the CPU, is ``tensors[name]``; name =
    its path in the tree, e.g. ``optimizer/state/0/exp_avg``), ``{"__ndarray__": [...], "dtype", "shape"}`` (numpy
    RNG states), ``{"__tuple__": [...]}``, ``{"__items__": [[key, value], ...]}`` (dicts with non-str keys such as the
    optimizer's parameter indices), ``{"__bytes__": base64}``, ``{"__float__": "nan" | "inf" | "-inf"}``. Anything
    else raises TypeError naming its path: nothing is ever pickled.

    Returns:
        (tensors: name → contiguous CPU tensor of any shape/dtype, skeleton).
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def tensor_ref(t: torch.Tensor, path: str) -> dict[str, str]:
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and (ptr in storages or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            t = t.clone()  # safetensors refuses tensors that share memory; views get their own copy
        if t.numel():
            storages.add(t.untyped_storage().data_ptr())
        name, k = path or "tensor", 1
        while name in tensors:
            k += 1
            name = f"{path}#{k}"
        tensors[name] = t
        return {"__tensor__": name}

    def enc(x: Any, path: str) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, torch.Tensor):
            return tensor_ref(x, path)
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "biuf":
                raise TypeError(f"checkpoint state '{path}': numpy array of dtype {x.dtype} cannot be stored")
            return {"__ndarray__": x.tolist(), "dtype": str(x.dtype), "shape": list(x.shape)}
        if isinstance(x, np.generic):
            x = x.item()
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"__float__": repr(x)}
        if isinstance(x, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(x)).decode("ascii")}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(x)]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v, f"{path}/{k}" if path else k) for k, v in x.items()}
            return {"__items__": [[enc(k, f"{path}/key"), enc(v, f"{path}/{k}")] for k, v in x.items()]}
        raise TypeError(
            f"checkpoint state '{path}': a {type(x).__name__} cannot be stored (tensors, numbers, strings, "
            f"lists, tuples, dicts and numpy arrays only)"
        )

    return tensors, enc(state, "")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor], source: str = "state.json") -> Any:
    """Inverse of ``flatten``. Raises CheckpointError naming ``source`` for a reference or tag that is not valid."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"'{source}' is not a valid flowcredit checkpoint state: {why}")

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        tag = next((t for t in _TAGS if t in x), None)
        if tag is None:
            return {k: dec(v) for k, v in x.items()}
        v = x[tag]
        try:
            if tag == "__tensor__":
                if v not in tensors:
                    raise bad(f"tensor '{v}' is not in {TENSORS}")
                return tensors[v]
            if tag == "__ndarray__":
                return np.asarray(v, dtype=np.dtype(x["dtype"])).reshape(x["shape"])
            if tag == "__tuple__":
                return tuple(dec(e) for e in v)
            if tag == "__items__":
                return {_hashable(dec(k)): dec(e) for k, e in v}
            if tag == "__bytes__":
                return base64.b64decode(v, validate=True)
            if v not in ("nan", "inf", "-inf"):
                raise bad(f"float tag {v!r}")
            return float(v)
        except CheckpointError:
            raise
        except (TypeError, ValueError, KeyError) as e:
            raise bad(f"{tag} entry ({e})") from None

    return dec(skeleton)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(e) for e in k) if isinstance(k, (list, tuple)) else k


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("flowcredit") != FORMAT:
                raise CheckpointError(f"'{path}' is a safetensors file but not a flowcredit checkpoint's tensors")
            return {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise CheckpointError(f"'{path}' is not a valid safetensors file ({e}); the checkpoint is damaged") from None
    except OSError as e:
        raise CheckpointError(f"'{path}' cannot be read ({e.strerror or e})") from None


# ---------------------------------------------------------------------------------------------- write / verify / read
def is_checkpoint_dir(path: Path) -> bool:
    """True for a folder that looks like a checkpoint (has a manifest or a state file)."""
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).exists() or (p / STATE).exists() or (p / TENSORS).exists())


def verify(path: Path) -> str | None:
    """None when checkpoint folder ``path`` matches its manifest; else a short description of the problem."""
    path = Path(path)
    if path.suffix == ".pt":
        return "a pickle .pt (old format; not read: pickles can run code)" if path.exists() else "file missing"
    if path.is_file():
        return "a file, not a checkpoint folder"
    if not path.exists():
        return "folder missing"
    man = path / MANIFEST
    if not man.exists():
        return f"no {MANIFEST} (not a complete checkpoint)"
    try:
        m = json.loads(man.read_text())
        if m.get("format") != FORMAT:
            return f"{MANIFEST} is not a flowcredit checkpoint manifest"
        if int(m.get("version", 0)) > FORMAT_VERSION:
            return f"written by a newer flowcredit (format version {m['version']}); upgrade flowcredit"
        files = {name: (int(m["files"][name]["bytes"]), str(m["files"][name]["sha256"])) for name in FILES}
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, OSError) as e:  # Overflow: version 1e999
        return f"unreadable manifest ({type(e).__name__}: {e})"
    for name, (size, digest) in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        actual = f.stat().st_size
        if actual != size:
            return f"{name}: {actual} bytes on disk, manifest says {size} (truncated)"
        if sha256_file(f) != digest:
            return f"{name}: sha256 differs from the manifest (corrupt)"
    return None


_NAME = re.compile(r"^([A-Za-z_]+)(\d+)$")


def _prefix(path: Path) -> str | None:
    """``iter`` of ``iter000012``; None for a name without the prefix + number pattern (never pruned)."""
    m = _NAME.match(Path(path).name)
    return m.group(1) if m else None


def save(
    state: dict[str, Any], path: Path, *, iteration: int, keep: int = 2, fault: Callable[[str], None] | None = None
) -> Path:
    """Write ``state`` as checkpoint folder ``path`` (e.g. ``checkpoints/iter000012``) with the protocol above; skip
    if an intact checkpoint is already there; then keep the ``keep`` newest of its prefix (0: delete nothing)."""
    path = Path(path)
    prefix = _prefix(path)
    d = path.parent
    d.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and verify(path) is None:
        return path
    tensors, skeleton = flatten(state)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    tmp.mkdir()
    from safetensors.torch import save_file

    save_file(tensors, str(tmp / TENSORS), metadata={"format": "pt", "flowcredit": FORMAT})
    _fsync_file(tmp / TENSORS)
    doc = {"format": FORMAT, "version": FORMAT_VERSION, "iteration": int(iteration), "state": skeleton}
    with open(tmp / STATE, "w") as f:
        json.dump(doc, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    if fault is not None:
        fault("checkpoint")  # test hook: data written, no manifest yet
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "iteration": int(iteration),
        "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)} for name in FILES},
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    _write_atomic(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    _fsync_dir(tmp)
    if fault is not None:
        fault("checkpoint_manifest")  # test hook: complete, not yet renamed into place
    if path.exists():  # a damaged checkpoint of the same iteration (it did not verify): replaced whole
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    os.replace(tmp, path)
    _fsync_dir(d)
    if prefix is not None:
        prune(d, keep, prefix, upto=_number(path))
    return path


def _number(path: Path) -> int | None:
    """12 of ``iter000012``; None for a name without the prefix + number pattern."""
    m = _NAME.match(Path(path).name)
    return int(m.group(2)) if m else None


def _checkpoints(d: Path, prefix: str) -> list[Path]:
    """Checkpoint folders, old pickle files and anything else named like a checkpoint (a file ``iter000012``: reported
    as damaged, never read) of ``prefix`` in ``d``, newest first (a folder before a .pt of the same number, so a
    converted checkpoint wins over its original)."""
    found = []
    for p in Path(d).iterdir() if Path(d).is_dir() else []:
        m = _NAME.match(p.name[:-3]) if p.name.endswith(".pt") and p.is_file() else _NAME.match(p.name)
        if m and m.group(1) == prefix:
            found.append((int(m.group(2)), p.is_dir(), p))
    return [p for *_, p in sorted(found, key=lambda e: (e[0], e[1]), reverse=True)]


def prune(d: Path, keep: int, prefix: str = "iter", upto: int | None = None) -> None:
    """Delete all but the ``keep`` newest checkpoint folders of ``prefix`` and every stray temp file/folder. Old pickle
    files are never deleted (they may be the only copy of a run). With ``upto`` (the number just written) folders
    numbered above it are neither counted nor deleted: a resumed run got past them because they are unusable, and
    counting them would delete the intact ones it just wrote or resumed from."""
    for t in Path(d).glob("*.tmp"):
        shutil.rmtree(t, ignore_errors=True) if t.is_dir() else t.unlink(missing_ok=True)
    if keep <= 0:
        return
    folders = [p for p in _checkpoints(d, prefix) if p.is_dir() and (upto is None or (_number(p) or 0) <= upto)]
    for old in folders[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(d: Path, *, warn: bool = True, prefix: str = "iter") -> Path | None:
    """The newest intact checkpoint in ``d``; None when there is none at all.

    Damaged ones are skipped with a warning naming each and the one used. Raises CheckpointError (one line) when
    checkpoints exist but none is intact.
    """
    d = Path(d)
    if warn:
        for t in sorted(d.glob(f"{prefix}*.tmp")):
            warnings.warn(f"checkpoint write {t} was interrupted before it completed; ignored", stacklevel=2)
    skipped: list[tuple[Path, str]] = []
    for path in _checkpoints(d, prefix):
        problem = verify(path)
        if problem is None:
            if warn:
                for bad, why in skipped:
                    warnings.warn(
                        f"checkpoint {bad} is unusable: {why}; falling back to the newest intact one: {path}",
                        stacklevel=2,
                    )
            return path
        skipped.append((path, problem))
    if not skipped:
        return None
    hint = ""
    if any(p.suffix == ".pt" for p, _ in skipped):
        hint = "; convert a trusted .pt with: flowcredit convert --trust OLD.pt"
    raise CheckpointError(
        f"no intact checkpoint in {d}: "
        + "; ".join(f"{p.name}: {why}" for p, why in skipped)
        + hint
        + "; restore one, or use a new run folder to start from scratch"
    )


def resolve(path: str | Path) -> Path:
    """A user-given checkpoint: a checkpoint folder (itself) or a run folder (its newest intact checkpoint).

    Raises:
        CheckpointError: a pickle ``.pt`` (with the convert command), or no intact checkpoint in the run folder.
        FileNotFoundError: nothing there, or a run folder without checkpoints.
    """
    p = Path(path)
    if p.suffix == ".pt" and p.is_file():
        raise CheckpointError(legacy_hint(p))
    if p.is_dir() and (p / "checkpoints").is_dir():
        ck = find_latest(p / "checkpoints")
        if ck is None:
            raise FileNotFoundError(f"run folder '{p}' has no checkpoints yet (checkpoints/iterNNNNNN/)")
        return ck
    if is_checkpoint_dir(p):
        return p
    if not p.exists():
        raise FileNotFoundError(f"checkpoint '{p}' not found; give a run folder or a checkpoints/iterNNNNNN folder")
    raise CheckpointError(
        f"'{p}' is not a flowcredit checkpoint (no {MANIFEST}); give a run folder or a checkpoints/iterNNNNNN folder"
    )


def load(path: Path, *, verify_checksums: bool = True) -> dict[str, Any]:
    """Read checkpoint folder ``path`` back into the nested state ``save`` wrote (tensors on the CPU).

    Raises CheckpointError (one line naming the file) for a pickle .pt, a damaged checkpoint, bad JSON, a missing
    tensor, or a file that is not what it claims.
    """
    path = Path(path)
    if path.suffix == ".pt" and path.is_file():
        raise CheckpointError(legacy_hint(path))
    if not path.exists():
        raise FileNotFoundError(f"checkpoint '{path}' not found")
    if not path.is_dir():
        raise CheckpointError(
            f"'{path}' is not a flowcredit checkpoint folder (tensors.safetensors + state.json + manifest.json)"
        )
    if verify_checksums:
        problem = verify(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint '{path}' is unusable: {problem}")
    try:
        doc = json.loads((path / STATE).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"'{path / STATE}' is not valid JSON ({e}); the checkpoint is damaged") from None
    except OSError as e:
        raise CheckpointError(f"'{path / STATE}' cannot be read ({e.strerror or e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "state" not in doc:
        raise CheckpointError(f"'{path / STATE}' is not a flowcredit checkpoint state (no format '{FORMAT}')")
    if int(doc.get("version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"'{path}' was written by a newer flowcredit (format version {doc['version']}); upgrade flowcredit"
        )
    state = unflatten(doc["state"], _read_tensors(path / TENSORS), source=str(path / STATE))
    if not isinstance(state, dict):
        raise CheckpointError(f"'{path / STATE}' holds a {type(state).__name__}, not a checkpoint dict")
    return state


def truncate_jsonl(path: Path, iteration: int) -> int:
    """Keep the records of ``path`` with ``iteration`` <= the given one (a resumed run redoes the later ones, so no
    line is ever duplicated); a torn last line is dropped. Returns the number of lines removed."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():  # a line of binary junk is dropped like a torn one
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
