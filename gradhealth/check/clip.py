"""Clipping by norm with the norms the check already has (``monitor.clip_grad_norm_``).

``torch.nn.utils.clip_grad_norm_`` reads every gradient twice: once for the norms, once to scale.
Right after a check the norms are known (exact, unscaled under a grad scaler, summed over shards
and counted once over replicas, the same on every rank), so the clip is the multiply alone: one
fused ``_foreach_mul_`` per device and dtype. What follows the norms is torch's own arithmetic
(each norm in its gradient's dtype, their norm, ``max_norm / (total + 1e-6)`` clamped to 1), so the
clipped gradients and the returned total are torch's.

Falls back to torch's clip (two passes) where the check's norms cannot stand in: an order other
than 2, no check since the last clip, gradients that changed since the check (another backward, a
zero_grad), a check that did not measure every parameter to clip; and at the monitor's first clip:
checks keep what the clip needs (a weak reference and the version of each gradient, about 0.1 µs a
tensor) only once the run has clipped (or an adapter armed them: :func:`arm`).
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import repeat

import torch
from torch import Tensor

from ..base import distributed as dist
from ..base.errors import GradHealthInternalWarning
from ..base.report import Report
from ..model.gradients import grad_of, grads_of

__all__ = ["ClipSource", "clip_grad_norm_", "arm", "keep"]

_VERSION = operator.attrgetter("_version")
_DTYPE, _DEVICE, _LAYOUT = operator.attrgetter("dtype"), operator.attrgetter("device"), operator.attrgetter("layout")
_CALL = weakref.ref.__call__


def keep(monitor, report: Report, entries: list[int], norms: list[float], whole: bool) -> None:
    """At the end of a check: what a clip that follows needs (from the run's first clip on)."""
    if monitor._clip_source is not False:
        monitor._clip_source = ClipSource.of(report, entries, norms, whole, monitor.view.params, monitor._plan)


def arm(monitor) -> None:
    """Clips will follow the checks (an adapter knows it from the framework's settings): the next
    check keeps what the clip needs, so the first clip is shared too."""
    if monitor._clip_source is False:
        monitor._clip_source = None


@dataclass
class ClipSource:
    """What a check leaves for the clip that follows it: its report, the entries it judged with a
    gradient and their norms (global, unscaled), and which gradient tensors those were, at which
    version (weakly: a gradient thrown away is not kept alive)."""

    report: Report
    entries: list[int]
    norms: list[float]
    whole: bool  # the check judged every parameter (not one optimizer's)
    grads: list = field(default_factory=list)  # weakrefs to the gradients the norms are of
    versions: list[int] = field(default_factory=list)
    #: (device, dtype) when those gradients are all dense and real, of one dtype on one device (the
    #: check's norm plan knows it): the clip needs no grouping of its own
    single: tuple | None = None

    @classmethod
    def of(cls, report: Report, entries: list[int], norms: list[float], whole: bool, params: list,
           plan=None) -> ClipSource:
        grads = grads_of([params[i] for i in entries])
        single = None
        if plan is not None and plan.plain and len(plan.groups) == 1 and len(plan.perm) == len(grads):
            device, dtype, _ = plan.groups[0]
            single = (device, dtype)
        return cls(report, entries, norms, whole, list(map(weakref.ref, grads)), list(map(_VERSION, grads)), single)

    def current(self, params: list) -> list | None:
        """The gradients the check measured, if they still are the parameters' (no backward,
        zero_grad or clip since); else None."""
        grads = grads_of([params[i] for i in self.entries])
        if any(map(operator.is_, grads, repeat(None))):
            return None
        if not all(map(operator.is_, grads, map(_CALL, self.grads))) or list(map(_VERSION, grads)) != self.versions:
            return None
        return grads


def _nonfinite(norm_type: float) -> RuntimeError:
    return RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                        "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                        "set `error_if_nonfinite=False`")


def _still_scaled(monitor) -> list:
    """The optimizers whose gradients a grad scaler has not unscaled yet (``unscale_``)."""
    scaler = monitor.scaler
    if scaler is None or not scaler.is_enabled() or not hasattr(scaler, "unscale_"):
        return []
    from torch.amp.grad_scaler import OptState

    states = getattr(scaler, "_per_optimizer_states", {})
    return [opt for opt in monitor.optimizers
            if states.get(id(opt), {}).get("stage") not in (OptState.UNSCALED, OptState.STEPPED)]


def _pairs(monitor, source: ClipSource, parameters) -> tuple[list, list] | None:
    """The gradients to clip and their norms, or None when the check did not measure one of them
    as it is now (then torch's clip reads them itself)."""
    params = monitor.view.params
    if source.report.skipped is not None:  # the step guard dropped them: nothing left to scale
        return [], []
    grads = source.current(params)
    if grads is None:  # a check of earlier gradients: torch's clip reads these
        return None
    if parameters is None:
        return (grads, source.norms) if source.whole else None
    wanted = [p for p in ([parameters] if isinstance(parameters, Tensor) else parameters) if grad_of(p) is not None]
    norm_of = {id(params[i]): v for i, v in zip(source.entries, source.norms)}
    if any(id(p) not in norm_of for p in wanted):
        return None
    return [grad_of(p) for p in wanted], [norm_of[id(p)] for p in wanted]


def _groups(grads: list) -> dict[tuple, list[int]]:
    """(device, dtype, dense) -> indexes, in the order torch's clip groups them (first seen)."""
    dtypes, devices, layouts = set(map(_DTYPE, grads)), set(map(_DEVICE, grads)), set(map(_LAYOUT, grads))
    if len(dtypes) == 1 and len(devices) == 1 and layouts == {torch.strided}:  # the common case: one group
        return {(grads[0].device, grads[0].dtype, True): list(range(len(grads)))}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, g in enumerate(grads):
        groups[(g.device, g.dtype, g.layout is torch.strided)].append(k)
    return groups


def _scaling(monitor, source: ClipSource, parameters, grads: list, values: list):
    """(the gradients' local tensors, their groups, the total as torch computes it)."""
    if monitor.ranks.active:  # (DTensors: their local shards; the norms are the global ones)
        grads = list(map(dist.to_local, grads))
    one = source.single if parameters is None and source.single is not None else None
    groups = {(*one, True): None} if one is not None else _groups(grads)
    # the per-tensor norms in their gradient's dtype, as torch's _foreach_norm returns them
    if len(groups) == 1:
        [(_, dtype, _)] = groups
        norms = torch.tensor(values, dtype=torch.float64).to(dtype.to_real())
    else:
        norms = torch.cat([torch.tensor([values[k] for k in ks], dtype=torch.float64).to(dtype.to_real())
                           for (_, dtype, _), ks in groups.items()])
    return grads, groups, torch.linalg.vector_norm(norms, 2.0)


def clip_grad_norm_(monitor, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, parameters=None, unscale: bool = True) -> Tensor:
    if float(norm_type) == 2.0:  # (the norm history's judge: a spike this clip contains is no error)
        monitor.carry.fit.clipped(max_norm)
    source: ClipSource | None = monitor._clip_source or None  # (False: the first clip; checks keep norms from now on)
    monitor._clip_source = None  # one clip per check: a second one reads the gradients again
    scaled = _still_scaled(monitor)
    if unscale:  # as Accelerate's clip and the AMP recipe do: clipping scaled gradients clips by scale x norm
        for opt in scaled:
            monitor.scaler.unscale_(opt)
    elif scaled:  # left scaled on purpose: the tensors are not what the check's (unscaled) norms describe
        source = None
    try:
        pairs = _pairs(monitor, source, parameters) if source is not None and float(norm_type) == 2.0 else None
        if pairs is not None and pairs[0]:
            grads, groups, total = _scaling(monitor, source, parameters, *pairs)
    except Exception as exc:  # never break a training run: torch's own clip instead (said once)
        if not getattr(monitor, "_clip_failed", False):
            monitor._clip_failed = True
            warnings.warn(f"gradhealth: the shared clip failed internally ({type(exc).__name__}: {exc}); torch's "
                          "clip_grad_norm_ runs instead", GradHealthInternalWarning, stacklevel=3)
        pairs = None
    if pairs is None:
        params = [p for p in monitor.view.params if p.grad is not None] if parameters is None else parameters
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    report = source.report
    if not pairs[0]:  # no gradient left: the step guard dropped them (the total they had), or none at all
        return torch.tensor(report.total_grad_norm if report.skipped is not None else 0.0)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise _nonfinite(norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    report.clip_coef, report.clip_max_norm = float(coef), float(max_norm)
    for (device, _, dense), ks in (groups.items() if report.clip_coef != 1.0 else ()):  # (x1: nothing to write)
        c = coef.to(device, non_blocking=True)
        if dense:
            torch._foreach_mul_(grads if ks is None or len(groups) == 1 else [grads[k] for k in ks], c)
        else:  # sparse: torch's clip refuses them; one by one
            for k in ks:
                grads[k].mul_(c)
    if report.published:  # (else the clip's numbers go out with the report: report_metrics)
        monitor.publisher.publish_clip(report)
    return total.to(grads[0].device)
