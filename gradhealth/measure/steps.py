"""One optimizer step's numbers: ``StepStats`` (host facts, and device numbers until a check
fetches them), and the grad scaler's skip flag of a fused step, which rides with those numbers."""

from __future__ import annotations

import math
import operator
from itertools import repeat
from collections import deque
from typing import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["StepStats", "found_inf", "with_found_inf", "unarmed_skip"]


@dataclass
class StepStats:
    """One optimizer step: host facts, and device numbers until the monitor fetches them.

    After :meth:`fetched`, ``changed`` is 1.0 / 0.0 per parameter (nan: undecided this step),
    ``update`` and ``param`` are ||Δθ|| and ||θ|| (nan when not measured this step), and ``lr_zero``
    says whether the parameter's learning rate was 0 at this step (``"new"``) and at the step before
    too (``"again"``), or neither (``""``).
    """

    indices: list[int]
    #: [device change flags (or counts) of `flag_pos`, update norms, param norms]: one tensor, or
    #: tensors whose concatenation is that (a change test's 0-d counts, read back as they are)
    packed: Tensor | list[Tensor]
    touched: list[bool] | None = None  # None: all touched
    flag_pos: list[int] = field(default_factory=list)  # positions decided on the device
    sure: list[bool] = field(default_factory=list)  # a device flag of 0 is a decision (not undecided)
    measured: bool = False
    lr_zero: list[str] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)
    update: list[float] = field(default_factory=list)
    param: list[float] = field(default_factory=list)
    scaler_flag: bool = False  # the last packed value is a grad scaler's found_inf for this step
    decided: bool = False  # (after fetched) some parameter was decided, changed or not
    skipped: bool = False  # (after fetched) that flag was set: the step skipped itself
    skips: int = 0  # (after fetched) how many steps skipped themselves (several for unarmed steps)
    cause: dict | None = None  # what an optimizer that skipped the step itself said (:mod:`gradhealth.model.masters`)
    on_skip: Callable | None = None  # (after fetched, when skipped) undoes what the step's hook counted

    @property
    def pieces(self) -> list[Tensor]:
        """The device numbers as a list of tensors (:attr:`packed`)."""
        return self.packed if isinstance(self.packed, list) else [self.packed]

    @property
    def size(self) -> int:
        """How many numbers :attr:`packed` holds."""
        return sum(map(Tensor.numel, self.packed)) if isinstance(self.packed, list) else self.packed.numel()

    def fetched(self, values: list[float]) -> None:
        if self.scaler_flag:
            self.skips, values = round(values[-1]), values[:-1]
            self.skipped = self.skips > 0
            if self.skipped and self.on_skip is not None:
                self.on_skip()
        n, f = len(self.indices), len(self.flag_pos)
        # touched: undecided unless tested; untouched: unchanged
        changed = [math.nan] * n if self.touched is None else list(map(_UNTESTED.__getitem__, map(bool, self.touched)))
        # a flag > 0 changed, 0 unchanged where that is sure, else (NaN) undecided: Packed.changed; in C
        flags = values[:f]
        decided = list(map(_DECISION.__getitem__, zip(map(operator.gt, flags, repeat(0.0)),
                                                     map(operator.and_, map(operator.eq, flags, repeat(0.0)), map(bool, self.sure)))))
        if f == n and self.flag_pos == list(range(n)):
            changed = decided
        else:
            deque(map(changed.__setitem__, self.flag_pos, decided), maxlen=0)  # (scattered in C)
        self.changed = changed
        self.decided = bool(self.flag_pos) or self.touched is not None
        if self.measured:
            self.update, self.param = list(values[f : f + n]), list(values[f + n : f + 2 * n])
        else:
            self.update = self.param = [math.nan] * n

    def triple(self) -> list[float]:
        """[update (n), param (n), changed (n)]: the layout the cross-rank reduction carries."""
        return list(self.update) + list(self.param) + list(self.changed)

    def set_triple(self, values: list[float]) -> None:
        n = len(self.indices)
        self.update, self.param, self.changed = values[:n], values[n : 2 * n], values[2 * n :]
        self.decided = any(c == c for c in self.changed)  # every rank tests the same steps


_UNTESTED = {True: math.nan, False: 0.0}  # touched by the step (undecided unless tested), or not (unchanged)
_DECISION = {(True, False): 1.0, (False, True): 0.0, (False, False): math.nan}  # (> 0, == 0 and sure)


def found_inf(opt) -> Tensor | None:
    """1.0 / 0.0 (float64, shape [1], on the device): did a grad scaler skip this fused step?"""
    flag = getattr(opt, "found_inf", None)
    if isinstance(flag, Tensor) and getattr(opt, "_step_supports_amp_scaling", False):
        return (flag.detach() > 0).to(torch.float64).reshape(1)
    return None


def with_found_inf(opt, stats: StepStats) -> StepStats:
    """A fused optimizer under a grad scaler runs its step (and its step hooks) even when the scaler
    found inf and skips inside the kernel: the scaler's flag rides with the step's numbers (no host
    sync), so the check treats that step as skipped, not as one that changed nothing."""
    flag = found_inf(opt)
    if flag is not None:
        stats.packed = [*stats.pieces, flag.to(stats.pieces[0].device)]
        stats.scaler_flag = True
        if getattr(opt, "skips_in_a_row", 0):  # (a MasterView whose wrapper skipped this step)
            stats.cause = opt.skip_info()
    return stats


def unarmed_skip(opt, pending: list[StepStats], mine: StepStats | None) -> StepStats | None:
    """A step no check armed (``every_n_steps``): its grad scaler's skip adds up on the device in one
    entry of ``pending`` (no indices), ``mine``, read with the next check: a skipped step did not run
    either. Returns that entry (``mine`` unchanged when the step has no scaler flag)."""
    flag = found_inf(opt)
    if flag is None:
        return mine
    if mine is None or not any(u is mine for u in pending):
        mine = StepStats([], flag, scaler_flag=True)
        pending.append(mine)
    else:
        mine.packed = mine.packed + flag.to(mine.packed.device)
    if getattr(opt, "skips_in_a_row", 0):
        mine.cause = opt.skip_info()
    return mine
