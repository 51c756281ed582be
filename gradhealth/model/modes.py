"""Which modules compute differently in eval() than in train(): decided from their code (does the
forward read ``training``?) and from what the flag switches (running statistics, a dropout rate
above 0), once per class: what lets a model left in eval() be an error only where it matters
(`gradhealth.judge.guards.ForwardWatch` hooks those modules; the findings of the eval-mode idioms taken
as intended, frozen BatchNorm and ``norm_eval``, are judged there too)."""

from __future__ import annotations

import functools
import inspect
import types

from torch import nn

__all__ = ["reads_training", "mode_matters"]

_MODULE_NAMES = frozenset(dir(nn.Module))


def _code_reads(code: types.CodeType, cls: type, depth: int) -> bool:
    if "training" in code.co_names:  # (self.training, read or written)
        return True
    if any(isinstance(c, types.CodeType) and _code_reads(c, cls, depth) for c in code.co_consts):
        return True  # (a closure, a comprehension)
    for name in code.co_names if depth else ():  # a method of its own class it calls (self._apply_instance_norm)
        if name in _MODULE_NAMES:
            continue
        f = inspect.getattr_static(cls, name, None)
        f = getattr(f, "__func__", f)
        inner = getattr(inspect.unwrap(f), "__code__", None) if callable(f) else None
        if inner is not None and inner is not code and _code_reads(inner, cls, depth - 1):
            return True
    return False


@functools.lru_cache(maxsize=None)
def reads_training(cls: type) -> bool:
    """Does the forward of module class ``cls`` read ``training``: in its own code, a closure or
    comprehension in it, or a method of its class it calls (two calls deep)? Decided from the code,
    once per class: dropout, batch and instance norm, RNNs, attention and any user module that
    branches on ``self.training`` do; Linear, convolutions, GroupNorm, LayerNorm, activations and
    containers do not."""
    try:
        code = getattr(inspect.unwrap(cls.forward), "__code__", None)
        return code is not None and _code_reads(code, cls, 2)
    except Exception:  # (a forward we cannot read: taken as reading it)
        return True


def _rates(module: nn.Module) -> list[float]:
    """The dropout rates ``module`` holds: a float attribute ``p`` or named ``*drop*`` (nn.Dropout's
    ``p``, an RNN's or attention's ``dropout``), a child named ``*drop*``'s ``p``."""
    rates = [v for k, v in vars(module).items() if isinstance(v, float) and (k == "p" or "drop" in k)]
    for k, child in module._modules.items():
        if child is not None and "drop" in k and isinstance(getattr(child, "p", None), float):
            rates.append(child.p)
    return rates


def mode_matters(module: nn.Module) -> bool:
    """Does ``module`` compute differently in eval() than in train()? Its forward reads ``training``
    (:func:`reads_training`) and what the flag switches is on: running statistics it would use in
    place of the batch's (a norm that tracks them), or a dropout rate above 0. A module that reads
    the flag and holds neither statistics nor a rate (its own branch on ``self.training``) does."""
    if not reads_training(type(module)):
        return False
    if getattr(module, "running_mean", None) is not None or getattr(module, "running_var", None) is not None:
        return True
    rates = _rates(module)
    if hasattr(module, "track_running_stats"):  # a norm without running statistics: the batch's either way
        return any(r > 0 for r in rates)
    return any(r > 0 for r in rates) if rates else True


