"""The hot path: exact per-tensor L2 norms of many gradients with one device-to-host transfer.

Gradients are grouped by (device, dtype) and reduced with one ``torch._foreach_norm`` per group,
accumulating in float32 (float64 for float64 tensors). The per-tensor norms, plus any small extra
values the caller wants on the host (a loss, valid counts), are packed into one float64 tensor and
read with a single transfer. Only tensors whose fused norm came back 0 or inf are looked at again:
that is where a naive norm lies (squares of 1e20 overflow float32, squares of 1e-30 underflow), and
the re-check computes a scaled float64 norm that is exact there. A NaN norm needs no re-check: finite
values cannot produce one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["dense_view", "plan_groups", "foreach_norms", "pack_norms", "fetch", "exact_norms", "grad_norms",
           "combine_norms", "module_norms", "SMALLEST_SUBNORMAL"]

#: the smallest positive float64: a norm that is not zero is at least this (sqrt of a tiny sum of
#: squares can round to 0 in float64; a gradient with a non-zero element must not read as zero)
SMALLEST_SUBNORMAL = 5e-324


def combine_norms(values) -> float:
    """The L2 norm of several norms: ``hypot``, but NaN when any is NaN (``hypot`` says inf when an
    inf and a NaN meet). Used by reports, metrics and sinks alike, so they agree on nan vs inf."""
    values = values if isinstance(values, list) else list(values)
    if not values:
        return 0.0
    h = values[0] if len(values) == 1 else math.hypot(*values)
    if h == math.inf and any(v != v for v in values):  # (only then can a NaN hide)
        return math.nan
    return h


def dense_view(grad: Tensor) -> Tensor:
    """The values whose norm equals the gradient's: ``grad`` itself, or a sparse gradient's
    coalesced values (duplicates summed, as densifying would)."""
    if grad.is_complex():  # a complex norm is the norm of the real and imaginary parts
        return torch.view_as_real((grad if grad.layout is torch.strided else grad.to_dense()).resolve_conj())
    if grad.layout is torch.strided:
        return grad
    if grad.is_sparse:
        return grad.coalesce().values()
    if grad.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        return grad.values()
    return grad.to_dense()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def plan_groups(tensors: Sequence[Tensor]) -> list[tuple[torch.device, torch.dtype, list[int]]]:
    """Indices of ``tensors`` grouped by (device, dtype): one fused kernel per group."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return [(d, dt, idx) for (d, dt), idx in groups.items()]


def _plan_fits(plan, tensors: Sequence[Tensor]) -> bool:
    """Exactly: every tensor still has its group's device and dtype (one converted middle layer
    must not land in a kernel of another dtype)."""
    if plan is None or sum(len(idx) for _, _, idx in plan) != len(tensors):
        return False
    for device, dtype, idx in plan:
        if any(tensors[i].dtype != dtype for i in idx):
            return False
        if device.type in ("cpu", "cuda"):  # get_device() is an int: no device object per tensor
            where = -1 if device.type == "cpu" else device.index
            if any(tensors[i].get_device() != where for i in idx):
                return False
        elif any(tensors[i].device != device for i in idx):
            return False
    return True


def foreach_norms(members: Sequence[Tensor]) -> list[Tensor]:
    """L2 norms of tensors of one device and dtype, one fused kernel, accumulating in float32
    (float64 for float64 tensors: CPU float64 reductions of float32 data are ~15x slower)."""
    if members[0].is_complex():  # |z| over real and imaginary parts (members share one dtype)
        members = [torch.view_as_real(m) if m.is_complex() else m for m in members]
    acc = _acc_dtype(members[0].dtype)
    try:
        return list(torch._foreach_norm(members, 2, dtype=acc))
    except (RuntimeError, NotImplementedError, TypeError):
        # Devices or dtypes without a foreach kernel: same result, one kernel per tensor.
        return [torch.linalg.vector_norm(m, dtype=acc) for m in members]


