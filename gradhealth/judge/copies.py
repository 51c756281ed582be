"""Parameters in no optimizer that get no gradient: target networks, EMA and momentum copies.

DQN's ``q_net_target``, SAC's and TD3's ``critic_target`` / ``actor_target``, MoCo's and BYOL's
momentum encoders, an EMA copy kept inside the model: trainable tensors that no backward reaches
and no optimizer holds, moved by a Polyak average or a periodic hard copy under ``no_grad``. Their
NO_GRAD is exact and by design: nothing that should move them by gradient is there (an optimizer
that holds a parameter without a gradient, or a gradient no optimizer applies, stays the error it
is). They are tolerated, apart from the persistence rule, with one info finding that names them
and says what was seen: whether they were written outside the optimizer since the monitor first
saw them.

What is seen: each tensor's version counter, at every check (every in-place write bumps it:
``copy_``, ``mul_``/``add_``, ``lerp_``, the ``torch._foreach_*`` of timm's and torch's EMA,
``load_state_dict``) and its storage (``p.data = ...``, MoCo's and BYOL's update, replaces it): read
in C over these tensors only, no device op. A write through ``p.data`` (Stable-Baselines3's
``polyak_update``: ``target.data.mul_(1 - tau)``) bumps neither: for it, the tensors' norms, one
fused reduction and one transfer, at the 1st, 2nd, 4th, 8th ... check after they were first seen
(never in the deferred mode, which does not synchronise). Nothing is looked at once a write was seen.
"""

from __future__ import annotations

import logging
import operator
from itertools import compress, repeat

import torch

from ..base.distributed import to_local
from ..base.findings import Finding, FindingKind
from ..base.status import Status
from ..measure.stats import fetch, plan_groups

_NEW = object.__new__

__all__ = ["Copies"]

log = logging.getLogger("gradhealth")

_VERSION = operator.attrgetter("_version")
_STORAGE = operator.methodcaller("data_ptr")


class Copies:
    """The NO_GRAD parameters in no optimizer, and what was seen of them (kept per set of names)."""

    def __init__(self) -> None:
        self.names: frozenset[str] = frozenset()
        self.params: list = []
        self.ordered: tuple[str, ...] = ()  # their names, in the model's order
        self.marks: list = []  # their version counters, then their storages, at the last look
        self.first: int | None = None  # the step at which this set was first seen
        self.moved: int | None = None  # the first step by which a write was seen
        self.count = 0  # checks since this set was first seen (that look at values: see :meth:`see`)
        self.values: list | None = None  # their norms when first seen
        self._words: str = ""
        self._said: Finding | None = None  # the last finding made (made again only when what it says changes)

    def pick(self, report) -> frozenset[str]:
        """The names of ``report`` that are NO_GRAD and in none of the monitor's optimizers."""
        in_opt, not_ok, status = report.in_optimizer, report.not_ok, report.status
        if in_opt is None:  # (no optimizer given: nothing says what should move them)
            return frozenset()
        if not_ok is None:
            not_ok = [n for n, s in status.items() if s is not Status.OK and s is not Status.FROZEN]
        if not not_ok:
            return frozenset()
        none = list(compress(not_ok, map(operator.is_, map(status.__getitem__, not_ok), repeat(Status.NO_GRAD))))
        return frozenset(compress(none, map(operator.is_, map(in_opt.get, none), repeat(False)))) if none else frozenset()

    def see(self, names: frozenset[str], status: dict, all_names: list[str], params: list, step: int,
            look: bool = True) -> Finding | None:
        """The info finding for these copies at this check (``all_names`` and ``params``: the
        monitor's view), after looking at whether they were written since they were first seen
        (``look``: the values too, where the schedule says so; False: no device op, no sync)."""
        if not names:
            return None
        if names != self.names:  # (a new set: looked at from now)
            self.names, self.first, self.moved, self.count, self._words = names, step, None, 0, ""
            inside = list(map(names.__contains__, all_names))
            self.params, self.ordered = list(compress(params, inside)), tuple(compress(all_names, inside))
            self.marks = [*map(_VERSION, self.params), *map(_STORAGE, self.params)]
            self.values = self._values() if look else None
        elif self.moved is None:
            ps = self.params
            if [*map(_VERSION, ps), *map(_STORAGE, ps)] != self.marks:
                self.moved, self._words = step, ""
            elif look:
                self.count = count = self.count + 1
                if not count & (count - 1):  # (the 1st, 2nd, 4th, 8th ... check since)
                    values = self._values()
                    if self.values is not None and values != self.values:
                        self.moved, self._words = step, ""
                    self.values = self.values if self.values is not None else values
        if not self._words:  # (emptied at any change of the set or of what was seen: the finding made again)
            self._words, self._said = self._say(status, names), None
            log.info("gradhealth step %d: %s", step, self._words)  # (said once per change of what was seen)
        last = self._said
        if last is not None:  # (its words and names are the current ones)
            # the same finding at this step (a frozen dataclass: its fields set as its __init__ sets them, which
            # on these, already checked, changes nothing; a fresh ``data``, as its default is)
            f = _NEW(Finding)
            f.__dict__.update(last.__dict__, step=step, data={})
            return f
        self._said = Finding(FindingKind.TARGET_COPY, self._words, params=self.ordered, level="info", step=step)
        return self._said

    def _values(self) -> list[float]:
        """The copies' L2 norms (accumulated in float64): one fused reduction per (device, dtype),
        one transfer."""
        # (a DTensor's local shard: a DTensor op here would hide a collective one rank decided on)
        tensors = [t for t in map(to_local, map(torch.Tensor.detach, self.params)) if t.numel() and t.is_floating_point()]
        if not tensors:
            return []
        out: list = [None] * len(tensors)
        with torch.no_grad():
            for _, dtype, idx in plan_groups(tensors):
                wide = {} if dtype == torch.float64 else {"dtype": torch.float64}
                for i, v in zip(idx, torch._foreach_norm([tensors[i] for i in idx], 2, **wide)):
                    out[i] = v
        return fetch(out)

    def _say(self, status: dict, names: frozenset[str]) -> str:
        from ..base.report import describe_names  # (the report module imports much; only here)

        many = len(names) != 1
        head = (f"{describe_names(status, names)} {'are' if many else 'is'} in no optimizer and "
                f"{'get' if many else 'gets'} no gradient: nothing there should move {'them' if many else 'it'} "
                "by gradient, not an error")
        if self.moved is not None:
            return (f"{head}. Written outside the optimizer by step {self.moved} (first seen at step {self.first}): "
                    "a target network or an EMA / momentum copy, moved by a Polyak average or a hard copy")
        return (f"{head}. Not written since step {self.first}, when first seen (a write through .data is not "
                "seen): a target network synced every many steps, a teacher or reference model, or a layer "
                "nothing uses. If it should track another network, check its update; if nothing uses it, "
                "freeze it (requires_grad_(False)) or remove it")
