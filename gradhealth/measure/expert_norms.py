"""Stacked experts measured per expert: each stacked gradient's slice norms in one kernel, read in the
check's single transfer, with an exact re-check of the slices that came back 0 or inf; under expert
parallelism or sharding, a rank's share of each expert. Where the stacks are is
:mod:`gradhealth.model.experts`; the per-expert verdicts are :func:`gradhealth.judge.classify.expert_states`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..model.experts import Stack
from .stats import fetch

__all__ = ["local_stack", "spread_squares", "slice_norms", "finish_slices"]


def local_stack(stack: Stack, grad: Tensor, cut: tuple[int, int] | None) -> tuple[Stack, int | None]:
    """The stack as this rank's shard of the gradient holds it, and where its experts start:
    sharded along the stacking dimension (FSDP2's ``Shard(0)``), the shard holds experts
    ``[offset, offset + n)`` whole (``torch.chunk``'s split); sharded along another, a part of every
    expert (offset None)."""
    if stack.place is not None:  # a whole expert, at its global place
        return Stack(stack.entry, stack.name, stack.module, 0, 1), stack.place
    n = grad.shape[stack.dim]
    if cut is None or n == stack.count:  # whole, or cut along another dimension: a part of every expert
        return stack, None
    chunk = -(-stack.count // cut[1])
    return Stack(stack.entry, stack.name, stack.module, stack.dim, n), cut[0] * chunk


def spread_squares(norms: list[float], offset: int | None, count: int, holders: int) -> list[float]:
    """Per expert of the whole stack, this rank's share of its squared norm: its own experts'
    squares at their places (or a part of every expert's), over the ranks holding each element."""
    if offset is None:
        return [v * v / holders for v in norms]
    out = [0.0] * count
    for e, v in enumerate(norms):
        out[offset + e] = v * v / holders
    return out


def _slices(grad: Tensor, stack: Stack) -> Tensor:
    g = grad.detach()
    if stack.dim:
        g = g.movedim(stack.dim, 0)
    return g.reshape(stack.count, -1)


def slice_norms(grad: Tensor, stack: Stack) -> Tensor:
    """The L2 norm of each of ``grad``'s slices, one kernel (accumulating in float32, float64 for
    float64 gradients), as a float64 device tensor."""
    x = _slices(grad, stack)
    kw = {} if grad.dtype in (torch.float32, torch.float64) else {"dtype": torch.float32}  # (naming its own dtype is slower)
    # a reduction along rows of [E, n] parallelises over only E outputs on a CPU: reduce [E*k, n/k]
    # rows, then the k parts of each slice (as fast as one fused norm of the whole tensor)
    m = x.shape[1]
    k = next((k for k in (8, 4, 2) if m % k == 0 and m // k >= 1024), 1)
    if k > 1 and x.is_contiguous():
        parts = torch.linalg.vector_norm(x.reshape(stack.count * k, m // k), dim=1, **kw)
        return torch.linalg.vector_norm(parts.reshape(stack.count, k), dim=1).to(torch.float64)
    return torch.linalg.vector_norm(x, dim=1, **kw).to(torch.float64)


def finish_slices(grads: list[Tensor], stacks: list[Stack], values: list[list[float]]) -> list[list[float]]:
    """The exact re-check of the slices whose fused norm came back 0 or inf (there a float32 sum of
    squares can lie), one chain per tensor over just those slices and one transfer for all."""
    todo = [(k, [e for e, v in enumerate(vs) if v == 0.0 or v == math.inf]) for k, vs in enumerate(values)]
    todo = [(k, idx) for k, idx in todo if idx]
    if not todo:
        return values
    parts = []
    for k, idx in todo:
        x = _slices(grads[k], stacks[k])[torch.tensor(idx, device=grads[k].device)].to(torch.float64)
        amax = x.abs().amax(dim=1)
        special = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
        safe = torch.where(special, torch.ones_like(amax), amax)
        scaled = amax * torch.linalg.vector_norm(x / safe[:, None], dim=1)
        parts.append(torch.where(special, amax, scaled))
    exact = fetch(parts)
    out = [list(vs) for vs in values]
    pos = 0
    for k, idx in todo:
        for e in idx:
            out[k][e] = exact[pos]
            pos += 1
    return out
