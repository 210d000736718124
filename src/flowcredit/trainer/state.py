"""Checkpointing of the trainer: every state of a run, saved atomically and loaded exactly (a mixin of Trainer).

What is saved (`checkpoint_state`): iteration, model weights, optimizer, EMA weights, the moving KL reference's and
the soft-updated π_old's weights (optim.kl_reference=ema, nft old_policy=soft), model config (and the tiny model's
LoRA layout), credit state, every RNG of every rank, prompt-sampler position, fault counters and the harness objects'
states (time-budget measurements, hacking-guard gold/alarm history, the optimizer-step counts of the decay ramps).
The file format is `flowcredit/checkpoints.py`: safetensors + JSON folders with a sha256 manifest, never pickle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import checkpoints as checkpoint
from .faults import inject_point

if TYPE_CHECKING:
    from ..config.schema import TrainConfig
    from .data import PromptSampler
    from .distributed import Dist
    from .faults import NonFiniteGuard
    from .harness import HackingGuard, MovingReference, SoftOldPolicy, TimeBudget


class TrainingError(RuntimeError):
    """A run cannot start or continue; the message is one line saying what to fix."""


class CheckpointMixin:
    """Save/load of a Trainer's full state; expects the attributes set by `Trainer.setup()`."""

    # The host's attributes this mixin reads and writes (annotations only: set by `Trainer.setup()`).
    cfg: TrainConfig
    iteration: int
    model: Any  # the FlowModel being trained (an nn.Module with .net and .cfg)
    opt: Any  # torch.optim.Optimizer (or the offloaded optimizer of trainer/distributed.py)
    trainable: list[Any]  # the trained nn.Parameters (DTensor shards under FSDP)
    trainable_names: list[str]
    device: torch.device
    dist: Dist
    gen: torch.Generator
    credit_state: dict[str, torch.Tensor]
    prompt_sampler: PromptSampler
    nonfinite: NonFiniteGuard
    budget: TimeBudget
    guard_: HackingGuard | None
    out: Path
    metrics_f: Any  # metrics.jsonl, open on rank 0 (None elsewhere)
    loggers: list[Any]
    ema: list[torch.Tensor] | None  # the EMA weights in the order of `trainable` (a property of Trainer)
    moving_ref: MovingReference | None  # optim.kl_reference=ema: the moving KL reference's trainable weights
    old_policy: SoftOldPolicy | None  # nft old_policy=soft: DiffusionNFT's soft-updated π_old (trainable weights)

    def open_run_folder(self) -> None:
        """Make the run folder, write the resolved config, resume from the newest intact checkpoint, and open
        metrics.jsonl and the loggers (rank 0). A folder whose checkpoints are all damaged stays as it is."""
        import sys

        from ..config.load import dump_yaml
        from .loggers import build_loggers

        ckpt = self.latest_checkpoint()  # before anything is written
        if ckpt is None:
            self.refuse_lost_checkpoints()
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "checkpoints").mkdir(exist_ok=True)
            (self.out / "grids").mkdir(exist_ok=True)
            # the resolved config; a resumed run keeps its original config.yaml and records the new one beside it
            exists = (self.out / "config.yaml").exists()
            dump_yaml(self.cfg, self.out / ("config.resumed.yaml" if exists else "config.yaml"))
        self.dist.barrier()
        if ckpt is not None:
            self.load_checkpoint(ckpt)
            if self.dist.is_main:
                print(f"resuming from {ckpt} (iteration {self.iteration})", file=sys.stderr, flush=True)
        self.metrics_f, self.loggers = None, []  # rank 0 only: metrics.jsonl + run.loggers (trainer/loggers.py)
        if self.dist.is_main:
            # a resumed run redoes later iterations
            for log_file in ("metrics.jsonl", "eval_curve.jsonl", "gold.jsonl"):
                checkpoint.truncate_jsonl(self.out / log_file, self.iteration if ckpt is not None else -1)
            self.metrics_f = open(self.out / "metrics.jsonl", "a")
            try:  # default [tensorboard] is best effort: metrics.jsonl is the record of truth
                self.loggers = build_loggers(self.cfg.run.loggers, self.out, dataclasses.asdict(self.cfg))
            except ValueError as e:  # a named logger that is unknown or not installed: one line with the pip command
                raise TrainingError(str(e)) from None

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            # under FSDP gathered to full tensors on rank 0 (collectives), the layout of an unsharded run
            "model": model_state(self.model.net),
            "optimizer": optimizer_state(self.model.net, self.opt, self.trainable_names),
            "ema": self._ema_state(),
            # optim.kl_reference=ema: the reference moves with the run, so an exact resume needs it
            "kl_reference": self._named_full(self.moving_ref.tensors()) if self.moving_ref is not None else None,
            # nft old_policy=soft: π_old samples the next rollout and gives v_old, so an exact resume needs it
            "old_policy": self._named_full(self.old_policy.shadow) if self.old_policy is not None else None,
            "model_config": dataclasses.asdict(self.model.cfg),
            # tiny: rebuild the adapter to load
            "lora": getattr(self.model, "lora", None) if self.cfg.model.name == "tiny" else None,
            "credit_state": self.credit_state,
            "torch_rng": self.gen.get_state(),
            "global_torch_rng": torch.get_rng_state(),
            "rng_per_rank": self.dist.gather_object(rng_states()),  # every RNG of every rank (collective)
            "prompt_sampler": self.prompt_sampler.state_dict(),
            "faults": self.nonfinite.state_dict(),
            "harness": self.harness_state(),  # time-budget measurements, hacking-guard gold/alarm history
            "world_size": self.dist.world_size,
        }

    def harness_state(self) -> dict[str, Any]:
        """state_dict of every stateful harness object (the EMA weights travel as tensors under "ema")."""
        st: dict[str, Any] = {"budget": self.budget.state_dict()}
        if self.guard_ is not None:
            st["guard"] = self.guard_.state_dict()
        if self.moving_ref is not None:
            st["kl_reference"] = self.moving_ref.state_dict()
        if self.old_policy is not None:
            st["old_policy"] = self.old_policy.state_dict()
        return st

    def load_harness_state(self, st: dict[str, Any]) -> None:
        if "budget" in st:
            self.budget.load_state_dict(st["budget"])
        if self.guard_ is not None and "guard" in st:
            self.guard_.load_state_dict(st["guard"])
        if self.moving_ref is not None and "kl_reference" in st:
            self.moving_ref.load_state_dict(st["kl_reference"])
        if self.old_policy is not None and "old_policy" in st:
            self.old_policy.load_state_dict(st["old_policy"])

    def _ema_state(self) -> dict[str, torch.Tensor] | None:
        """The EMA weights by parameter name; under FSDP (EMA sharded like the weights) gathered to rank 0."""
        return None if self.ema is None else self._named_full(self.ema)

    def _named_full(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Tensors in the order of `trainable` by parameter name; under FSDP (sharded like the weights) gathered to
        rank 0 (collective; None on the other ranks)."""
        if not self.dist.fsdp:
            return dict(zip(self.trainable_names, tensors))
        full = full_tensors(tensors, keep=self.dist.is_main)
        return dict(zip(self.trainable_names, full)) if full is not None else None

    def save_checkpoint(self) -> Path:
        """Rank 0 writes every state atomically as `checkpoints/iterNNNNNN/` (tensors.safetensors + state.json +
        manifest.json with sha256, `checkpoint.save`); keeps the two newest."""
        state = self.checkpoint_state()  # every rank takes part (RNG gather)
        path = self.out / "checkpoints" / f"iter{self.iteration:06d}"
        if self.dist.is_main:
            checkpoint.save(
                state, path, iteration=self.iteration, keep=2, fault=lambda phase: inject_point(phase, self.iteration)
            )
        return path

    def latest_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies; a damaged one is skipped with a warning naming it and the one used.
        None for a fresh run folder; TrainingError (one line) when checkpoints exist but none is intact."""
        try:
            return checkpoint.find_latest(self.out / "checkpoints", warn=self.dist.is_main)
        except checkpoint.CheckpointError as e:
            raise TrainingError(f"cannot resume {self.out}: {e}") from None

    def refuse_lost_checkpoints(self) -> None:
        """A run folder without a checkpoint starts from iteration 0, which is right only if none was written yet: if
        metrics.jsonl logged an iteration after the first checkpoint's, the checkpoints were lost, and starting over
        would silently redo (and overwrite the record of) the whole run. TrainingError (one line) then."""
        every, total = self.cfg.run.checkpoint_every, self.cfg.run.iterations
        first = min(every, total) if every else total  # the first checkpoint is written at the end of this iteration
        logged = last_logged_iteration(self.out / "metrics.jsonl")
        if logged > first:
            raise TrainingError(
                f"cannot resume {self.out}: metrics.jsonl logged iterations up to {logged}, but there is no "
                f"checkpoint in {self.out / 'checkpoints'} (the first one is written after iteration {first}); "
                "restore the checkpoints, or use a new run folder to start from scratch"
            )

    def load_checkpoint(self, path: Path) -> None:
        """Restore every state from checkpoint folder `path` (verified; never unpickles)."""
        try:
            st = checkpoint.load(path)
        except checkpoint.CheckpointError as e:
            raise TrainingError(str(e)) from None
        load_model_state(self.model.net, st["model"])  # FSDP: each rank keeps its shard
        load_optimizer_state(self.model.net, self.opt, self.trainable_names, st["optimizer"])
        if st["ema"] is not None and self.dist.fsdp:  # the EMA is sharded like the weights
            self.ema = shard_like([st["ema"][n] for n in self.trainable_names], self.trainable)
        else:
            self.ema = [st["ema"][n].to(self.device) for n in self.trainable_names] if st["ema"] is not None else None
        if self.moving_ref is not None and st.get("kl_reference") is not None:
            # a checkpoint without it (kl_reference=initial before): the reference stays the initial weights it was
            self.moving_ref.load(shard_like([st["kl_reference"][n] for n in self.trainable_names],
                                            self.moving_ref.tensors()))
        if self.old_policy is not None and st.get("old_policy") is not None:
            # a checkpoint without it (old_policy=current before): π_old stays the weights it was built from (θ)
            self.old_policy.shadow = shard_like([st["old_policy"][n] for n in self.trainable_names], self.trainable)
        self.credit_state = st["credit_state"]
        self.gen.set_state(st["torch_rng"])
        torch.set_rng_state(st["global_torch_rng"])
        if st.get("rng_per_rank"):
            set_rng_states(st["rng_per_rank"][min(self.dist.rank, len(st["rng_per_rank"]) - 1)])
        self.prompt_sampler.load_state_dict(st["prompt_sampler"])
        self.nonfinite.load_state_dict(st.get("faults", {}))
        self.load_harness_state(st.get("harness", {}))
        self.iteration = st["iteration"]


# ---------------------------------------------------------------------------------------------------------------
# The pieces of the state: every RNG, and model / optimizer / EMA states in the unsharded layout (FSDP gathered)
# ---------------------------------------------------------------------------------------------------------------


def last_logged_iteration(path: Path) -> int:
    """The largest `iteration` of the records in a metrics.jsonl (0 when there is none; unreadable lines are
    skipped)."""
    import json

    last = 0
    if not path.is_file():
        return last
    for line in path.read_text(errors="replace").splitlines():
        try:
            last = max(last, int(json.loads(line)["iteration"]))
        except (ValueError, KeyError, TypeError, OverflowError):
            continue
    return last


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
