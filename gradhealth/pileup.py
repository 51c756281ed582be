"""A gradient that piles up without a step: a parameter whose gradient grows check over check
while no optimizer step changes it, though steps run.

An optimizer in backward that hooked only the parameters requiring grad when it was set up
(torchtune's ``register_optim_in_bwd_hooks`` and ``OptimizerInBackward``; a layer unfrozen later
has no hook), an optimizer that holds a parameter but never steps: the parameter's ``.grad`` is
never applied and never cleared, so each backward adds onto it, while the weight stays where it
was and every check reads it as OK. The rule, from what the checks see:

* its gradient norm grew at ``PILE`` checks in a row (each backward added onto the last);
* optimizer steps ran meanwhile (not accumulation over micro-batches before a step);
* no step changed the parameter: its version counter did not move under optimizers that hold it
  and whose steps move it (torch.optim's own, not fused: :func:`.compare.versions_tell`), or every
  optimizer that holds it did not step for ``IDLE`` checks in a row while another one did (a GAN's
  generator, whose gradients from the critic's backwards pile up over ``n_critic`` steps until its
  own ``zero_grad``, is not that: its optimizer steps every few checks). Where neither tells (a
  fused step moves no counter), nothing is said.

Judged for OK parameters whose learning rate is not 0 (a group held at 0 is :mod:`.lrstory`'s).
"""

from __future__ import annotations

import math
import operator
from itertools import compress

from .findings import Finding, FindingKind
from .naming import agree
from .report import describe_names
from .compare import versions_tell
from .status import Status

__all__ = ["PileUp", "PILE", "IDLE"]

#: checks in a row with a growing gradient (and no change of the parameter) before it is named
PILE = 3
#: ... when the only evidence is that no optimizer holding it stepped meanwhile (longer than the
#: critic steps between a GAN generator's own steps: WGAN's n_critic is 5)
IDLE = 8


class PileUp:
    def __init__(self) -> None:
        self.prev: dict[str, float] = {}
        self._names: list | None = None
        self._keys: list | None = None
        self._vals: list = []
        self._index: dict[str, int] = {}
        self.streak: dict[str, list] = {}  # name -> [growths, version, (steps, per optimizer) then, first grad norm]

    def update(self, report, names: list[str], params: list, tracker) -> list[Finding]:
        """GRAD_PILEUP for the parameters piling up now (``tracker``: the monitor's
        :class:`~gradhealth.deltas.UpdateTracker`, its step counts and learning rates)."""
        gn, prev = report.grad_norm, self.prev
        self.prev = gn
        if not gn:
            self.streak, self._keys = {}, None
            return []
        status, streak = report.status, self.streak
        keys, vals = list(gn), list(gn.values())
        if keys == self._keys:  # (the usual check: the same parameters had gradients; compared in C)
            grown = list(compress(keys, map(operator.gt, vals, self._vals)))
        else:
            grown = [n for n, v in gn.items() if v > prev.get(n, math.inf)]
        self._keys, self._vals = keys, vals
        if not grown:
            self.streak = {}
            return []
        if names is not self._names:  # (made once per list of names)
            self._names, self._index = names, {n: i for i, n in enumerate(names)}
        index = self._index
        now, snap = {}, None
        for n in grown:
            if status.get(n) is not Status.OK or n not in index or gn[n] == math.inf:
                continue
            p = params[index[n]]
            r = streak.get(n)
            if r is None or r[1] != p._version:  # (a version that moved: it was changed)
                snap = snap or (tracker.total_steps, dict(tracker.stepped))
                r = [0, p._version, snap, prev.get(n, gn[n])]
            r[0] += 1
            now[n] = r
        self.streak = now
        due = [n for n, r in now.items() if r[0] >= PILE and tracker.total_steps > r[2][0]]
        if not due:
            return []
        held = tracker.lrs.zero_ids()
        holders = _holders(tracker.lrs.optimizers, {id(params[index[n]]) for n in due})
        found = []
        for n in due:
            p, (_, then) = params[index[n]], now[n][2]
            mine = holders.get(id(p), [])
            if not mine or id(p) in held:
                continue
            stepped = [tracker.stepped.get(id(o), 0) != then.get(id(o), 0) for o in mine]
            if (now[n][0] >= IDLE and not any(stepped)) or (any(stepped) and all(versions_tell(o) for o in mine)):
                # (idle holders for long; or holders that stepped, whose steps move the version, did not move it)
                found.append(n)
        if not found:
            return []
        first = min(now[n][3] for n in found)
        last = max(gn[n] for n in found)
        return [Finding(FindingKind.GRAD_PILEUP, f"{describe_names(status, found)}: {agree(found, 'their gradients have', 'its gradient has')} "
                        f"grown at each of the last {min(now[n][0] for n in found)} checks (norm {first:.3g} to {last:.3g}) while optimizer steps ran "
                        f"and none of them changed {agree(found, 'these parameters', 'this parameter')}: {agree(found, 'their gradients pile', 'its gradient piles')} up unapplied. No optimizer steps "
                        f"{agree(found, 'them', 'it')} and nothing clears {agree(found, 'their', 'its')} .grad: an optimizer "
                        "in backward that hooked only the parameters requiring grad when it was set up (a layer "
                        "unfrozen later has no hook: register one for it, or rebuild the optimizer), or an optimizer "
                        "that holds them but whose step() never runs", params=tuple(n for n in status if n in found),
                        step=report.step, data={"first": first, "last": last})]


def _holders(optimizers, ids: set[int]) -> dict[int, list]:
    """For each parameter id of ``ids``, the optimizers whose param_groups hold it."""
    out: dict[int, list] = {}
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                if id(p) in ids:
                    out.setdefault(id(p), []).append(o)
    return out
