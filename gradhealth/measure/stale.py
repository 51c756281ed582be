"""Stale gradients: a gradient the optimizer consumed that the next backward adds onto (a missing
``zero_grad``), seen by a few witnesses per optimizer with Python-only tensor hooks.

After an optimizer step, a few of its parameters' gradients are remembered (the tensor and its
version). When the next backward reaches one of those parameters, its hook looks once: the same
gradient tensor at the same version (neither set to None nor zeroed) means the new gradient is
being added onto the consumed one. The monitor disarms the hooks at its next check.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from ..base.hooks import guarded
from ..model.gradients import grad_of

__all__ = ["StaleWatch", "WITNESSES", "witnesses", "discarded", "consumed_now", "ends"]

#: gradients watched per optimizer for STALE_GRAD and skipped steps: zero_grad clears all of an
#: optimizer's gradients together, so two, the first and the last of its parameter list (one in each
#: end of a model whose front or back alone is zeroed), tell the same as all. Each is a Python hook
#: in every backward (about as much as a small tensor's norm on the CPU)
WITNESSES = 2


def ends(items: Sequence) -> list:
    """The first and the last of ``items`` (the witnesses' places; one item: itself)."""
    return [items[0], items[-1]] if len(items) > 1 else list(items)


def witnesses(params, idx) -> list[tuple[weakref.ref, weakref.ref, int]]:
    """A few of these parameters' gradients as they are now: (parameter, gradient, version)."""
    out = []
    for i in ends(idx):
        p = params[i]
        g = p.grad
        if g is None and (g := grad_of(p)) is None:
            continue
        out.append((weakref.ref(p), weakref.ref(g), g._version))
    return out


def consumed_now(opt) -> list[tuple[weakref.ref, weakref.ref, int]]:
    """After ``opt``'s step: a few of the gradients it consumed, as they are now."""
    groups = opt.param_groups  # (its two ends, not a pass over the list: this runs at every step)
    params = groups[0]["params"] if len(groups) == 1 else [p for g in groups for p in g["params"]]
    return [(weakref.ref(p), weakref.ref(p.grad), p.grad._version) for p in ends(params) if p.grad is not None]


def discarded(seen, exact: bool = False) -> bool:
    """Were the gradients ``witnesses`` saw thrown away since (set to None, replaced, or zeroed and
    written again)? One backward adding onto them (accumulation) is not, unless ``exact``: then
    any write counts."""
    slack = 0 if exact else 1
    for param, ref, version in seen:
        p = param()
        if p is None:
            return True
        g = p.grad
        if g is None and (g := grad_of(p)) is None:
            return True
        if g is not ref() or g._version > version + slack:
            return True
    return False


class StaleWatch:
    """The witnesses of every optimizer, and the optimizers found stale since the last check.

    A witness's hook stays registered while the same parameter keeps being chosen (registering
    and removing eight hooks at every step costs more than the rest of a step's bookkeeping);
    it is armed at a step and disarmed by the check, and an unarmed hook does nothing.
    """

    def __init__(self, defer: bool = False):
        self.stale: set[int] = set()  # ids of optimizers found stale
        #: with several optimizers, a backward adding onto consumed gradients is only a suspicion
        #: until that optimizer's next step applies them: the classic GAN loop's generator backward
        #: runs through the discriminator after its step, and its zero_grad() then clears them
        self.defer = defer
        self._suspect: dict[int, list[tuple]] = {}  # optimizer id -> (parameter, the gradient added onto)
        self._watch: dict[int, dict[int, tuple]] = {}  # per optimizer id: entry -> (handle, state)
        self._idx: dict[int, list[int]] = {}  # per optimizer id: the entries it holds
        #: per optimizer id: (its entries, [(parameter ref, parameter, state)]) when last time every
        #: one of its two ends had a gradient: the usual step re-arms those, nothing else
        self._same: dict[int, tuple | None] = {}
        self._said: set = set()
        self._states: list[list] = []  # every witness's state, of every optimizer (:meth:`clear` disarms them)

    def arm(self, opt, idx: list[int], entries) -> list[tuple[weakref.ref, weakref.ref, int]]:
        """After ``opt``'s step: watch a few of its consumed gradients (``idx``: its entries).
        Returns them as :func:`consumed_now` would: (parameter, gradient, version)."""
        self._idx[id(opt)] = idx
        same = self._same.get(id(opt))
        if same is not None and same[0] is idx:
            seen = []
            for param, p, state in same[1]:
                grad = p.grad
                if grad is None or not p.requires_grad:
                    break  # (chosen again below)
                state[0], state[1], state[2] = True, weakref.ref(grad), grad._version
                seen.append((param, state[1], state[2]))
            else:
                return seen
        chosen = [i for i in ends(idx) if (p := entries[i][1]).grad is not None and p.requires_grad]
        if len(chosen) < min(WITNESSES, len(idx)) // 2:  # many without gradients: look at them all
            chosen = ends([i for i in idx if (p := entries[i][1]).grad is not None and p.requires_grad])
        watch = self._watch.get(id(opt))
        if watch is None:
            watch = self._watch[id(opt)] = {}
        if len(watch) != len(chosen) or any(i not in watch for i in chosen):  # (the same few, step after step)
            for i in [i for i in watch if i not in chosen]:
                watch.pop(i)[0].remove()
            for i in chosen:
                if i not in watch:
                    watch[i] = self._hook(entries[i][1], id(opt))
            self._states = [state for w in self._watch.values() for _, state, _ in w.values()]
        seen = []
        for i in chosen:
            _, state, param = watch[i]
            grad = entries[i][1].grad
            state[0], state[1], state[2] = True, weakref.ref(grad), grad._version
            seen.append((param, state[1], state[2]))
        self._same[id(opt)] = ((idx, [(watch[i][2], entries[i][1], watch[i][1]) for i in chosen])
                               if chosen == ends(idx) else None)
        return seen

    def _hook(self, p, key: int) -> tuple:
        state = [False, None, 0]  # armed, the consumed gradient, its version then

        def hook(_):
            if state[0]:
                self._fired(p, key, state)

        return p.register_hook(guarded(hook, "stale-gradient hook", self._said)), state, weakref.ref(p)

    def _fired(self, p, key: int, state: list) -> None:
        """A backward reached ``p`` after a step consumed its gradient: is that gradient still there?"""
        state[0] = False
        current = p.grad
        if current is not None and current is state[1]() and current._version == state[2]:
            if self.defer:
                self._suspect.setdefault(key, []).append((weakref.ref(p), state[1]))
            else:
                self.stale.add(key)

    def confirm(self, opt) -> None:
        """At a check that judges ``opt``'s parameters, or before its step: a suspected gradient
        still there (not set to None since, as ``zero_grad()`` does) is about to be applied: stale."""
        if not self._suspect:
            return
        for param, grad in self._suspect.pop(id(opt), ()):
            p = param()
            if p is not None and p.grad is not None and p.grad is grad():
                self.stale.add(id(opt))
                break

    def clear(self) -> None:
        """Disarm every witness (at a check: the backward they watch is over)."""
        for state in self._states:
            state[0] = False

    def close(self) -> None:
        """Remove every hook."""
        for watch in self._watch.values():
            for handle, _, _ in watch.values():
                handle.remove()
        self._watch.clear()
        self._same.clear()
        self._states = []

    def take(self, entries, judged, before_step: bool = False) -> set[int]:
        """Entry indices of the parameters (with gradients) of the ``judged`` optimizers found
        stale; another optimizer's finding waits for a check that judges it. ``before_step``: the
        check judges one optimizer, before its step (``check(optimizer=...)``), so what is
        suspected now is what that step will apply."""
        if before_step:
            for opt in judged:
                self.confirm(opt)
        if not self.stale:  # (the usual check: none found)
            return set()
        found = self.stale & {id(o) for o in judged}
        self.stale -= found
        out: set[int] = set()
        for opt_id in found:
            out |= {i for i in self._idx.get(opt_id, ()) if entries[i][1].grad is not None}
        return out