def pack_norms(tensors: Sequence[Tensor], plan=None):
    """Norms of ``tensors`` as one float64 device tensor, the permutation it is in, and the plan.

    ``packed[k]`` is the norm of ``tensors[perm[k]]``. ``plan`` (from a previous call over the
    same parameters) skips regrouping. No host synchronisation happens here.
    """
    if not tensors:
        return None, [], plan
    if not _plan_fits(plan, tensors):
        plan = plan_groups(tensors)
    pieces: list[Tensor] = []
    perm: list[int] = []
    target = None
    for device, dtype, idx in plan:
        piece = torch.stack(foreach_norms([tensors[i] for i in idx])).to(torch.float64)
        if target is None:
            target = device
        elif device != target:
            piece = piece.to(target, non_blocking=True)
        pieces.append(piece)
        perm.extend(idx)
    packed = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return packed, perm, plan


def fetch(parts: Sequence[Tensor]) -> list[float]:
    """Concatenate small device tensors into float64 and read them with ONE host transfer."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return []
    device = parts[0].device
    flat = [p.reshape(-1).to(device=device, dtype=torch.float64, non_blocking=True) for p in parts]
    packed = flat[0] if len(flat) == 1 else torch.cat(flat)
    return packed.tolist()


def exact_norms(tensors: Sequence[Tensor]) -> list[float]:
    """Scaled float64 norms that neither overflow nor underflow: max|x| * ||x / max|x|||.

    Costs one kernel chain per tensor and one transfer for all of them; meant only for the few
    tensors whose fused norm was 0 or inf.
    """
    if not tensors:
        return []
    out = []
    for t in tensors:
        if t.numel() == 0:
            out.append(torch.zeros((), dtype=torch.float64, device=t.device))
            continue
        x = t.detach()
        x = (torch.view_as_real(x.resolve_conj()) if x.is_complex() else x).to(torch.float64)
        amax = x.abs().amax()
        # amax == 0: all zeros (-0.0 included); amax == inf: a real infinity; nan propagates.
        special = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
        safe = torch.where(special, torch.ones_like(amax), amax)
        scaled = amax * torch.linalg.vector_norm(x / safe)
        out.append(torch.where(special, amax, scaled))
    return fetch(out)


def grad_norms(grads: Sequence[Tensor], extras: Sequence[Tensor] = (), plan=None):
    """Exact L2 norms of ``grads`` (dense or sparse), and ``extras`` read in the same transfer.

    Returns ``(norms, extra_values, plan)``: ``norms[i]`` is the norm of ``grads[i]`` (nan if it
    holds a NaN, inf if it holds an inf and no NaN), ``extra_values`` the flattened ``extras``,
    ``plan`` the grouping to pass back next time.
    """
    strided = torch.strided
    views = grads  # the common case: every gradient dense and real, no new list
    if any(g.layout is not strided or g.is_complex() for g in grads):
        views = [g if g.layout is strided and not g.is_complex() else dense_view(g) for g in grads]
    packed, perm, plan = pack_norms(views, plan)
    values = fetch([packed, *extras] if packed is not None else list(extras))
    n = len(perm)
    norms = [0.0] * n
    for k, i in enumerate(perm):
        norms[i] = values[k]
    suspects = [i for i, v in enumerate(norms) if v == 0.0 or v == math.inf]
    if suspects:
        for i, v in zip(suspects, exact_norms([views[i] for i in suspects])):
            norms[i] = v
    return norms, values[n:], plan


def module_norms(with_grad: Sequence[int], norms: Sequence[float], module_of: Sequence[int],
                 modules: Sequence[str]) -> dict[str, float]:
    """Each module's own gradient norm from its parameters' (entry ``i`` belongs to module
    ``modules[module_of[i]]``): squares summed in float64, in plain Python (a few hundred floats:
    cheaper than any tensor round trip); a module with a norm outside [1e-150, 1e150] (a square
    would underflow or overflow) or a NaN is combined by :func:`combine_norms` instead."""
    acc: dict[int, float] = {}
    odd: set[int] = set()
    for i, v in zip(with_grad, norms):
        m = module_of[i]
        acc[m] = acc.get(m, 0.0) + v * v
        if not 1e-150 <= v <= 1e150 and v != 0.0:  # NaN compares False too
            odd.add(m)
    sqrt = math.sqrt
    out = {modules[m]: sqrt(q) for m, q in sorted(acc.items())}
    for m in odd:
        out[modules[m]] = combine_norms([v for i, v in zip(with_grad, norms) if module_of[i] == m])
    return out
