"""Which optimizers a monitor was given: one, a list, or None, validated; the torch optimizer inside a
wrapper (Accelerate's, Lightning's); one that steps others in its place standing for them; one that
trains through master copies (:mod:`.masters`) or is not torch's (:mod:`.foreign`) seen through a view."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from .foreign import foreign_view, has_hook_api, refuse
from .masters import view_for

__all__ = ["unwrap_optimizer", "inner_optimizers", "wrapper_scaler", "as_optimizers", "optimizer_param_ids"]


def unwrap_optimizer(optimizer):
    """The torch optimizer inside a wrapper that holds it: Accelerate's ``AcceleratedOptimizer``
    (``.optimizer``), Lightning's ``LightningOptimizer`` (``._optimizer``). Anything else is
    returned as given. A wrapper that trains the model through masters (:mod:`.masters`) is
    returned as its :class:`~gradhealth.model.masters.MasterView`."""
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
