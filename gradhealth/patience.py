"""Transient or persistent: how long each parameter has gone without a usable gradient.

A NO_GRAD or ZERO_GRAD status is exact at every check, but not every one is a bug: LoRA's
``lora_A`` gets an exactly zero gradient at the first step because ``lora_B`` starts at zero, an
expert of a mixture-of-experts layer gets no token in some batches, an auxiliary head is used every
other step. ``Streaks`` counts consecutive checks without a usable gradient per parameter; the
policy tolerates fewer than ``grad_patience`` of them (info) and counts more as an error.
``zero_partners`` recognises the zero-initialised-partner start (a sibling weight that is exactly
zero), read only at a check where a parameter's zero gradient is new.
"""

from __future__ import annotations

import math

import torch

from .naming import ROOT, module_of
from .stats import fetch, plan_groups
from .status import Status

__all__ = ["Streaks", "zero_partners"]

_NO_USABLE = (Status.NO_GRAD, Status.ZERO_GRAD)


class Streaks:
    def __init__(self) -> None:
        self.count: dict[str, int] = {}

    def update(self, status: dict[str, Status], not_ok: list[str]) -> dict[str, int]:
        """Count this check; return the streak of every NO_GRAD / ZERO_GRAD parameter judged now.

        Parameters judged with a usable gradient (or frozen, or another state) start again at 0;
        those not judged at this check (another optimizer's) keep their count.
        """
        now = {n: self.count.get(n, 0) + 1 for n in not_ok if status[n] in _NO_USABLE}
        kept = {n: c for n, c in self.count.items() if n not in status}
        self.count = {**kept, **now}
        return now

    def state_dict(self) -> dict[str, int]:
        return dict(self.count)

    def load_state_dict(self, state: dict) -> None:
        self.count = {str(n): int(c) for n, c in state.items()}


def _ancestors(name: str, levels: int = 2) -> list[str]:
    """The parameter's module and up to ``levels`` modules above it."""
    out, mod = [], module_of(name)
    for _ in range(levels + 1):
        out.append(mod)
        if mod == ROOT:
            break
        mod = mod.rpartition(".")[0] or ROOT
    return out


def zero_partners(candidates: list[str], names: list[str], params: list) -> set[str]:
    """The candidates (ZERO_GRAD parameters) that sit next to a trainable weight that is exactly
    zero: within two modules above their own (``q.lora_A.default.weight`` and
    ``q.lora_B.default.weight`` under ``q``). Biases do not count as partners (many start at zero).
    One fused max-abs reduction per (device, dtype) and one transfer."""
    if not candidates:
        return set()
    prefixes = {a for n in candidates for a in _ancestors(n)}
    cand = set(candidates)
    under = lambda n, a: a == ROOT or n.startswith(a + ".")  # noqa: E731
    siblings = [(n, p) for n, p in zip(names, params)
                if n not in cand and p.requires_grad and not n.endswith("bias") and p.numel()
                and any(under(n, a) for a in prefixes)]
    if not siblings:
        return set()
    tensors = [p.detach() for _, p in siblings]
    maxima: list = [None] * len(tensors)
    for _, _, idx in plan_groups(tensors):
        for i, m in zip(idx, torch._foreach_norm([tensors[i] for i in idx], math.inf)):
            maxima[i] = m
    zero = {n for (n, _), v in zip(siblings, fetch(maxima)) if v == 0.0}
    if not zero:
        return set()
    return {c for c in candidates if any(under(z, a) for a in _ancestors(c) for z in zero)}
