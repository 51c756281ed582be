"""torch.distributed plumbing every stage uses: is it on, shards and DTensors, rank bit masks, the
collectives. The DDP wrapper as a check sees it is :mod:`gradhealth.ranks.ddp`; what a check packs and
reduces is :mod:`gradhealth.ranks.crossrank`.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["active", "world_size", "rank", "to_local", "is_sharded", "ranks_of", "bit", "MASK_LIMIT"]

MASK_LIMIT = 52  # float64 holds 2**rank bit sums exactly below this


def active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def world_size() -> int:
    return torch.distributed.get_world_size() if active() else 1


def rank() -> int:
    return torch.distributed.get_rank() if active() else 0


@functools.lru_cache(maxsize=1)
def dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def is_sharded(t: Tensor) -> bool:
    DTensor = dtensor_type()
    if DTensor is None or not isinstance(t, DTensor):
        return False
    return any(p.is_shard() for p in t.placements)


def settle_partial(t: Tensor) -> Tensor:
    """A DTensor gradient with a ``Partial`` placement (a sum still pending), reduced as torch's own
    norm of it would (``Partial`` -> ``Replicate``: a collective over that mesh dimension, on every
    rank alike, since every rank holds the same placements); anything else unchanged."""
    DTensor = dtensor_type()
    if DTensor is None or not isinstance(t, DTensor) or not any(p.is_partial() for p in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    return t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])


_PLACED: dict = {}  # (mesh, placements) -> placement_counts: the same for every gradient of a layout


def placement_counts(t: Tensor) -> tuple[int, int, int]:
    """(shards, holders, shard) of a DTensor: how many pieces the mesh dimensions where it is sharded
    (``Shard``, ``_StridedShard``) cut it into, and how many ranks hold each element (the product
    of the sizes of the dimensions where it is replicated, times the copies of its mesh in the world). The squared norm of the whole is then
    the sum over every rank of its local squared norm divided by ``holders``: each element counted
    once. ``shard``: which of the ``shards`` pieces this rank holds (the holders of one piece are
    replicas of each other). ``Partial`` is reduced first (:func:`settle_partial`)."""
    key = (id(t.device_mesh), t.placements)
    got = _PLACED.get(key)
    if got is not None and got[0] is t.device_mesh:
        return got[1]
    mesh, shards, shard = t.device_mesh, 1, 0
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    # the ranks outside its mesh hold the same tensor (FSDP2 + TP: a norm weight sharded over dp
    # only is the same on every TP rank of its dp group)
    holders = max(1, world_size() // mesh.size())
    for d, p in enumerate(t.placements):
        if p.is_replicate():
            holders *= mesh.size(d)
        else:
            shards *= mesh.size(d)
            shard = shard * mesh.size(d) + coordinate[d]
    if len(_PLACED) > 256:
        _PLACED.clear()
    _PLACED[key] = (mesh, (shards, holders, shard))
    return shards, holders, shard


def fsdp1_sharded(model) -> bool:
    """Is ``model`` (or a submodule) wrapped in FSDP1 with a sharding strategy that shards?"""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:
        return False
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            return getattr(m, "sharding_strategy", None) != ShardingStrategy.NO_SHARD
    return False


def to_local(t: Tensor) -> Tensor:
    """A DTensor's local shard (its local computation must not hide a collective); else ``t``."""
    DTensor = dtensor_type()
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def bit(r: int) -> float:
    return float(2**r) if r < MASK_LIMIT else 1.0


def ranks_of(mask: float, world: int) -> list[int]:
    """The ranks whose bit is set in a summed ``2**rank`` mask."""
    if world > MASK_LIMIT:
        return []
    m = int(round(mask))
    return [r for r in range(world) if m >> r & 1]


def all_reduce_tensor(t: Tensor, device: torch.device, group=None) -> Tensor:
    """THE collective of a check, on an already packed float64 CPU tensor; the result on the CPU."""
    t = t.to(device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return t.cpu()


def all_gather(values: list[float], device: torch.device) -> list[list[float]]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(world_size())]
    torch.distributed.all_gather(out, t)
    return [o.tolist() for o in out]


def collective_device() -> torch.device:
    backend = torch.distributed.get_backend()
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


