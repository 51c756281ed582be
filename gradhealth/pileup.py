"""A gradient that piles up without a step: a parameter whose gradient grows check over check
while no optimizer step changes it, though steps run.

An optimizer in backward that hooked only the parameters requiring grad when it was set up
(torchtune's ``register_optim_in_bwd_hooks`` and ``OptimizerInBackward``; a layer unfrozen later
has no hook), an optimizer that holds a parameter but never steps: the parameter's ``.grad`` is
never applied and never cleared, so each backward adds onto it, while the weight stays where it
was and every check reads it as OK. The rule, from what the checks see:

* its gradient norm grew at ``PILE`` checks in a row (each backward added onto the last);
* optimizer steps ran meanwhile (not accumulation over micro-batches before a step);
* the parameter did not change: its version counter did not move, and its norm is exactly the same
  as when the growth began (one fused norm of the few candidates and one read, only when there are
  candidates: a parameter a fused kernel moves, with no version bump, changes its norm).

Judged for OK parameters whose learning rate is not 0 (a group held at 0 is :mod:`.lrstory`'s).
"""

from __future__ import annotations

import math

import torch

from .findings import Finding, FindingKind
from .naming import agree
from .report import describe_names
from .stats import fetch, plan_groups
from .status import Status

__all__ = ["PileUp", "PILE"]

#: checks in a row with a growing gradient (and no change of the parameter) before it is named
PILE = 3


class PileUp:
    def __init__(self) -> None:
        self.prev: dict[str, float] = {}
        self.streak: dict[str, list] = {}  # name -> [growths, version, steps then, norm of θ then, first grad norm]

    def update(self, report, names: list[str], params: list, steps: int, held: set[int]) -> list[Finding]:
        """GRAD_PILEUP for the parameters piling up now; ``steps``: optimizer steps so far, ``held``:
        ids of the parameters whose group's lr is 0."""
        gn, prev, streak = report.grad_norm, self.prev, self.streak
        self.prev = gn
        status = report.status
        grown = [n for n, v in gn.items() if v > prev.get(n, math.inf) and v < math.inf]
        if not grown and not streak:
            return []
        index = {n: i for i, n in enumerate(names)} if grown else {}
        now = {}
        for n in grown:
            if status.get(n) is not Status.OK or n not in index:
                continue
            p = params[index[n]]
            if id(p) in held:
                continue
            r = streak.get(n)
            if r is None or r[1] != p._version:  # (a change of the parameter ends the streak)
                r = [0, p._version, steps, None, prev[n]]
            r[0] += 1
            now[n] = r
        self.streak = now
        due = [n for n, r in now.items() if r[0] >= 2 and r[3] is None or r[0] >= PILE and steps > r[2]]
        if not due:
            return []
        norms = _norms([params[index[n]] for n in due])
        found = []
        for n, v in zip(due, norms):
            r = now[n]
            if r[3] is None:
                r[3] = v
            elif v != r[3]:  # the parameter moved: not piling up
                del now[n]
            elif r[0] >= PILE and steps > r[2]:
                found.append(n)
        if not found:
            return []
        first = min(now[n][4] for n in found)
        last = max(gn[n] for n in found)
        return [Finding(FindingKind.GRAD_PILEUP, f"{describe_names(status, found)}: {agree(found, 'their gradients have', 'its gradient has')} "
                        f"grown at each of the last {PILE} checks (norm {first:.3g} to {last:.3g}) while optimizer steps ran "
                        f"and none of them changed {agree(found, 'these parameters', 'this parameter')} (exactly the same "
                        f"value): {agree(found, 'their gradients pile', 'its gradient piles')} up unapplied. No optimizer steps "
                        f"{agree(found, 'them', 'it')} and nothing clears {agree(found, 'their', 'its')} .grad: an optimizer "
                        "in backward that hooked only the parameters requiring grad when it was set up (a layer "
                        "unfrozen later has no hook: register one for it, or rebuild the optimizer), or an optimizer "
                        "that holds them but whose step() never runs", params=tuple(n for n in status if n in found),
                        step=report.step, data={"first": first, "last": last})]


def _norms(tensors: list) -> list[float]:
    """||θ|| of each tensor: one fused norm per (device, dtype) and one read."""
    out: list = [None] * len(tensors)
    ts = [t.detach() for t in tensors]
    for _, _, idx in plan_groups(ts):
        for i, v in zip(idx, torch._foreach_norm([ts[i] for i in idx])):
            out[i] = v
    return fetch(out) if out else []
