"""Zero-initialised partners: an exactly zero gradient explained by the weight beside it.

LoRA's ``lora_A`` gets an exactly zero gradient while ``lora_B`` (its partner, zero-initialised) is
still zero: LoRA's start, tolerated by :mod:`.patience` while the partner is trainable; beside a
frozen zero partner it can never change (FROZEN_PARTNER, an error at once). Found by rule (an exactly
zero non-bias weight within two modules above), read only at a check where a zero gradient is new.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Mapping
from itertools import compress, filterfalse, repeat

import torch

from ..base.findings import Finding, FindingKind
from ..base.naming import ROOT, agree, module_of
from ..base.status import Status
from ..measure.stats import fetch, plan_groups

__all__ = ["zero_partners", "frozen_partner"]


def _ancestors(name: str, levels: int = 2) -> list[str]:
    """The parameter's module and up to ``levels`` modules above it."""
    out, mod = [], module_of(name)
    for _ in range(levels + 1):
        out.append(mod)
        if mod == ROOT:
            break
        mod = mod.rpartition(".")[0] or ROOT
    return out


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_WEIGHTS: dict[int, tuple] = {}


def _weights(names: list[str]) -> tuple[list[int], dict[str, int]]:
    """The indices of ``names`` that are not biases, and each name's index (kept per list of names)."""
    kept = _WEIGHTS.get(id(names))
    if kept is None or kept[0] is not names:
        from ..base.report import evict

        evict(_WEIGHTS, 8)
        kept = _WEIGHTS[id(names)] = (names, [i for i, n in enumerate(names) if not n.endswith("bias")],
                                      {n: i for i, n in enumerate(names)})
    return kept[1], kept[2]


def zero_partners(candidates: list[str], names: list[str], params: list, frozen: bool = False) -> set[str]:
    """The candidates (ZERO_GRAD parameters) that sit next to a trainable weight that is exactly
    zero: within two modules above their own (``q.lora_A.default.weight`` and
    ``q.lora_B.default.weight`` under ``q``). Biases do not count as partners (many start at zero).
    ``frozen``: next to a frozen weight that is exactly zero instead. One fused max-abs reduction
    per (device, dtype) and one transfer."""
    if not candidates:
        return set()
    prefixes = {a for n in candidates for a in _ancestors(n)}
    cand = set(candidates)
    under = lambda n, a: a == ROOT or n.startswith(a + ".")  # noqa: E731
    # (picked in C, parameter by parameter: the model's non-bias weights, trainable or frozen as
    # asked, not candidates, under a prefix, not empty)
    base, index = _weights(names)
    near = filterfalse(cand.__contains__, compress(map(names.__getitem__, base), map(
        operator.is_not, map(_REQUIRES_GRAD, map(params.__getitem__, base)), repeat(frozen))))
    if ROOT not in prefixes:
        near = filter(operator.methodcaller("startswith", tuple(a + "." for a in prefixes)), near)
    near = list(near)
    held = list(map(params.__getitem__, map(index.__getitem__, near)))
    sizes = list(map(torch.Tensor.numel, held))
    siblings, tensors = list(zip(compress(near, sizes), repeat(None))), list(compress(held, sizes))
    if not siblings:
        return set()
    maxima: list = [None] * len(tensors)
    with torch.no_grad():  # (the parameters themselves: no detached view of each)
        for _, _, idx in plan_groups(tensors):
            for i, m in zip(idx, torch._foreach_norm([tensors[i] for i in idx], math.inf)):
                maxima[i] = m
    zero = {n for (n, _), v in zip(siblings, fetch(maxima)) if v == 0.0}
    if not zero:
        return set()
    return {c for c in candidates if any(under(z, a) for a in _ancestors(c) for z in zero)}


def frozen_partner(status: Mapping[str, Status], names: Collection[str], step: int) -> list[Finding]:
    """FROZEN_PARTNER: exactly zero gradients beside a frozen weight that is exactly zero (a LoRA
    B frozen at its zero init while A trains): nothing can move that weight, so they stay zero."""
    from ..base.report import describe_names  # (as in persist: imported where used)

    return [Finding(FindingKind.FROZEN_PARTNER, f"{describe_names(status, names)} got {agree(names, 'exactly zero gradients', 'an exactly zero gradient')} "
                    f"at step {step}: {agree(names, 'their', 'its')} zero-initialised partner is frozen: nothing can move it "
                    f"off zero, so {agree(names, 'they', 'it')} will never get a gradient (a LoRA B frozen at its zero init "
                    "while A trains; LoRA-FA freezes A, the random one, and trains B). Unfreeze the zero one, or "
                    f"freeze {agree(names, 'these', 'this')} instead", params=tuple(n for n in status if n in names), step=step,
                    data={"cause": "frozen_zero_partner"})]
