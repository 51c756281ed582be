"""One verdict across ranks: the per-rank numbers of a check reduced with a single collective.

Every rank packs the same layout of float64 numbers and calls ``all_reduce(SUM)`` once per check,
in the same place, whatever its local verdict; so every rank reaches the same statuses, norms and
policy decision. What the layout holds, per judged parameter:

* the squared gradient norm, divided by the world size for replicated gradients (DDP: equal on
  every rank) and as is for sharded ones (FSDP2/DTensor: squares summed over the shards);
* has-a-gradient, non-finite-here and non-zero-here flags, summed: a gradient is non-finite if it
  is anywhere, zero only if it is zero everywhere;
* with the DDP communication hook, which ranks held non-finite or all-zero local gradients
  *before* the all-reduce (bit ``2**rank`` set; exact up to 52 ranks);

then the loss, valid counts, local findings (which ranks), and the update norms of the last step.
The DESYNC check (a per-parameter fingerprint, all-gathered) runs at the first check, whenever a
gradient is non-finite, and every ``desync_every`` checks: decided from already-reduced numbers,
so every rank runs it or none does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["active", "world_size", "rank", "to_local", "is_sharded", "RankOrigin", "ranks_of", "MASK_LIMIT"]

MASK_LIMIT = 52  # float64 holds 2**rank bit sums exactly below this


def active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def world_size() -> int:
    return torch.distributed.get_world_size() if active() else 1


def rank() -> int:
    return torch.distributed.get_rank() if active() else 0


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def is_sharded(t: Tensor) -> bool:
    DTensor = _dtensor_type()
    if DTensor is None or not isinstance(t, DTensor):
        return False
    return any(p.is_shard() for p in t.placements)


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
    DTensor = _dtensor_type()
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


def all_reduce_tensor(t: Tensor, device: torch.device) -> Tensor:
    """THE collective of a check, on an already packed float64 CPU tensor; the result on the CPU."""
    t = t.to(device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
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


class RankOrigin:
    """A DDP communication hook that notes each parameter's local gradient norm before the
    all-reduce (one fused norm per bucket, no sync), then runs DDP's default all-reduce.

    DDP cannot unregister a comm hook: after the monitor closes, it only forwards.
    """

    def __init__(self, ddp_model):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._allreduce = allreduce_hook
        self.local: dict[int, Tensor] = {}
        self.enabled = True
        ddp_model.register_comm_hook(self, RankOrigin._hook)

    @staticmethod
    def _hook(state: RankOrigin, bucket):
        if state.enabled:
            grads = bucket.gradients()
            if grads:
                norms = torch._foreach_norm(grads)
                for p, n in zip(bucket.parameters(), norms):
                    state.local[id(p)] = n
        return state._allreduce(None, bucket)

    def take(self, params: list[Tensor]) -> tuple[list[float], list[float]] | None:
        """Per parameter: (non-finite before all-reduce, all-zero before all-reduce) as 0/1."""
        if not self.local:
            return None
        vals = [self.local.get(id(p)) for p in params]
        present = [v for v in vals if v is not None]
        fetched = torch.stack(present).tolist() if present else []
        it = iter(fetched)
        bad, zero = [], []
        for v in vals:
            x = next(it) if v is not None else 0.0
            bad.append(0.0 if math.isfinite(x) else 1.0)
            zero.append(1.0 if x == 0.0 else 0.0)
        self.local = {}
        return bad, zero
