"""Mask before the operation: reductions and domain guards whose gradients never hold NaN.

Masking *after* a division (``torch.where(valid, x / d, 0)``) hides the bad value in forward but
not in backward: the discarded branch still gets a zero upstream gradient, and 0 * inf is NaN.
Each helper here first replaces invalid inputs by a harmless value, computes, and then selects,
so invalid positions give exact zeros (or the chosen fill) with exactly zero gradient, and valid
positions give the plain operation's value and gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .base.errors import EmptyValidSetError
from .options import check_tensor

__all__ = ["masked_mean", "safe_div", "safe_log", "safe_sqrt", "safe_where", "EMPTY_POLICIES"]

EMPTY_POLICIES = ("zero", "nan", "raise")


def _as_bool_mask(mask, like: Tensor, what: str = "mask") -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor of bools; got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        mask = mask != 0
    try:
        return torch.broadcast_to(mask, torch.broadcast_shapes(mask.shape, like.shape))
    except RuntimeError:
        raise ValueError(
            f"{what} of shape {tuple(mask.shape)} does not broadcast against values of shape {tuple(like.shape)}"
        ) from None


def masked_mean(values: Tensor, mask: Tensor, *, dim=None, empty: str = "zero") -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is True, with the empty case explicit.

    Args:
        dim: reduce over these dims (None: all).
        empty: what an empty selection gives: ``"zero"`` (0, zero gradient), ``"nan"`` (NaN in the
            result, still zero gradient), or ``"raise"`` ([EmptyValidSetError][gradhealth.EmptyValidSetError]; this one
            costs a host synchronisation to know).
    """
    if empty not in EMPTY_POLICIES:
        raise ValueError(f"empty must be one of 'zero', 'nan', 'raise'; got {empty!r}")
    if not isinstance(values, Tensor):
        raise TypeError(f"values must be a torch.Tensor; got {type(values).__name__}")
    m = _as_bool_mask(mask, values)
    values = torch.broadcast_to(values, m.shape)
    picked = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    count = m.sum(dim=dim) if dim is not None else m.sum()
    total = picked.sum(dim=dim) if dim is not None else picked.sum()
    nonempty = count > 0
    if empty == "raise" and not bool(nonempty.all()):
        where = "" if dim is None else f" along dim={dim} ({int((~nonempty).sum())} of {nonempty.numel()} slices)"
        raise EmptyValidSetError(
            f"masked_mean: the mask selected nothing{where}; the mean of an empty set is undefined. "
            "Skip this batch, or choose empty='zero' (contributes 0) or empty='nan'"
        )
    mean = total / count.clamp(min=1).to(total.dtype)
    fill = torch.zeros((), dtype=mean.dtype, device=mean.device) if empty == "zero" else torch.full(
        (), float("nan"), dtype=mean.dtype, device=mean.device
    )
    return torch.where(nonempty, mean, fill)


def safe_div(numerator: Tensor, denominator: Tensor, valid: Tensor | None = None) -> Tensor:
    """``numerator / denominator`` where valid, 0 elsewhere, with zero gradient elsewhere.

    Default ``valid``: finite numerator, finite and nonzero denominator (NaN is not "nonzero").
    """
    for name, value in (("numerator", numerator), ("denominator", denominator)):
        if not isinstance(value, (Tensor, int, float)) or isinstance(value, bool):
            raise TypeError(f"safe_div: {name} must be a torch.Tensor or a number; got {type(value).__name__}")
    num = torch.as_tensor(numerator)
    den = torch.as_tensor(denominator, device=num.device)
    if valid is None:
        valid = torch.isfinite(num) & torch.isfinite(den) & (den != 0)
    shape = torch.broadcast_shapes(num.shape, den.shape)
    valid = _as_bool_mask(valid, torch.empty(shape, device="meta"), "valid")
    one = torch.ones((), dtype=den.dtype, device=den.device)
    zero = torch.zeros((), dtype=num.dtype, device=num.device)
    quotient = torch.where(valid, num, zero) / torch.where(valid, den, one)
    return torch.where(valid, quotient, torch.zeros((), dtype=quotient.dtype, device=quotient.device))


def safe_log(x: Tensor, valid: Tensor | None = None, fill: float = 0.0) -> Tensor:
    """``log(x)`` where valid (default: finite and > 0), ``fill`` elsewhere, zero gradient there."""
    check_tensor("safe_log: x", x)
    if valid is None:
        valid = torch.isfinite(x) & (x > 0)
    valid = _as_bool_mask(valid, x, "valid")
    out = torch.log(torch.where(valid, x, torch.ones((), dtype=x.dtype, device=x.device)))
    return torch.where(valid, out, torch.full((), fill, dtype=out.dtype, device=out.device))


def safe_sqrt(x: Tensor, valid: Tensor | None = None) -> Tensor:
    """``sqrt(x)`` where valid (default: finite and > 0), 0 elsewhere, with zero gradient there.

    0 itself is excluded by default: sqrt's derivative is infinite there; its value, 0, is kept.
    """
    check_tensor("safe_sqrt: x", x)
    if valid is None:
        valid = torch.isfinite(x) & (x > 0)
    valid = _as_bool_mask(valid, x, "valid")
    out = torch.sqrt(torch.where(valid, x, torch.ones((), dtype=x.dtype, device=x.device)))
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def safe_where(condition: Tensor, fn: Callable[[Tensor], Tensor], input: Tensor, other, *, safe_value: float = 0.0) -> Tensor:
    """``where(condition, fn(input), other)`` with ``fn`` evaluated only where ``condition`` holds.

    The "double where": ``fn`` sees ``safe_value`` at the other positions, so an overflow or a
    singular derivative there cannot reach the gradient. ``safe_value`` must lie in ``fn``'s domain.
    """
    check_tensor("safe_where: input", input)
    if not callable(fn):
        raise TypeError(f"safe_where: fn must be a callable (e.g. torch.exp); got {type(fn).__name__}")
    cond = _as_bool_mask(condition, input, "condition")
    guarded = torch.where(cond, input, torch.full((), safe_value, dtype=input.dtype, device=input.device))
    other = torch.as_tensor(other, dtype=input.dtype, device=input.device) if not isinstance(other, Tensor) else other
    return torch.where(cond, fn(guarded), other)
