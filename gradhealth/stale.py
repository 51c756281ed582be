"""Stale gradients: a gradient the optimizer consumed that the next backward adds onto (a missing
``zero_grad``), seen by a few witnesses per optimizer with Python-only tensor hooks.

After an optimizer step, a few of its parameters' gradients are remembered (the tensor and its
version). When the next backward reaches one of those parameters, its hook looks once: the same
gradient tensor at the same version (neither set to None nor zeroed) means the new gradient is
being added onto the consumed one. The monitor removes the hooks at its next check.
"""

from __future__ import annotations

import weakref

from .naming import spread

__all__ = ["StaleWatch", "WITNESSES"]

#: gradients watched per optimizer for STALE_GRAD and skipped steps: zero_grad clears all of an
#: optimizer's gradients together, so a few, spread over the parameter list, tell the same as all
WITNESSES = 8


class StaleWatch:
    """The witnesses of every optimizer, and the optimizers found stale since the last check."""

    def __init__(self):
        self.stale: set[int] = set()  # ids of optimizers found stale
        self._hooks: dict[int, list] = {}
        self._idx: dict[int, list[int]] = {}  # per optimizer id: the entries it holds

    def arm(self, opt, idx: list[int], entries) -> None:
        """After ``opt``'s step: watch a few of its consumed gradients (``idx``: its entries)."""
        for h in self._hooks.pop(id(opt), ()):
            h.remove()
        self._idx[id(opt)] = idx
        usable = lambda i: entries[i][1].grad is not None and entries[i][1].requires_grad  # noqa: E731
        chosen = [i for i in spread(idx, WITNESSES) if usable(i)]
        if len(chosen) < min(WITNESSES, len(idx)) // 2:  # many without gradients: look at them all
            chosen = spread([i for i in idx if usable(i)], WITNESSES)
        handles = []
        for i in chosen:
            p = entries[i][1]
            grad = p.grad
            fired = [False]

            def hook(_, p=p, ref=weakref.ref(grad), version=grad._version, fired=fired, key=id(opt)):
                if not fired[0]:
                    fired[0] = True
                    current = p.grad
                    if current is not None and current is ref() and current._version == version:
                        self.stale.add(key)

            handles.append(p.register_hook(hook))
        self._hooks[id(opt)] = handles

    def clear(self) -> None:
        """Remove every hook (at a check: the backward they watch is over)."""
        for handles in self._hooks.values():
            for h in handles:
                h.remove()
        self._hooks.clear()

    def take(self, entries) -> set[int]:
        """Entry indices of the parameters (with gradients) of every optimizer found stale."""
        found, self.stale = self.stale, set()
        out: set[int] = set()
        for opt_id in found:
            out |= {i for i in self._idx.get(opt_id, ()) if entries[i][1].grad is not None}
        return out
