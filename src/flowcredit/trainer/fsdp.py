"""FSDP2 sharding of the trained network (``dist.fsdp``, full fine-tunes over many processes; docs/SCALING.md).

Each transformer block is one FSDP group and the rest of the network the root group; gradients are summed over the
ranks like the unsharded path's all-reduce (`distributed.Dist.sync_grads`), and `clip_grad_norm` returns the
global norm of the sharded gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .distributed import Dist


def network_blocks(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a model's network, the FSDP wrapping units: the tiny TinyDiT's ``blocks``, diffusers'
    ``transformer_blocks`` (SD3, FLUX) and ``single_transformer_blocks`` (FLUX)."""
    out: list[torch.nn.Module] = []
    for attr in ("blocks", "transformer_blocks", "single_transformer_blocks"):
        mods = getattr(net, attr, None)
        if isinstance(mods, torch.nn.ModuleList):
            out += list(mods)
    return out


def shard_network(net: torch.nn.Module, mesh) -> None:
    """FSDP2 ``fully_shard`` on every transformer block, then on the whole network (the root group holds the rest:
    embeddings, text encoder of the tiny model, output head). The FSDP2 docs ask for this bottom-up order; each group
    is all-gathered in one collective and its gradients reduce-scattered in one.

    Parameters are resharded after every forward, the root included (``reshard_after_forward=True``; the default
    None would keep the root unsharded after a forward, and a later in-place weight copy, e.g. the EMA swap of an
    evaluation, would then not reach the unsharded copy the next forward uses). Gradients are SUMMED over ranks:
    FSDP2 averages by default; ``set_gradient_divide_factor(1.0)`` makes it a sum, and
    ``set_force_sum_reduction_for_comms(True)`` keeps the collective a plain SUM (gloo has no PREMUL_SUM; NCCL's
    zero-copy path needs SUM too; FSDPModule docstrings, torch 2.13).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for blk in network_blocks(net):
        fully_shard(blk, mesh=mesh, reshard_after_forward=True)
    fully_shard(net, mesh=mesh, reshard_after_forward=True)
    for mod in net.modules():
        if isinstance(mod, FSDPModule):
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)


def apply_fsdp(
    dist: Dist, model, ref_model=None, *, groups_per_rank_even: bool = True, more_refs: Sequence[Any] = ()
) -> list[torch.nn.Parameter] | None:
    """``dist.fsdp``: shard ``model.net`` (and the frozen KL reference copies' ``net``, ``ref_model`` and
    ``more_refs``, e.g. the base copy of optim.kl_base_beta) over the processes.

    Returns the trainable parameters, now DTensor shards (FSDP2 replaces the registered parameters, so a list taken
    before sharding is stale), or None when there is one process: FSDP is then a no-op, with a warning.
    ``groups_per_rank_even``: every rank holds the same number of whole prompt groups. Without it (``split_groups``)
    the shared-noise x̂0 estimates would make a different number of network calls per rank, and every call of a
    sharded network is a collective.
    """
    if not dist.active:
        warnings.warn("dist.fsdp=true with one process: nothing to shard, training unsharded", stacklevel=2)
        return None
    if not groups_per_rank_even:
        raise ValueError(
            f"dist.fsdp=true needs data.prompts_per_iter to be a multiple of the {dist.world_size} processes (every "
            "rank must make the same network calls); dist.split_groups is not supported with FSDP"
        )
    from torch.distributed.device_mesh import init_device_mesh

    net = model.net
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    mesh = init_device_mesh(torch.device(dist.device).type, (dist.world_size,))
    shard_network(net, mesh)
    for ref in ([ref_model] if ref_model is not None else []) + list(more_refs):
        shard_network(ref.net, mesh)  # frozen: only all-gathers, no gradients
    dist.fsdp = True
    trainable = [p for n, p in net.named_parameters() if p.requires_grad]
    if [n for n, p in net.named_parameters() if p.requires_grad] != names:  # FSDP2 keeps names and order
        raise RuntimeError("FSDP changed the trainable parameter names; checkpoints would not map back")
    return trainable


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` returning a plain 0-dim tensor: the GLOBAL norm. Under FSDP2 the gradients
    are DTensor shards; clip_grad_norm_ computes the norm with DTensor ops (a Replicate DTensor, the norm of the full
    gradient; checked against one process in tests/trainer/test_fsdp.py)."""
    gn = torch.nn.utils.clip_grad_norm_(params, max_norm)
    from torch.distributed.tensor import DTensor

    return gn.full_tensor() if isinstance(gn, DTensor) else gn
