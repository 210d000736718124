"""The state of a run and its run folder: `TrainState` is everything a checkpoint holds, saved and loaded exactly.

`TrainState` records what changes as a run trains — iteration, model weights, optimizer, EMA weights, the moving KL
reference's and the soft-updated π_old's weights (optim.kl_reference=ema, nft old_policy=soft), credit state, every
RNG of every rank, prompt-sampler position, fault counters and the harness objects' states (time-budget
measurements, hacking-guard gold/alarm history, the decay ramps' step counts) — and nothing that config.yaml
rebuilds. Every checkpoint carries `state_version` (`STATE_VERSION`; the folder format has its own version,
`checkpoints.FORMAT_VERSION`); a checkpoint of another state version is refused with one line naming it. The file
format is `flowcredit/checkpoints.py`: safetensors + JSON folders with a sha256 manifest, never pickle. The
run-folder functions below open, resume and write a run's folder.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import checkpoints as checkpoint
from .faults import TrainingError, inject_point

if TYPE_CHECKING:
    from ..config.schema import TrainConfig
    from .data import PromptSampler
    from .distributed import Dist
    from .faults import NonFiniteGuard
    from .harness import EMAWeights, HackingGuard, MovingReference, SoftOldPolicy, TimeBudget

# 1: checkpoints written before the version field (they also held an unused generator state, ignored on load);
# 2: this layout. Raise it whenever `TrainState.state_dict` changes incompatibly, and read the older ones if possible.
STATE_VERSION = 2
READABLE_STATE_VERSIONS = (1, 2)


@dataclasses.dataclass
class TrainState:
    """Everything of a run that a checkpoint must hold to continue it exactly (module docstring); the objects are
    shared with the trainer, which updates them as it trains."""

    model: Any  # the FlowModel being trained (an nn.Module with .net and .cfg)
    model_name: str  # model.name of the config ("tiny" also saves its LoRA layout)
    opt: Any  # torch.optim.Optimizer (or the offloaded optimizer of trainer/memory.py)
    trainable: list[Any]  # the trained nn.Parameters (DTensor shards under FSDP)
    trainable_names: list[str]
    dist: Dist
    prompt_sampler: PromptSampler
    nonfinite: NonFiniteGuard
    budget: TimeBudget
    ema_weights: EMAWeights
    guard: HackingGuard | None = None
    moving_ref: MovingReference | None = None  # optim.kl_reference=ema: the moving KL reference
    old_policy: SoftOldPolicy | None = None  # nft old_policy=soft: DiffusionNFT's soft-updated π_old
    iteration: int = 0
    credit_state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's contents (collective: every rank calls it; under FSDP rank 0 holds the full tensors)."""
        ema = self.ema_weights.shadow
        return {
            "state_version": STATE_VERSION,
            "iteration": self.iteration,
            # under FSDP gathered to full tensors on rank 0 (collectives), the layout of an unsharded run
            "model": model_state(self.model.net),
            "optimizer": optimizer_state(self.model.net, self.opt, self.trainable_names),
            "ema": None if ema is None else self._named_full(ema),
            # optim.kl_reference=ema: the reference moves with the run, so an exact resume needs it
            "kl_reference": self._named_full(self.moving_ref.tensors()) if self.moving_ref is not None else None,
            # nft old_policy=soft: π_old samples the next rollout and gives v_old, so an exact resume needs it
            "old_policy": self._named_full(self.old_policy.shadow) if self.old_policy is not None else None,
            "model_config": dataclasses.asdict(self.model.cfg),
            "lora": getattr(self.model, "lora", None) if self.model_name == "tiny" else None,  # tiny: the adapter
            "credit_state": self.credit_state,
            "global_torch_rng": torch.get_rng_state(),
            "rng_per_rank": self.dist.gather_object(rng_states()),  # every RNG of every rank (collective)
            "prompt_sampler": self.prompt_sampler.state_dict(),
            "faults": self.nonfinite.state_dict(),
            "harness": self._harness_state(),
            "world_size": self.dist.world_size,
        }

    def load_state_dict(self, st: dict[str, Any], source: Path | str = "the checkpoint") -> None:
        """Restore every state from `st` (`state_dict()`'s layout, any process count); TrainingError (one line) for
        a state version this flowcredit cannot read."""
        version = int(st.get("state_version", 1))
        if version not in READABLE_STATE_VERSIONS:
            raise TrainingError(
                f"{source}: checkpoint state version {version}; this flowcredit reads versions "
                f"{', '.join(map(str, READABLE_STATE_VERSIONS))} (version {STATE_VERSION} is written): resume it with "
                "the flowcredit that wrote it, or start a new run folder"
            )
        names = self.trainable_names
        load_model_state(self.model.net, st["model"])  # FSDP: each rank keeps its shard
        load_optimizer_state(self.model.net, self.opt, names, st["optimizer"])
        if st["ema"] is not None:  # under FSDP the EMA is sharded like the weights
            self.ema_weights.shadow = shard_like([st["ema"][n] for n in names], self.trainable)
        else:
            self.ema_weights.shadow = None
        if self.moving_ref is not None and st.get("kl_reference") is not None:
            self.moving_ref.load(shard_like([st["kl_reference"][n] for n in names], self.moving_ref.tensors()))
        if self.old_policy is not None and st.get("old_policy") is not None:
            self.old_policy.shadow = shard_like([st["old_policy"][n] for n in names], self.trainable)
        self.credit_state = st["credit_state"]
        torch.set_rng_state(st["global_torch_rng"])
        if st.get("rng_per_rank"):
            set_rng_states(st["rng_per_rank"][min(self.dist.rank, len(st["rng_per_rank"]) - 1)])
        self.prompt_sampler.load_state_dict(st["prompt_sampler"])
        self.nonfinite.load_state_dict(st.get("faults", {}))
        self._load_harness_state(st.get("harness", {}))
        self.iteration = st["iteration"]

    def _harness_state(self) -> dict[str, Any]:
        """state_dict of every stateful harness object (the EMA weights travel as tensors under "ema")."""
        st: dict[str, Any] = {"budget": self.budget.state_dict()}
        for key, obj in (("guard", self.guard), ("kl_reference", self.moving_ref), ("old_policy", self.old_policy)):
            if obj is not None:
                st[key] = obj.state_dict()
        return st

    def _load_harness_state(self, st: dict[str, Any]) -> None:
        for key, obj in (("budget", self.budget), ("guard", self.guard), ("kl_reference", self.moving_ref),
                         ("old_policy", self.old_policy)):
            if obj is not None and key in st:
                obj.load_state_dict(st[key])

    def _named_full(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Tensors in the order of `trainable` by parameter name; under FSDP (sharded like the weights) gathered to
        rank 0 (collective; None on the other ranks)."""
        if not self.dist.fsdp:
            return dict(zip(self.trainable_names, tensors))
        full = full_tensors(tensors, keep=self.dist.is_main)
        return dict(zip(self.trainable_names, full)) if full is not None else None


# ---------------------------------------------------------------------------------------------------------------
# The run folder: config.yaml, checkpoints/, metrics.jsonl and the loggers
# ---------------------------------------------------------------------------------------------------------------


def open_run_folder(out: Path, cfg: TrainConfig, state: TrainState) -> tuple[Any, list[Any]]:
    """Make the run folder, write the resolved config, resume `state` from the newest intact checkpoint, and open
    metrics.jsonl and the loggers (rank 0; (None, []) elsewhere). A folder whose checkpoints are all damaged stays
    as it is (TrainingError)."""
    from ..config.load import dump_yaml
    from .loggers import build_loggers

    dist = state.dist
    ckpt = latest_checkpoint(out, dist.is_main)  # before anything is written
    if ckpt is None:
        refuse_lost_checkpoints(out, cfg)
    if dist.is_main:
        for d in (out, out / "checkpoints", out / "grids"):
            d.mkdir(parents=True, exist_ok=True)
        # the resolved config; a resumed run keeps its original config.yaml and records the new one beside it
        exists = (out / "config.yaml").exists()
        dump_yaml(cfg, out / ("config.resumed.yaml" if exists else "config.yaml"))
    dist.barrier()
    if ckpt is not None:
        load_checkpoint(ckpt, state)
        if dist.is_main:
            print(f"resuming from {ckpt} (iteration {state.iteration})", file=sys.stderr, flush=True)
    if not dist.is_main:
        return None, []
    for log_file in ("metrics.jsonl", "eval_curve.jsonl", "gold.jsonl"):  # a resumed run redoes later iterations
        checkpoint.truncate_jsonl(out / log_file, state.iteration if ckpt is not None else -1)
    metrics_f = open(out / "metrics.jsonl", "a")
    try:  # default [tensorboard] is best effort: metrics.jsonl is the record of truth
        loggers = build_loggers(cfg.run.loggers, out, dataclasses.asdict(cfg))
    except ValueError as e:  # a named logger that is unknown or not installed: one line with the pip command
        metrics_f.close()
        raise TrainingError(str(e)) from None
    return metrics_f, loggers


def save_checkpoint(out: Path, state: TrainState) -> Path:
    """Rank 0 writes every state atomically as `checkpoints/iterNNNNNN/` (tensors.safetensors + state.json +
    manifest.json with sha256, `checkpoint.save`); keeps the two newest. Collective: every rank calls it."""
    st = state.state_dict()  # every rank takes part (RNG gather, FSDP gathers)
    path = out / "checkpoints" / f"iter{state.iteration:06d}"
    if state.dist.is_main:
        it = state.iteration
        checkpoint.save(st, path, iteration=it, keep=2, fault=lambda phase: inject_point(phase, it))
    return path


def load_checkpoint(path: Path, state: TrainState) -> None:
    """Restore `state` from checkpoint folder `path` (verified; never unpickles)."""
    try:
        st = checkpoint.load(path)
    except checkpoint.CheckpointError as e:
        raise TrainingError(str(e)) from None
    state.load_state_dict(st, path)


def latest_checkpoint(out: Path, warn: bool) -> Path | None:
    """The newest checkpoint that verifies; a damaged one is skipped with a warning naming it and the one used.
    None for a fresh run folder; TrainingError (one line) when checkpoints exist but none is intact."""
    try:
        return checkpoint.find_latest(out / "checkpoints", warn=warn)
    except checkpoint.CheckpointError as e:
        raise TrainingError(f"cannot resume {out}: {e}") from None


def refuse_lost_checkpoints(out: Path, cfg: TrainConfig) -> None:
    """A run folder without a checkpoint starts from iteration 0, which is right only if none was written yet: if
    metrics.jsonl logged an iteration after the first checkpoint's, the checkpoints were lost, and starting over
    would silently redo (and overwrite the record of) the whole run. TrainingError (one line) then."""
    every, total = cfg.run.checkpoint_every, cfg.run.iterations
    first = min(every, total) if every else total  # the first checkpoint is written at the end of this iteration
    logged = last_logged_iteration(out / "metrics.jsonl")
    if logged > first:
        raise TrainingError(
            f"cannot resume {out}: metrics.jsonl logged iterations up to {logged}, but there is no "
            f"checkpoint in {out / 'checkpoints'} (the first one is written after iteration {first}); "
            "restore the checkpoints, or use a new run folder to start from scratch"
        )


def last_logged_iteration(path: Path) -> int:
    """The largest `iteration` of the records in a metrics.jsonl (0 when there is none; unreadable lines are
    skipped)."""
    last = 0
    if not path.is_file():
        return last
    for line in path.read_text(errors="replace").splitlines():
        try:
            last = max(last, int(json.loads(line)["iteration"]))
        except (ValueError, KeyError, TypeError, OverflowError):
            continue
    return last


# ---------------------------------------------------------------------------------------------------------------
# The pieces of the state: every RNG, and model / optimizer / EMA states in the unsharded layout (FSDP gathered)
# ---------------------------------------------------------------------------------------------------------------


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

    return cast(dict[str, torch.Tensor], get_model_state_dict(net, options=_full_options()))


def load_model_state(net: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full state dict (from any layout) into ``net``; an FSDP-sharded network keeps its rank's shard of each
    tensor. Every rank passes the full dict (every rank reads the checkpoint)."""
    if not _is_fsdp(net):
        net.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(net, cast(Any, state), options=StateDictOptions(full_state_dict=True))


def optimizer_state(net: torch.nn.Module, opt, names: Sequence[str]) -> dict[str, Any]:
    """``opt.state_dict()``; under FSDP the full optimizer state on rank 0 ({} elsewhere), converted from the
    parameter-name keys of ``get_optimizer_state_dict`` to the plain layout (keys = indices into ``names``, the
    optimizer's parameter order), so an FSDP checkpoint resumes unsharded and vice versa. Collective under FSDP."""
    if not _is_fsdp(net):
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd: Any = get_optimizer_state_dict(net, opt, options=_full_options())
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

    osd: Any = {
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

    out: list[torch.Tensor] = []
    for t, p in zip(tensors, params):
        if isinstance(p, DTensor):
            out.append(distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None))
        else:
            out.append(t.to(p.device))
    return out
