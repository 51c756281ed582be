"""Where a parameter's gradient lives: ``.grad``, else a buffer the training framework keeps.

Megatron-Core's DistributedDataParallel (and what is built on it: NeMo, Megatron-Bridge) adds each
gradient into a contiguous fp32 buffer from a hook on the parameter's gradient accumulator, exposes
the parameter's slice of it as ``param.main_grad`` and sets ``param.grad = None``; its optimizers
read ``main_grad``. A parameter with no ``.grad`` but a ``main_grad`` tensor has its gradient there,
and every verdict, norm and clip reads it from there (the buffer is zeroed, not freed, between
steps: a parameter the loss does not reach shows a zero gradient, ``ZERO_GRAD``).
"""

from __future__ import annotations

import operator
from itertools import repeat

from torch import Tensor

__all__ = ["grad_of", "grads_of"]

_GRAD = operator.attrgetter("grad")


def grad_of(p) -> Tensor | None:
    g = p.grad
    if g is None:
        g = getattr(p, "main_grad", None)
        return g if isinstance(g, Tensor) else None
    return g


def grads_of(params) -> list:
    """``[grad_of(p) for p in params]``, at the speed of reading ``.grad`` when every one is there."""
    grads = list(map(_GRAD, params))
    if any(map(operator.is_, grads, repeat(None))):
        grads = [g if g is not None else grad_of(p) for g, p in zip(grads, params)]
    return grads
