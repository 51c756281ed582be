"""The six-state decision tree, the user's parameter names (:mod:`.wrappers`), and argument validation."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from itertools import compress, repeat

import torch
from torch import nn

from . import stats
from .foreign import foreign_view, has_hook_api, refuse
from .masters import view_for
from .status import Status
from .wrappers import unwrap, user_names

__all__ = ["classify", "classify_selection", "is_lazy", "lazy_names", "decide", "named_parameters", "unwrap_optimizer", "inner_optimizers", "wrapper_scaler", "as_optimizers", "optimizer_param_ids"]

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def check_model(model) -> nn.Module:
    """Validate the ``model`` argument and return the unwrapped module."""
    if not isinstance(model, nn.Module):
        hint = ""
        if isinstance(model, torch.optim.Optimizer):
            hint = " (an optimizer was passed where the model belongs: GradHealth(model, optimizer))"
        elif callable(model):
            hint = " (a function was passed; pass the nn.Module whose parameters train)"
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}{hint}")
    return unwrap(model)


def named_parameters(model: nn.Module, *, validate: bool = True, meta: bool = False) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` pairs as ``named_parameters()`` gives them (tied ones once), with
    wrapper prefixes removed. Raises ``ValueError`` for an empty model or (unless ``meta``) meta
    parameters."""
    module = check_model(model)
    named = [(n, p) for n, p in module.named_parameters() if not is_lazy(p)]
    entries = list(zip(user_names(module, [n for n, _ in named]), [p for _, p in named]))
    if validate:
        if not entries and not any(is_lazy(p) for p in module.parameters()):
            raise ValueError(
                f"model ({type(module).__name__}) has no parameters: named_parameters() is empty, so "
                "there is nothing to monitor; pass the module that holds the trainable weights"
            )
        for name, p in entries if not meta else ():
            if p.device.type == "meta":
                raise ValueError(
                    f"parameter {name!r} is on the meta device and holds no data; materialise the "
                    "model first (model.to_empty(device=...) and initialise the weights) and then "
                    "monitor it"
                )
    return entries


def is_lazy(p) -> bool:
    """A lazy module's parameter before its first forward (no shape, no data yet)."""
    return nn.parameter.is_lazy(p)


def lazy_names(model: nn.Module) -> list[str]:
    root = unwrap(model)
    return user_names(root, [n for n, p in root.named_parameters() if is_lazy(p)])


def unwrap_optimizer(optimizer):
    """The torch optimizer inside a wrapper that holds it: Accelerate's ``AcceleratedOptimizer``
    (``.optimizer``), Lightning's ``LightningOptimizer`` (``._optimizer``). Anything else is
    returned as given. A wrapper that trains the model through masters (:mod:`.masters`) is
    returned as its :class:`~gradhealth.masters.MasterView`."""
    for _ in range(8):
        view = view_for(optimizer)
        if view is not None:
            return view
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            inner = getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or not isinstance(getattr(inner, "param_groups", None), list):
            break
        optimizer = inner
    if hasattr(optimizer, "__dict__") and inner_optimizers(optimizer):  # (it stands for those it steps)
        return optimizer
    return foreign_view(optimizer) or optimizer  # (an optimizer that is not torch's: :mod:`.foreign`)


def wrapper_scaler(optimizer):
    """The grad scaler an optimizer wrapper (or the first of a list of them) carries: Accelerate's
    under fp16. None without one."""
    for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
        scaler = getattr(opt, "scaler", None)
        if scaler is not None and callable(getattr(scaler, "get_scale", None)):
            return scaler
    return None


def inner_optimizers(optimizer) -> list | None:
    """The optimizers that an optimizer holding others steps in its place (torchtune's
    ``OptimizerInBackward``: one per parameter, in a dict, stepped inside backward; its own
    ``param_groups`` show one of them): the first attribute that is a dict or list of two or more
    objects with ``param_groups``. None for an ordinary optimizer."""
    for value in vars(optimizer).values():
        items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else None
        if items and len(items) > 1 and all(isinstance(getattr(x, "param_groups", None), list) for x in items):
            return items
    return None


def as_optimizers(optimizer, watch: bool = True) -> list:
    """Validate ``optimizer`` (None, one optimizer, or a list/tuple of them; wrappers such as
    Accelerate's ``AcceleratedOptimizer`` are unwrapped, and an optimizer that steps others in its
    place stands for them) into a list of torch optimizers. ``watch``: each must let its steps be
    watched (step hooks: :mod:`.foreign`); a stateless classification only reads ``param_groups``."""
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    items = [unwrap_optimizer(o) for o in items]
    items = [x for o in items for x in (inner_optimizers(o) if hasattr(o, "__dict__") else None) or [o]]
    for i, opt in enumerate(items):
        groups = getattr(opt, "param_groups", None)
        if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups) \
                or (watch and not has_hook_api(opt)):
            where = "optimizer" if len(items) == 1 and not isinstance(optimizer, (list, tuple)) else f"optimizer[{i}]"
            what = f"{where} must be a torch.optim.Optimizer (anything with param_groups and step), a list of them, or None"
            if isinstance(opt, (int, float, str, bytes, bool, nn.Module)) or type(opt).__module__ == "builtins":
                raise TypeError(f"{what}; got {type(opt).__name__}")
            raise TypeError(f"{what}: {refuse(opt)}")  # (another framework's: say whose, and what to pass)
    return items


def optimizer_param_ids(optimizers: Iterable) -> set[int]:
    return {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}


def decide(requires_grad: bool, norm: float | None, in_optimizer: bool) -> Status:
    """The decision tree, given the exact gradient norm (None: no gradient).

    The norm is exact (see :mod:`gradhealth.stats`), so it is non-finite exactly when an element
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
