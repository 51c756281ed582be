"""Where a parameter's gradient lives: ``.grad``, else a buffer the training framework keeps.

Megatron-Core's DistributedDataParallel (and what is built on it: NeMo, Megatron-Bridge) adds each
gradient into a contiguous fp32 buffer from a hook on the parameter's gradient accumulator, exposes
the parameter's slice of it as ``param.main_grad`` and sets ``param.grad = None``; its optimizers
read ``main_grad``. A parameter with no ``.grad`` but a ``main_grad`` tensor has its gradient there,
and every verdict, norm and clip reads it from there (the buffer is zeroed, not freed, between
steps: a parameter the loss does not reach shows a zero gradient, ``ZERO_GRAD``).

DeepSpeed's ZeRO optimizers (and its bf16 optimizer) move each gradient into their own flat
buffers at the end of backward and keep ``.grad`` None: from backward until ``engine.step()`` a
parameter's gradient is its fragment of this rank's partition (ZeRO-1/2: ``_hp_mapping``; an empty
tensor on a rank whose partition holds none of it) or its ZeRO-3 partition. Such a gradient is a
*shard* (:func:`is_fragment`): across ranks the norms are summed as squares, like FSDP's. ZeRO
reduces a gradient for every parameter it trains, so one the loss does not reach is ``ZERO_GRAD``.
"""

from __future__ import annotations

import operator
from itertools import chain, compress, repeat

import torch
from torch import Tensor

__all__ = ["grad_of", "grads_of", "grads_there", "is_fragment"]

_GRAD = operator.attrgetter("grad")


def grad_of(p) -> Tensor | None:
    g = p.grad
    if g is None:
        g = getattr(p, "main_grad", None)
        if isinstance(g, Tensor):
            return g
        return _fragment(p) if is_fragment(p) else None
    return g


def is_fragment(p) -> bool:
    """Is ``p``'s gradient kept as a ZeRO fragment or partition (see the module's docstring)?"""
    return hasattr(p, "_hp_mapping") or (hasattr(p, "ds_id") and hasattr(p, "_z3_optimizer"))


def _fragment(p) -> Tensor | None:
    mapping = getattr(p, "_hp_mapping", _MISSING)
    if mapping is not _MISSING:
        if mapping is None:  # this rank's partition holds none of it
            return torch.empty(0, dtype=torch.float32, device=p.device)
        try:
            g = mapping.get_lp_grad_fragment(p._index_in_param_group)
        except (ValueError, KeyError, IndexError, TypeError):  # (between engine.step() and the next backward)
            return None
        if g is None:
            return None
        address = mapping.lp_fragment_address
        if g.numel() == p.numel() and address.numel != p.numel():  # (a bf16 optimizer's whole buffer: its slice)
            g = g.reshape(-1).narrow(0, address.start, address.numel)
        return g
    try:
        return p._z3_optimizer.get_local_fp32_grad_for_param(p)
    except (KeyError, AttributeError, ValueError):
        return None


_MISSING = object()


def grads_of(params) -> list:
    """``[grad_of(p) for p in params]``, at the speed of reading ``.grad`` when every one is there,
    or when those without one (a frozen base model's) hold no other kind of gradient either."""
    grads = list(map(_GRAD, params))
    if any(map(operator.is_, grads, repeat(None))):
        bare = list(compress(params, map(operator.is_, grads, repeat(None))))
        # (each attribute over every bare parameter, in C: ``bare`` once per attribute beside it, repeated)
        if any(map(hasattr, bare * len(_ELSEWHERE), chain.from_iterable(map(repeat, _ELSEWHERE, repeat(len(bare)))))):
            grads = [g if g is not None else grad_of(p) for g, p in zip(grads, params)]
    return grads


def grads_there(params) -> tuple[list, list[bool] | None]:
    """``grads_of(params)`` and which of them are there (None where every one is): what a check
    reads first, in one pass where every gradient is in ``.grad``."""
    grads = list(map(_GRAD, params))
    if not any(map(operator.is_, grads, _NONES)):
        return grads, None
    there = list(map(operator.is_not, grads, _NONES))
    bare = list(compress(params, map(operator.not_, there)))
    n = len(bare)
    if any(map(hasattr, bare * len(_ELSEWHERE), _ASKED.get(n) or _asked(n))):
        grads = [g if g is not None else grad_of(p) for g, p in zip(grads, params)]
        there = list(map(operator.is_not, grads, _NONES))
    return grads, there


def _asked(n: int) -> tuple:
    """Each attribute of ``_ELSEWHERE`` ``n`` times (beside ``n`` bare parameters once per attribute)."""
    out = _ASKED[n] = tuple(chain.from_iterable(map(repeat, _ELSEWHERE, repeat(n))))
    return out


_NONES, _ASKED = repeat(None), {}
#: the attributes one of which a parameter holds where its gradient is kept outside ``.grad``
#: (Megatron's ``main_grad``, a ZeRO fragment's mapping or partition: see :func:`grad_of`)
_ELSEWHERE = ("main_grad", "_hp_mapping", "ds_id")
