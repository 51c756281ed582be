"""The six-state decision tree: per parameter (``classify``, and a check's ``classify_selection``), and per
stacked expert (``expert_states``: the model's stacks are :mod:`gradhealth.model.experts`)."""

from __future__ import annotations

import math
import operator
from itertools import compress, repeat

from torch import nn

from ..base.combine import combine_norms
from ..base.status import Status
from ..model.experts import Stack, unit_name
from ..model.optimizers import as_optimizers, optimizer_param_ids
from ..model.params import named_parameters
from ..measure import stats

__all__ = ["classify", "classify_selection", "decide", "expert_states", "fill_experts", "tokens_by_unit"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def decide(requires_grad: bool, norm: float | None, in_optimizer: bool) -> Status:
    """The decision tree, given the exact gradient norm (None: no gradient).

    The norm is exact (see :mod:`gradhealth.measure.stats`), so it is non-finite exactly when an element
    is, and zero exactly when every element is.
    """
    if not requires_grad:
        return Status.FROZEN
    if norm is None:
        return Status.NO_GRAD
    if not math.isfinite(norm):
        return Status.NON_FINITE_GRAD
    if not in_optimizer:
        return Status.NOT_IN_OPTIMIZER
    if norm == 0.0:
        return Status.ZERO_GRAD
    return Status.OK


def classify(model: nn.Module, optimizer=None) -> dict[str, Status]:
    """Status of every parameter of ``model`` right now; ``optimizer`` may be one, a list, or None."""
    entries = named_parameters(model)
    optimizers = as_optimizers(optimizer, watch=False)
    ids = optimizer_param_ids(optimizers) if optimizers else None
    with_grad = [i for i, (_, p) in enumerate(entries) if p.grad is not None]
    norms, _, _ = stats.grad_norms([entries[i][1].grad for i in with_grad])
    norm_of = dict(zip(with_grad, norms))
    return {
        name: decide(p.requires_grad, norm_of.get(i), ids is None or id(p) in ids)
        for i, (name, p) in enumerate(entries)
    }


_BY_NORM = {0.0: Status.ZERO_GRAD}  # (the state of a trainable parameter in the optimizers, by a norm not in (0, inf))
_NONE_NAN = {None: math.nan}
#: a trainable entry that is not OK, by (no gradient, a finite norm, in the optimizers): the rest of :func:`decide`
#: (a finite norm in the optimizers that is not OK is 0)
_REST = {(True, f, i): Status.NO_GRAD for f in (False, True) for i in (False, True)}
_REST.update({(False, False, False): Status.NON_FINITE_GRAD, (False, False, True): Status.NON_FINITE_GRAD,
              (False, True, False): Status.NOT_IN_OPTIMIZER, (False, True, True): Status.ZERO_GRAD})


def classify_selection(names: list[str], params: list, pids: list[int], idx: list[int], norm_of: list,
                       ids: set[int] | None, dense: list[float] | None = None, all_inside: bool | None = None,
                       requires: list[bool] | None = None):
    """The decision tree over a check's judged entries, from their exact norms.

    Returns ``(status, in_optimizer, not_ok, frozen)``: every judged name's state (OK first, the
    common case, without walking the full tree), whether each is in an optimizer (None without
    one), the names whose state is neither OK nor FROZEN, and the FROZEN ones (each in entry order).
    The frozen entries (a LoRA fine-tune's base model: most of them) and, when each of the others
    is in the optimizers with a finite non-zero norm, every entry, are decided in a few C-level
    passes; only the rest is walked. ``dense``: the norms of the judged entries in order, when
    every one has a gradient; ``all_inside``: every judged entry is known to be in ``ids``;
    ``requires``: each entry's ``requires_grad`` as it was (a deferred check's launch), else read now.
    """
    sel_names = names if len(idx) == len(names) else [names[i] for i in idx]  # idx: sorted, distinct
    status: dict[str, Status] = dict.fromkeys(sel_names, Status.OK)
    in_opt: dict[str, bool] | None = dict.fromkeys(sel_names, True) if ids is not None else None
    req = list(map(_REQUIRES_GRAD, params)) if requires is None else requires
    inf, walk, frozen = math.inf, idx, []
    if not all(map(req.__getitem__, idx)):  # FROZEN whatever else holds (the tree's first question)
        walk = list(compress(idx, map(req.__getitem__, idx)))
        cold = list(compress(idx, map(operator.not_, map(req.__getitem__, idx))))
        frozen = list(map(names.__getitem__, cold))
        status.update(zip(frozen, repeat(Status.FROZEN)))
        if ids is not None:
            in_opt.update(zip(compress(frozen, map(operator.not_, map(ids.__contains__, map(pids.__getitem__, cold)))),
                              repeat(False)))
    if ids is None or all_inside or ids.issuperset(map(pids.__getitem__, walk)):
        vals = dense if dense is not None and len(dense) == len(idx) and walk is idx else list(map(norm_of.__getitem__, walk))
        if None not in vals:  # trainable, in the optimizers, with a gradient: the norm alone makes the state
            if not vals or (0.0 < min(vals) and sum(vals) < inf):
                return status, in_opt, [], frozen  # every one OK (NaN fails both comparisons): no walk needed
            odd = list(map(operator.not_, map(operator.and_, map(operator.gt, vals, repeat(0.0)),
                                              map(operator.lt, vals, repeat(inf)))))
            not_ok = list(map(names.__getitem__, compress(walk, odd)))  # 0: ZERO_GRAD; NaN, inf: NON_FINITE_GRAD
            status.update(zip(not_ok, map(_BY_NORM.get, compress(vals, odd), repeat(Status.NON_FINITE_GRAD))))
            return status, in_opt, not_ok, frozen
    # (some entries are in no optimizer, a target network's, or have a norm that is not usable: each one
    # decided by the tree's remaining questions, looked up in C: no Python runs per entry)
    vals = list(map(norm_of.__getitem__, walk))
    insides = list(map(ids.__contains__, map(pids.__getitem__, walk))) if ids is not None else [True] * len(walk)
    usable = list(map(_NONE_NAN.get, vals, vals))  # (no gradient: NaN, which fails every comparison)
    good = map(operator.and_, map(operator.gt, usable, repeat(0.0)), map(operator.lt, usable, repeat(inf)))
    odd = list(map(operator.not_, map(operator.and_, insides, good)))
    if ids is not None:
        in_opt.update(zip(map(names.__getitem__, compress(walk, map(operator.not_, insides))), repeat(False)))
    not_ok = list(map(names.__getitem__, compress(walk, odd)))
    status.update(zip(not_ok, map(_REST.__getitem__, zip(map(operator.is_, compress(vals, odd), repeat(None)),
                                                         map(operator.lt, compress(usable, odd), repeat(inf)),
                                                         compress(insides, odd)))))
    return status, in_opt, not_ok, frozen


def tokens_by_unit(layers: dict[str, list[str]], counts: list[list[float]] | None) -> dict[str, int]:
    """Router token counts by expert, when the router reported one count vector per MoE layer of
    stacked experts (in the model's order) of the same size."""
    if not counts or len(counts) != len(layers):
        return {}
    out = {}
    for units, vs in zip(layers.values(), counts):
        if len(vs) != len(units):
            return {}
        out.update({u: int(v) for u, v in zip(units, vs)})
    return out


def expert_states(stacks: dict[int, Stack], status: dict[str, Status], slices: dict[int, list[float]]
          ) -> tuple[dict[str, Status], dict[str, float], dict[str, list[str]]]:
    """Per-expert states and norms: ``({unit: state}, {unit: norm}, {experts module: [units]})``."""
    by: dict[str, list[Stack]] = {}
    for s in stacks.values():
        if s.name in status:
            by.setdefault(s.module, []).append(s)
    states: dict[str, Status] = {}
    norms: dict[str, float] = {}
    layers: dict[str, list[str]] = {}
    for module, ss in by.items():
        count = min(s.count for s in ss)
        units = layers[module] = [unit_name(module, e) for e in range(count)]
        live = [s for s in ss if status[s.name] is not Status.FROZEN]
        for e, unit in enumerate(units):
            if not live:
                states[unit] = Status.FROZEN
                continue
            vals = [slices[s.entry][e] for s in live if s.entry in slices]
            if not vals:
                states[unit] = Status.NO_GRAD
                continue
            v = combine_norms(vals)
            norms[unit] = v
            states[unit] = (Status.NON_FINITE_GRAD if not math.isfinite(v) else
                            Status.ZERO_GRAD if v == 0.0 else Status.OK)
    return states, norms, layers


def fill_experts(report, stacks: dict[int, Stack], slices: dict[int, list[float]], router) -> None:
    """Write the per-expert fields of ``report`` (states, norms, layers, router tokens)."""
    report.expert_status, report.expert_grad_norm, report.expert_layers = expert_states(stacks, report.status, slices)
    report.expert_tokens = tokens_by_unit(report.expert_layers, router)
