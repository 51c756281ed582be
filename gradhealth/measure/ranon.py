"""Which gradients an optimizer step has already run on, when a check reads them.

The usual step comes after the check: ``backward()``, ``check()``, ``optimizer.step()``. Two
families step first, and the check must know it:

* **one-call steps** (timm's ``NativeScaler``: backward, unscale, clip, step and the scaler's update
  in one call; the check comes after it): the gradients a check reads are still those the step
  consumed (the same tensors, unwritten since: a few witnesses per optimizer tell). A grad scaler
  unscaled them for that step and then forgot it (``update()``), so they must not be unscaled again;
  and no later step is owed them.
* **steps inside backward** (torch's "optimizer in backward" recipe, torchtune's
  ``OptimizerInBackward``: a post-accumulate-grad hook steps each parameter's optimizer and frees its
  gradient): nothing is left in ``.grad`` for the check. The step's pre-hook, run inside the
  backward, takes each gradient's exact norm on the device (float64: no overflow or underflow, no
  sync) before it is freed; the check judges those as this backward's gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..model.gradients import grads_of
from .stale import consumed_now, discarded

__all__ = ["RanOn"]


class RanOn:
    def __init__(self) -> None:
        self._consumed: dict[int, tuple] = {}  # optimizer id -> (it, witnesses of what its last step consumed)
        self.captured: dict[int, Tensor] = {}  # parameter id -> its gradient's norm, taken by a step inside backward

    def capture(self, opt) -> None:
        """At a step inside backward (or a wrapper's step no check read first: :mod:`gradhealth.model.masters`):
        the norms of the gradients it is about to free."""
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = grads_of(params)
        for p, g in zip(params, grads):
            if g is not None:
                self.captured[id(p)] = torch.linalg.vector_norm(g.detach(), dtype=torch.float64)

    def stepped(self, opt, seen: list | None = None) -> None:
        """After ``opt``'s step: a few of the gradients it consumed, as they are now (``seen``: the
        stale-gradient witnesses just armed on them, the same kind of record)."""
        self._consumed[id(opt)] = (opt, consumed_now(opt) if seen is None else seen)

    def consumed(self) -> list:
        """The optimizers whose gradients are still the ones their last step consumed (no backward
        and no zero_grad since)."""
        return [opt for opt, seen in self._consumed.values() if seen and not discarded(seen, exact=True)]

    def take(self, judged) -> tuple[bool, dict]:
        """At a check of the ``judged`` optimizers: (whether a step already ran on the gradients it
        reads, the norms the steps inside backward took since the last check, by parameter id)."""
        captured, self.captured = self.captured, {}
        if not judged:
            return False, captured
        if captured:
            return True, captured
        for _, seen in self._consumed.values():  # (the usual check: none, the next backward made new gradients)
            if seen and not discarded(seen, exact=True):
                break
        else:
            return False, captured
        consumed = self.consumed()
        return bool(consumed) and {id(o) for o in consumed} >= {id(o) for o in judged}, captured
