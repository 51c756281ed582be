"""The hot path: exact per-tensor L2 norms of many gradients with one device-to-host transfer.

Gradients are grouped by (device, dtype) and reduced with one ``torch._foreach_norm`` per group,
accumulating in float32 (float64 for float64 tensors). The per-tensor norms, plus any small extra
values the caller wants on the host (a loss, valid counts), are joined into one tensor (one
``stack`` of the scalars: float32 where every part is, else float64, exact either way) and read with
a single transfer. Only tensors whose fused norm came back 0 or inf are looked at again:
that is where a naive norm lies (squares of 1e20 overflow float32, squares of 1e-30 underflow), and
the re-check (:func:`exact_norms`) is exact there: a float64-accumulating ``_foreach_norm`` for
tensors of at most 32 bits (no square of a float32 under- or overflows float64), a scaled norm
(max|x| * ||x / max|x|||, in foreach ops) for float64 ones; a constant number of ops per (device,
dtype) group whatever the count. The plan remembers the tensors that needed it (:meth:`NormPlan.learn`)
and gives them the exact kernel from the next check on: a vanishing-gradient model pays the re-check
(and its second transfer) once, not at every check. A NaN norm needs no re-check: finite values
cannot produce one.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from functools import partial
from itertools import compress, filterfalse, groupby, repeat

import torch
from torch import Tensor

from ..base.combine import combine_norms, module_norms  # noqa: F401 (host-side, plain Python: stats.X as before)

__all__ = ["dense_view", "plan_groups", "foreach_norms", "pack_norms", "fetch", "exact_norms", "grad_norms", "Launched",
           "combine_norms", "module_norms", "SMALLEST_SUBNORMAL", "exact_pieces"]

#: the smallest positive float64: a norm that is not zero is at least this (sqrt of a tiny sum of
#: squares can round to 0 in float64; a gradient with a non-zero element must not read as zero)
SMALLEST_SUBNORMAL = 5e-324


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
    keys = list(zip(map(_DEVICE, tensors), map(_DTYPE, tensors)))
    if len(set(keys)) == 1:  # (the usual: one device, one dtype)
        return [(*keys[0], list(range(len(keys))))]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return [(d, dt, idx) for (d, dt), idx in groups.items()]


_DTYPE, _LAYOUT = operator.attrgetter("dtype"), operator.attrgetter("layout")
_IS_FLOAT, _DEVICE = operator.attrgetter("is_floating_point"), operator.attrgetter("device")
_FLAT, _SOMETHING = operator.methodcaller("reshape", -1), partial(operator.is_not, None)
_F64, _foreach_norm = torch.float64, torch._foreach_norm
#: on the CPU, tensors of one shape with at most this many elements are normed stacked (see
#: ``_batches``), at most ``STACK_ELEMENTS`` elements a stack (its copy: 4 MiB of float32)
STACK_NUMEL, STACK_ELEMENTS = 1 << 14, 1 << 20
#: ... but only when there are at least this many of them: below it one ``_foreach_norm`` over them
#: costs less than the stacks' copies (a small model's few tensors: 2.5x less for a 2-block transformer)
STACK_MIN = 64
#: on the CPU, a larger contiguous tensor is reduced as this many rows (the first that divides it)
ROWS = (64, 16, 8, 4, 2)


class NormPlan:
    """How a list of tensors is grouped into fused kernels, kept with the (dtype, device index,
    layout) of each tensor it was built for: another list fits it exactly when those are the same
    (one converted middle layer must not land in a kernel of another dtype); three C-level passes
    to check. Shapes are not in the key (reading them costs as much again): a stacked kernel whose
    members no longer share one shape fails in ``torch.stack`` (a tensor reduced as rows that no
    longer divides into them, in ``view``), and :func:`_pack_fitted` plans again. (A device index
    does not name the device type: a tensor moved between two types whose indexes agree, e.g.
    cuda:0 and mps:0, cannot happen on one machine.)"""

    def __init__(self, tensors: Sequence[Tensor], key: tuple | None = None, exact=()):
        self.groups = plan_groups(tensors)
        self.key = key if key is not None else plan_key(tensors)
        #: normed by :func:`exact_pieces`: those whose fused norm once read 0 or inf (deferred: all)
        self.exact: frozenset[int] = frozenset(exact)
        self._arrange(tensors)
        self.plain = False  # (grad_norms) built over the gradients themselves: dense and real
        self.later = False  # every non-empty tensor is in ``exact`` (a deferred check's plan)

    def _arrange(self, tensors: Sequence[Tensor]) -> None:
        ex = self.exact
        #: per group, its kernels: (kind, rows, indices), see :func:`_batches`; the exact ones last
        self.batches = []
        for device, dtype, idx in self.groups:
            rest = [i for i in idx if i not in ex] if ex else idx
            batches = _batches(tensors, device, rest) if rest else []
            if len(rest) < len(idx):
                batches.append(("exact", 0, [i for i in idx if i in ex]))
            self.batches.append((dtype, batches))
        self.perm = [i for _, batches in self.batches for _, _, idx in batches for i in idx]
        self.identity = self.perm == list(range(len(self.perm)))
        inverse = [0] * len(self.perm)  # (where each tensor's norm is in the packed order)
        for k, i in enumerate(self.perm):
            inverse[i] = k
        self.order = operator.itemgetter(*inverse) if len(inverse) > 1 else None
        #: the one kernel of a plan that has one (a small model's: one group, one fused norm), else None
        one = self.batches[0][1] if len(self.batches) == 1 and len(self.batches[0][1]) == 1 else None
        self.single = (foreach_norms if one[0][0] == "each" else exact_pieces if one[0][0] == "exact" else None) if one else None

    def learn(self, indices, tensors: Sequence[Tensor]) -> None:
        """Norm ``indices`` of ``tensors`` with the exact kernel from now on (an empty one's 0 is exact)."""
        add = {i for i in indices if tensors[i].numel()} - self.exact
        if add:
            self.exact = self.exact | add
            self._arrange(tensors)

    def fits(self, tensors: Sequence[Tensor]) -> bool:
        return len(tensors) == len(self.perm) and plan_key(tensors) == self.key


def plan_key(tensors: Sequence[Tensor]) -> tuple:
    return list(map(_DTYPE, tensors)), list(map(Tensor.get_device, tensors)), list(map(_LAYOUT, tensors))


def _batches(tensors: Sequence[Tensor], device: torch.device, idx: list[int]) -> list[tuple[str, int, list[int]]]:
    """One group's kernels: ``(kind, rows, indices)``. On other devices than the CPU, one fused
    ``_foreach_norm`` ("each"). On the CPU that is a loop of one full reduction per tensor (a few
    microseconds each whatever the size, and a full reduction that two threads share badly):
    small tensors of one shape are stacked and reduced along rows in one kernel ("stack": the copy
    is cheaper than the per-tensor calls up to ``STACK_NUMEL`` elements, when there are at least
    ``STACK_MIN`` small tensors; a chunk can be a single tensor, normed as ``[1, n]``), and each
    larger contiguous one is reduced as ``rows`` rows, then its rows' norms combined ("rows": about half the time of its full reduction, as measured by
    ``gradhealth bench``; one call per tensor, where the kernel's time dominates the call's). The
    rest (non-contiguous large tensors, complex ones) go to ``_foreach_norm``."""
    if device.type != "cpu":
        return [("each", 0, idx)]
    by_shape: dict[torch.Size, list[int]] = {}
    by_rows: dict[int, list[int]] = {}
    rest: list[int] = []
    for i in idx:
        t = tensors[i]
        n = t.numel()
        if t.layout is not torch.strided or t.is_complex() or n == 0:
            rest.append(i)
        elif n <= STACK_NUMEL:
            by_shape.setdefault(t.shape, []).append(i)
        elif t.is_contiguous():
            r = next((r for r in ROWS if n % r == 0), 0)
            (by_rows.setdefault(r, []) if r else rest).append(i)
        else:
            rest.append(i)
    out = []
    if sum(map(len, by_shape.values())) < STACK_MIN:  # (few small tensors: one foreach beats stacking them)
        rest += [i for members in by_shape.values() for i in members]
        by_shape = {}
    for members in by_shape.values():
        if len(members) > 1:  # in chunks: a stack's copy stays within STACK_ELEMENTS
            per = max(2, STACK_ELEMENTS // tensors[members[0]].numel())
            out += [("stack", 0, members[a:a + per]) for a in range(0, len(members), per)]
        else:
            rest += members
    out += [("rows", r, members) for r, members in by_rows.items()]
    if rest:
        out.append(("each", 0, sorted(rest)))
    return out


def foreach_norms(members: Sequence[Tensor]) -> list[Tensor]:
    """L2 norms of tensors of one device and dtype, one fused kernel, accumulating in float32
    (float64 for float64 tensors: CPU float64 reductions of float32 data are ~15x slower)."""
    if members[0].is_complex():  # |z| over real and imaginary parts (members share one dtype)
        members = [torch.view_as_real(m) if m.is_complex() else m for m in members]
    acc = _acc_dtype(members[0].dtype)
    try:  # (dtype only where it differs: naming the input's own dtype takes a slower path)
        if members[0].dtype == acc:
            return list(torch._foreach_norm(members, 2))
        return list(torch._foreach_norm(members, 2, dtype=acc))
    except (RuntimeError, NotImplementedError, TypeError):
        # Devices or dtypes without a foreach kernel: same result, one kernel per tensor.
        return [torch.linalg.vector_norm(m, dtype=acc) for m in members]


def pack_norms(tensors: Sequence[Tensor], plan: NormPlan | None = None):
    """Norms of ``tensors`` as one device tensor (float32, float64 for float64 tensors), the
    permutation it is in, and the plan.

    ``packed[k]`` is the norm of ``tensors[perm[k]]``. ``plan`` (from a previous call over the
    same parameters) skips regrouping when it still fits. No host synchronisation happens here.
    """
    if not tensors:
        return None, [], plan
    if plan is None or not plan.fits(tensors):
        plan = NormPlan(tensors)
    pieces, plan = _pack_fitted(tensors, plan)
    return joined(pieces), plan.perm, plan


def _pack_fitted(tensors: Sequence[Tensor], plan: NormPlan) -> tuple[list[Tensor], NormPlan]:
    """:func:`_pack`, planned again when the plan's stacks or rows no longer fit the shapes."""
    try:
        return _pack(tensors, plan), plan
    except RuntimeError:
        if all(kind == "each" for _, batches in plan.batches for kind, _, _ in batches):
            raise
    fresh = NormPlan(tensors, plan.key, plan.exact)
    fresh.plain, fresh.later = plan.plain, plan.later
    return _pack(tensors, fresh), fresh


def _pack(tensors: Sequence[Tensor], plan: NormPlan) -> list[Tensor]:
    """The norms, in the plan's order, as the kernels leave them (0-d tensors from a fused kernel,
    1-d from a stacked one): :func:`joined` puts them with the extras in one tensor."""
    if plan.single is not None:
        return plan.single(tensors)  # (one kernel)
    out: list[Tensor] = []
    for (_, _, _), (dtype, batches) in zip(plan.groups, plan.batches):
        acc = _acc_dtype(dtype)
        kw = {} if dtype == acc else {"dtype": acc}  # (float32 accumulation, as in foreach_norms)
        for kind, rows, idx in batches:
            members = list(map(tensors.__getitem__, idx))
            if kind == "stack":
                out.append(torch.linalg.vector_norm(torch.stack(members).reshape(len(members), -1), dim=1, **kw))
            elif kind == "rows":  # (a view: fails, and is planned again, if a tensor stopped fitting)
                parts = torch.stack([torch.linalg.vector_norm(m.view(rows, -1), dim=1, **kw) for m in members])
                out.append(torch.linalg.vector_norm(parts, dim=1))
            elif kind == "exact":
                out += exact_pieces(members)
            else:
                out += foreach_norms(members)
    return out


def joined(parts: Sequence[Tensor]) -> Tensor:
    """``parts`` (device tensors of any shape) as one flat tensor on the first one's device, in as
    few kernels as they allow (one ``stack`` of scalars, else one ``cat``; a part on another device
    is moved without a sync), in a dtype that holds each of their values exactly: float32 when every
    part is a float of at most 32 bits (the norms, a loss: read back as the very same numbers),
    float64 otherwise (a count, a float64 value)."""
    floats = all(map(_IS_FLOAT, map(_DTYPE, parts)))  # the common case (stack and cat promote: exact)
    if floats:
        if len(parts) == 1:
            return parts[0] if parts[0].dim() == 1 else parts[0].reshape(-1)
        if not any(map(Tensor.dim, parts)):
            try:  # (scalars of one device; scalars of several fail here, and are joined below)
                return torch.stack(parts)
            except RuntimeError:
                pass
    if len(parts) > 1 and 0 in map(Tensor.numel, parts):  # (an empty part holds nothing to read)
        return joined([p for p in parts if p.numel()] or parts[:1])
    if not floats:  # (a count: float64 holds it exactly)
        parts = [p if p.dtype.is_floating_point else p.to(torch.float64) for p in parts]
    device = parts[0].device
    if len(set(map(_DEVICE, parts))) > 1:
        parts = [p if p.device == device else p.to(device, non_blocking=True) for p in parts]
    flat = []  # (each run of scalars one stack, walked run by run in C)
    for dim, run in groupby(parts, key=Tensor.dim):
        flat += [torch.stack(list(run))] if dim == 0 else run if dim == 1 else map(_FLAT, run)
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def fetch(parts: Sequence[Tensor]) -> list[float]:
    """Concatenate small device tensors (:func:`joined`) and read them with ONE host transfer."""
    if len(parts) == 1 and parts[0] is not None and parts[0].dim() == 1 and parts[0].dtype.is_floating_point:
        return parts[0].tolist()  # (joined() of one flat float vector is itself)
    if any(map(operator.is_, parts, repeat(None))):
        parts = [p for p in parts if p is not None]
    if not parts:
        return []
    return joined(parts).tolist()


def exact_pieces(members: Sequence[Tensor]) -> list[Tensor]:
    """Exact float64 L2 norms of non-empty real tensors of one device and dtype, in a constant number of
    ops (:func:`joined` stacks the scalars with the others). At most 32 bits: a scalar each from one
    ``_foreach_norm`` accumulating in float64 (a float32 square lies in [2e-90, 1.2e77]: nothing under-
    or overflows). float64: one vector, max|x| * ||x / max|x||| (a max of 0, inf or NaN is the norm)."""
    if members[0].dtype != _F64:
        return list(_foreach_norm(members, 2, dtype=_F64))
    top = torch.stack(_foreach_norm(members, math.inf))
    usable = torch.isfinite(top) & (top > 0)
    safe = torch.where(usable, top, 1.0)
    scaled = torch.stack(_foreach_norm(torch._foreach_div(members, safe.unbind()), 2))
    return [torch.where(usable, scaled * safe, top)]


def exact_norms(tensors: Sequence[Tensor]) -> list[float]:
    """Norms that neither overflow nor underflow (:func:`exact_pieces`), grouped by (device, dtype),
    read with one transfer; meant for the few tensors whose fused norm was 0 or inf."""
    if not tensors:
        return []
    views = [torch.view_as_real(t.detach().resolve_conj()) if t.is_complex() else t.detach() if t.requires_grad else t
             for t in tensors]
    out: list[float] = [0.0] * len(views)
    pieces, order = [], []
    for _, _, idx in plan_groups(views):
        idx = [i for i in idx if views[i].numel()]  # (an empty tensor's norm is 0)
        if idx:
            pieces += exact_pieces([views[i] for i in idx])
            order += idx
    if pieces:
        for i, v in zip(order, fetch(pieces)):
            out[i] = v
    return out


def grad_norms(grads: Sequence[Tensor], extras: Sequence[Tensor] = (), plan=None):
    """Exact L2 norms of ``grads`` (dense or sparse), and ``extras`` read in the same transfer.

    Returns ``(norms, extra_values, plan)``: ``norms[i]`` is the norm of ``grads[i]`` (nan if it
    holds a NaN, inf if it holds an inf and no NaN), ``extra_values`` the flattened ``extras``,
    ``plan`` the grouping to pass back next time.
    """
    launched = Launched(grads, extras, plan)
    norms, values = launched.read()
    return norms, values, launched.plan


class Launched:
    """The norms of ``grads`` and the ``extras``, packed on the device, not read yet (no host
    synchronisation here). :meth:`read` reads them now (ONE transfer, then the exact re-check of
    the norms that came back 0 or inf, which the plan then remembers). With ``later`` the values are
    read later, when the gradients may be gone (:mod:`gradhealth.check.deferred`): every non-empty gradient is normed
    by the exact kernel at once (one fused kernel per group, no re-check to come), norms and extras
    joined into one vector (its norms: :meth:`norms_part`, which the step guard tests for non-finite
    values), and :meth:`resolve` takes the values as they are."""

    def __init__(self, grads: Sequence[Tensor], extras: Sequence[Tensor] = (), plan=None, later: bool = False):
        views = grads  # the common case: every gradient dense and real, no new list
        pieces: list[Tensor] = []
        if grads:
            key = plan_key(grads)  # the plan is kept for the gradients, built over their views
            if plan is None or key != plan.key:
                plain = all(lay is torch.strided for lay in key[2]) and not any(d.is_complex for d in key[0])
                views = grads if plain else list(map(dense_view, grads))
                plan = NormPlan(views, key, [i for i, v in enumerate(views) if v.numel()] if later else ())
                plan.plain, plan.later = plain, later
            elif not plan.plain:
                views = list(map(dense_view, grads))
            if later and not plan.later:  # (a plan a synchronous check made)
                plan.learn(range(len(views)), views)
                plan.later = True
            pieces, plan = _pack_fitted(views, plan)
        if grads:
            self.n, self.identity, self.order = len(plan.perm), plan.identity, plan.order
        else:
            self.n, self.identity, self.order = 0, True, None
        self.views, self.plan, self.later = views, plan, bool(later and grads)
        #: what is read back, in order: the norms (as the kernels left them, or joined), the extras; and
        #: (``later``) as one vector, ``packed``, the transfer's one source (None: nothing to read)
        self.parts = pieces + list(filter(_SOMETHING, extras))  # (the scalars among them: one stack)
        self.packed = joined(self.parts) if later and self.parts else None

    def norms_part(self) -> Tensor | None:
        """(``later``) the packed norms of every gradient, on the device: exact, so non-finite
        exactly where a gradient holds a NaN or inf."""
        return self.packed[:self.n] if self.later else None  # (a view: no kernel)

    def read(self) -> tuple[list[float], list[float]]:
        values = fetch(self.parts)
        norms = self._order(values)
        if 0.0 in norms or math.inf in norms:  # (those not normed exactly already: picked out in C)
            suspects = list(filterfalse(self.plan.exact.__contains__,  # (normed exactly as of this launch: read at once)
                                        compress(range(len(norms)), map((0.0, math.inf).__contains__, norms))))
            if suspects:
                for i, v in zip(suspects, exact_norms([self.views[i] for i in suspects])):
                    norms[i] = v
                self.plan.learn(suspects, self.views)
        return norms, values[self.n:]

    def resolve(self, values: list[float]) -> tuple[list[float], list[float]]:
        """The norms and extras from ``values`` read later (``later``): exact as they are."""
        return self._order(values), values[self.n:]

    def _order(self, values: list[float]) -> list[float]:
        if self.identity:
            return values[:self.n]
        return list(self.order(values))  # (the inverse permutation, applied in C)
