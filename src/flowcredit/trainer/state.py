"""Checkpointing of the trainer: every state of a run, saved atomically and loaded exactly (a mixin of GRPOTrainer).

What is saved (`checkpoint_state`): iteration, model weights, optimizer, EMA weights, model config (and the tiny
model's LoRA layout), credit state, every RNG of every rank, prompt-sampler position, fault counters and the harness
objects' states (time-budget measurements, hacking-guard gold/alarm history). The file format is
`trainer/checkpoint.py`: safetensors + JSON folders with a sha256 manifest, never pickle.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from . import checkpoint
from .checkpoint import rng_states, set_rng_states
from .faults import inject_point


class TrainingError(RuntimeError):
    """A run cannot start or continue; the message is one line saying what to fix."""


class CheckpointMixin:
    """Save/load of a GRPOTrainer's full state; expects the attributes set by `GRPOTrainer.setup()`."""

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            # under FSDP gathered to full tensors on rank 0 (collectives), the layout of an unsharded run
            "model": checkpoint.model_state(self.model.net),
            "optimizer": checkpoint.optimizer_state(self.model.net, self.opt, self.trainable_names),
            "ema": self._ema_state(),
            "model_config": dataclasses.asdict(self.model.cfg),
            "lora": getattr(self.model, "lora", None) if self.cfg.model.name == "tiny" else None,  # tiny: rebuild the adapter to load
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
        return st

    def load_harness_state(self, st: dict[str, Any]) -> None:
        if "budget" in st:
            self.budget.load_state_dict(st["budget"])
        if self.guard_ is not None and "guard" in st:
            self.guard_.load_state_dict(st["guard"])

    def _ema_state(self) -> dict[str, torch.Tensor] | None:
        """The EMA weights by parameter name; under FSDP (EMA sharded like the weights) gathered to rank 0."""
        if self.ema is None:
            return None
        if not self.dist.fsdp:
            return dict(zip(self.trainable_names, self.ema))
        full = checkpoint.full_tensors(self.ema, keep=self.dist.is_main)
        return dict(zip(self.trainable_names, full)) if full is not None else None

    def save_checkpoint(self) -> Path:
        """Rank 0 writes every state atomically as `checkpoints/iterNNNNNN/` (tensors.safetensors + state.json +
        manifest.json with sha256, `checkpoint.save`); keeps the two newest."""
        state = self.checkpoint_state()  # every rank takes part (RNG gather)
        path = self.out / "checkpoints" / f"iter{self.iteration:06d}"
        if self.dist.is_main:
            checkpoint.save(state, path, iteration=self.iteration, keep=2, fault=lambda phase: inject_point(phase, self.iteration))
        return path

    def latest_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies; a damaged one is skipped with a warning naming it and the one used.
        None for a fresh run folder; TrainingError (one line) when checkpoints exist but none is intact."""
        try:
            return checkpoint.find_latest(self.out / "checkpoints", warn=self.dist.is_main)
        except checkpoint.CheckpointError as e:
            raise TrainingError(f"cannot resume {self.out}: {e}") from None

    def load_checkpoint(self, path: Path) -> None:
        """Restore every state from checkpoint folder `path` (verified; never unpickles)."""
        try:
            st = checkpoint.load(path)
        except checkpoint.CheckpointError as e:
            raise TrainingError(str(e)) from None
        checkpoint.load_model_state(self.model.net, st["model"])  # FSDP: each rank keeps its shard
        checkpoint.load_optimizer_state(self.model.net, self.opt, self.trainable_names, st["optimizer"])
        if st["ema"] is not None and self.dist.fsdp:  # the EMA is sharded like the weights
            self.ema = checkpoint.shard_like([st["ema"][n] for n in self.trainable_names], self.trainable)
        else:
            self.ema = [st["ema"][n].to(self.device) for n in self.trainable_names] if st["ema"] is not None else None
        self.credit_state = st["credit_state"]
        self.gen.set_state(st["torch_rng"])
        torch.set_rng_state(st["global_torch_rng"])
        if st.get("rng_per_rank"):
            set_rng_states(st["rng_per_rank"][min(self.dist.rank, len(st["rng_per_rank"]) - 1)])
        self.prompt_sampler.load_state_dict(st["prompt_sampler"])
        self.nonfinite.load_state_dict(st.get("faults", {}))
        self.load_harness_state(st.get("harness", {}))
        self.iteration = st["iteration"]
