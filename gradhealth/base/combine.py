"""Norms combined on the host, in plain Python: the L2 norm of several norms (NaN kept), and each
module's own gradient norm from its parameters' (a few hundred floats: cheaper than any tensor
round trip). Used by reports, metrics and sinks alike, so they agree on nan vs inf."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from itertools import compress, repeat, starmap

__all__ = ["combine_norms", "module_norms"]


def combine_norms(values) -> float:
    """The L2 norm of several norms: ``hypot``, but NaN when any is NaN (``hypot`` says inf when an
    inf and a NaN meet). Used by reports, metrics and sinks alike, so they agree on nan vs inf."""
    values = values if isinstance(values, list) else list(values)
    if not values:
        return 0.0
    h = values[0] if len(values) == 1 else math.hypot(*values)
    if h == math.inf and any(v != v for v in values):  # (only then can a NaN hide)
        return math.nan
    return h


def module_norms(with_grad: Sequence[int], norms: Sequence[float], module_of: Sequence[int],
                 modules: Sequence[str], runs: Sequence[slice] | None = None) -> dict[str, float]:
    """Each module's own gradient norm from its parameters' (entry ``i`` belongs to module
    ``modules[module_of[i]]``): squares summed in float64, in plain Python (a few hundred floats:
    cheaper than any tensor round trip); a module with a norm outside [1e-150, 1e150] (a square
    would underflow or overflow) or a NaN is combined by :func:`combine_norms` instead.

    ``runs`` (each module's consecutive entries as a slice, :attr:`ParamView.module_runs`): one
    ``hypot`` per module, read off slices in C (an entry without a gradient counts 0; a module
    without any is left out), and :func:`combine_norms` where that came out inf."""
    if runs is not None:
        full, keep = norms, None
        if len(norms) != len(module_of):  # (a frozen base model: its entries hold no gradient)
            full, has = [0.0] * len(module_of), [False] * len(module_of)
            deque(map(full.__setitem__, with_grad, norms), maxlen=0)
            deque(map(has.__setitem__, with_grad, repeat(True)), maxlen=0)
            keep = list(map(any, map(has.__getitem__, runs)))
        values = list(starmap(math.hypot, map(full.__getitem__, runs)))
        if math.inf in values:  # an inf module may hide a NaN: combine_norms says which
            values = [combine_norms(full[r]) if v == math.inf else v for v, r in zip(values, runs)]
        return dict(zip(modules, values) if keep is None else compress(zip(modules, values), keep))
    acc: dict[int, float] = {}
    odd: set[int] = set()
    for i, v in zip(with_grad, norms):
        m = module_of[i]
        acc[m] = acc.get(m, 0.0) + v * v
        if not 1e-150 <= v <= 1e150 and v != 0.0:  # NaN compares False too
            odd.add(m)
    sqrt = math.sqrt
    out = {modules[m]: sqrt(q) for m, q in sorted(acc.items())}
    for m in odd:
        out[modules[m]] = combine_norms([v for i, v in zip(with_grad, norms) if module_of[i] == m])
    return out
