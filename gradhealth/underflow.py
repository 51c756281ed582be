"""Exactly zero gradients that are underflow: a gradient that shrinks through the layers of a deep
stack (saturated tanh or sigmoid, no normalisation, no residual path) reaches the first layers
below float32's smallest number, and every element there is 0. It reads as ZERO_GRAD, like a cut
path or a dead ReLU, but the layers after those get gradients of 1e-38 and the like, which no
healthy run has; and the units at the edge come and go, zero at one check and 1e-38 at the next,
which is not skipping (:data:`.patience.FAINT`: such a unit is no proxy for the persistence rule).
Said as VANISHING_GRAD beside the ZERO_GRAD errors, with what to do."""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping
from itertools import compress, repeat

from .findings import Finding, FindingKind
from .naming import agree
from .patience import FAINT
from .status import Status

__all__ = ["underflow"]


def underflow(status: Mapping[str, Status], errors: Collection[str], grad_norm: Mapping[str, float],
              gaps: Mapping[str, int], step: int) -> list[Finding]:
    """VANISHING_GRAD (cause ``underflow``) when parameters the persistence rule counts as errors got
    exactly zero gradients while others got non-zero gradients below ``FAINT``."""
    norms = grad_norm.values()
    if not errors or not norms or min(norms) >= FAINT:  # (the usual check: one pass in C)
        return []
    zero = [n for n in filter(errors.__contains__, status) if status[n] is Status.ZERO_GRAD]
    faint = list(compress(grad_norm, map(operator.and_, map(operator.lt, norms, repeat(FAINT)),
                                         map(operator.gt, norms, repeat(0.0)))))
    if not zero or not faint:
        return []
    from .report import describe_names  # (the report module imports the findings' modules)

    top = max(map(grad_norm.__getitem__, faint))
    where = describe_names(status, faint, most=4)  # (the first few: where the gradient fades)
    return [Finding(
        FindingKind.VANISHING_GRAD,
        f"{describe_names(status, zero)} got exactly zero gradients at step {step} (for {max(gaps.get(n, 1) for n in zero)} "
        f"checks in a row), and {where} got {agree(faint, 'gradients', 'a gradient')} of at most "
        f"{top:.3g}: the gradient shrinks through the layers until it underflows float32 (below about 1e-38 every "
        "element is 0): saturated tanh or sigmoid units, or a deep stack without normalisation or residual "
        "connections. Use an initialisation that keeps the scale (Xavier for tanh, Kaiming for ReLU), add "
        "normalisation layers or residual connections; one backward in float64 shows the gradients that are there",
        params=tuple(zero), level="warning", step=step, data={"cause": "underflow", "faint": {n: grad_norm[n] for n in faint[:8]}})]
