"""Comparing parameters across an optimizer step: fused norms, samples that follow in-place
updates, and ``Packed`` views that copy and compare many tensors with a few kernels."""

from __future__ import annotations

import math
import operator
from bisect import bisect_right
from itertools import accumulate, repeat

import torch
from torch import Tensor

from .host import host_segments, host_to
from .stats import foreach_norms, plan_groups

__all__ = ["norms", "apply", "water_fill", "in_turn", "Packed", "flat", "sample_view", "versions_tell"]


def norms(tensors: list[Tensor], groups: list[list[int]], ord: float = 2.0) -> Tensor:
    """Norms as one 1-d float64 tensor, one foreach kernel per (device, dtype) group."""
    device = tensors[0].device
    pieces, order = [], []
    for idx in groups:
        members = [tensors[i] for i in idx]
        res = foreach_norms(members) if ord == 2.0 else torch._foreach_norm(members, ord)
        pieces.append(torch.stack(res).to(device=device, dtype=torch.float64))
        order += idx
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if order != list(range(len(order))):
        out = torch.empty_like(out).index_copy_(0, host_to(order, device), out)
    return out


def water_fill(sizes: list[int], allowed: int, most: int) -> int:
    """A per-tensor sample k (at most ``most``, at least 1) with sum(min(n, k)) within ``allowed``."""
    k = most
    while k > 1 and sum(min(n, k) for n in sizes) > allowed:
        k = max(1, k * 3 // 4)
    return k


class Packed:
    """1-D views of several tensors, concatenated per (device, dtype) group, so that one ``cat``
    copies them all, one comparison tests them all and one ``index_add`` gives each tensor's
    result: on the CPU a per-tensor kernel costs as much as a small tensor's whole norm."""

    def __init__(self, views: list[Tensor], reuse: bool = False):
        self.n = len(views)
        self.device = views[0].device if views else torch.device("cpu")
        self.groups = []
        for _, _, idx in plan_groups(views):
            members = list(map(views.__getitem__, idx))
            seg = host_segments(list(map(Tensor.numel, members)), members[0].device)  # (no sync)
            self.groups.append((idx, members, seg, host_to(idx, self.device)))
        # reuse: two buffers per group, one for the snapshot and one for "now", filled by one
        # foreach copy each (half the time of a cat on the CPU); a snapshot then lives until
        # the next snapshot() of this Packed
        self._slots = [[self._slot(vs) for _, vs, _, _ in self.groups] for _ in range(2)] if reuse else None
        #: :meth:`changed` in three kernels: one group in order, no empty view (no max of nothing),
        #: real (no in-place abs of a complex tensor)
        self._fused = (reuse and len(self.groups) == 1 and self.groups[0][0] == list(range(self.n))
                       and all(v.numel() for v in views) and not views[0].is_complex())

    @staticmethod
    def _slot(vs: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        buf = torch.empty(sum(v.numel() for v in vs), dtype=vs[0].dtype, device=vs[0].device)
        return buf, list(torch.split(buf, [v.numel() for v in vs]))

    def snapshot(self, slot: int = 0) -> list[Tensor]:
        if self._slots is None:
            return [torch.cat(vs) if len(vs) > 1 else vs[0].clone() for _, vs, _, _ in self.groups]
        out = []
        for (_, vs, _, _), (buf, dst) in zip(self.groups, self._slots[slot]):
            torch._foreach_copy_(dst, vs)
            out.append(buf)
        return out

    def _per_tensor(self, values: list[Tensor], dtype) -> Tensor:
        out = torch.zeros(self.n, dtype=dtype, device=self.device)
        for (idx, _, seg, where), v in zip(self.groups, values):
            sums = torch.zeros(len(idx), dtype=dtype, device=v.device).index_add_(0, seg, v.to(dtype))
            out.index_copy_(0, where, sums.to(self.device))
        return out

    def changed(self, snap: list[Tensor]) -> list[Tensor]:
        """Per tensor, in order: a number > 0 when an element differs from the snapshot, 0 when none
        does, NaN when undecided, as tensors whose concatenation is that vector. With one (device,
        dtype) group and the snapshot of :meth:`snapshot`, each tensor's max |then - now|, computed in
        the snapshot's own buffer (which it spends): three kernels, nothing allocated but the
        maxima (two distinct finite floats never subtract to 0; an inf or NaN element makes it NaN:
        undecided, so a constant -inf mask is never "changed"), read back as they are; otherwise the
        count of elements that differ (``!=``, NaN != NaN a change)."""
        if self._fused and snap[0] is self._slots[0][0][0]:
            buf, then = self._slots[0][0]
            torch._foreach_sub_(then, self.groups[0][1])
            buf.abs_()
            return list(torch._foreach_max(then))
        now = self.snapshot(1)
        return [self._per_tensor([a != b for a, b in zip(now, snap)], torch.float32)]

    def diff_norms(self, snap: list[Tensor]) -> Tensor:
        """Per tensor: ||now - snapshot||, accumulated in float64 (no square underflows)."""
        now = self.snapshot(1)
        return self._per_tensor([(a.double() - b.double()) ** 2 for a, b in zip(now, snap)], torch.float64).sqrt()


def in_turn(wanted: list[int], tensors: list[Tensor], start: int, budget: int) -> list[int]:
    """From ``wanted[start]`` on, round: the first contiguous tensor of at most ``budget`` elements,
    then the ones after it while they are contiguous and fit the budget together (picked in C: a
    vanishing model's undecided parameters are most of them)."""
    order = wanted[start:] + wanted[:start]
    picked = list(map(tensors.__getitem__, order))
    sizes = list(map(Tensor.numel, picked))
    fits = list(map(operator.and_, map(Tensor.is_contiguous, picked), map(operator.ge, repeat(budget), sizes)))
    if True not in fits:
        return []
    first = fits.index(True)
    end = fits.index(False, first) if False in fits[first:] else len(order)
    return order[first:first + min(end - first, bisect_right(list(accumulate(sizes[first:end])), budget))]


def flat(p: Tensor) -> Tensor | None:
    """A 1-D view that follows ``p``'s in-place updates (None for a non-contiguous parameter)."""
    return p.detach().view(-1) if p.is_contiguous() else None


def sample_view(p: Tensor, k: int, seed: int, whole: Tensor | None = None) -> Tensor | None:
    """``k`` elements of ``p`` (all of it when smaller) at a period coprime to the last dimension,
    so the sample walks across rows and columns; a 1-D strided view, updated in place with ``p``
    (``whole``: ``flat(p)``, made already)."""
    whole = flat(p) if whole is None else whole
    if whole is None:
        return None
    n = whole.numel()
    if n <= k:
        return whole
    period = n // k
    last = p.shape[-1] if p.dim() else 1
    while period > 1 and math.gcd(period, last) != 1:
        period -= 1
    offset = seed % max(1, n - (k - 1) * period)
    return whole[offset : offset + (k - 1) * period + 1 : period]


def versions_tell(opt) -> bool:
    """Does a parameter's version counter move whenever this optimizer changes it? Checked for
    torch.optim's SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD and
    Rprop: yes for their single-tensor and foreach implementations, NO for the fused ones (SGD,
    Adam, AdamW, Adagrad with ``fused=True``). Optimizers from elsewhere may write through
    ``p.data``, which moves no counter either, so only torch.optim's own non-fused ones are trusted."""
    return type(opt).__module__.startswith("torch.optim.") and not any(g.get("fused") for g in opt.param_groups)


def apply(op, groups: list[list[int]], tensors: list[Tensor], other=None) -> list[Tensor]:
    """A foreach ``op`` per (device, dtype) group, results back in the original order."""
    out: list = [None] * len(tensors)
    for idx in groups:
        args = [tensors[i] for i in idx]
        res = op(args, other if not isinstance(other, list) else [other[i] for i in idx])
        for i, r in zip(idx, res):
            out[i] = r
    return out
