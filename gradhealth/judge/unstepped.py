"""Optimizers that never step: their parameters get gradients, which are thrown away unapplied.

With several optimizers (a GAN's generator and discriminator, Muon beside AdamW), one whose
``step()`` is forgotten, or whose turn steps another optimizer instead, leaves its parameters
exactly where they were while the run looks healthy: their gradients are fine, the other
optimizer steps, the loss may even fall. Seen per optimizer, from what every check has anyway:
its step count (the update tracker's step hooks) and a few of its gradients (the witnesses of
:mod:`gradhealth.measure.stale`). A check that finds the gradients it saw at that optimizer's previous check
thrown away (set to None, or zeroed and written again), while that optimizer did not step and
another one did, counts one check against it; ``patience`` such checks in a row are
``NOT_STEPPED``, naming the optimizer and its parameters. Gradients accumulated over several
checks are never thrown away in between, so accumulation counts nothing; a run where no
optimizer steps at all is the skipped step's case (NOT_UPDATED, :func:`.judges.skipped_step`).
"""

from __future__ import annotations

from ..base import saved as checked
from ..base.findings import Finding, FindingKind
from ..base.naming import agree, plural
from ..base.report import describe_names
from ..measure.stale import WITNESSES, discarded, ends, witnesses

__all__ = ["Unstepped"]


class Unstepped:
    """Per optimizer: the gradients its last check saw, its step count then, and the streak."""

    def __init__(self):
        self.streak: dict[int, int] = {}  # optimizer index -> checks in a row with gradients thrown away unapplied
        self._seen: dict[int, tuple] = {}  # optimizer index -> (witnesses, its steps, all steps)
        self._members: list[list[int]] = []
        self._key = None

    def _entries(self, view) -> list[list[int]]:
        """Each optimizer's entry indices, recomputed only when the param_groups change."""
        view.optimizer_ids()
        if self._key is not view._ids_key:
            self._key = view._ids_key
            self._members = []
            for opt in view.optimizers:
                ids = {id(p) for g in opt.param_groups for p in g["params"]}
                self._members.append([i for i, pid in enumerate(view.pids) if pid in ids])
        return self._members

    def update(self, view, optimizer_index: int | None, steps: dict[int, int], total: int, status, step: int,
               patience: int) -> list[Finding]:
        """At a check judging optimizer ``optimizer_index`` (None: all of them); ``steps``: each
        optimizer's steps so far (by id), ``total``: all of them together."""
        members, params, names = self._entries(view), view.params, view.names
        found: list[Finding] = []
        for k in range(len(members)) if optimizer_index is None else (optimizer_index,):
            opt = view.optimizers[k]
            mine = steps.get(id(opt), 0)
            seen = self._seen.get(k)
            if seen is not None:
                if mine != seen[1]:
                    self.streak[k] = 0
                elif total != seen[2] and discarded(seen[0]):
                    self.streak[k] = self.streak.get(k, 0) + 1
            # the two ends of its parameters; all of them only when many have no gradient
            with_grad = [i for i in ends(members[k]) if params[i].grad is not None]
            if len(with_grad) < min(WITNESSES, len(members[k])) // 2:
                with_grad = [i for i in members[k] if params[i].grad is not None]
            self._seen[k] = (witnesses(params, with_grad), mine, total) if with_grad else None
            n = self.streak.get(k, 0)
            if n >= patience and with_grad:
                held = [names[i] for i in members[k] if params[i].grad is not None and names[i] in status]
                every = dict.fromkeys(names, status.get(held[0]) if held else None)  # (grouped as in the whole model)
                found.append(Finding(
                    FindingKind.NOT_STEPPED,
                    f"optimizer {k} ({type(opt).__name__}) did not step for {plural(n, 'check')} in a row while another "
                    f"optimizer did: {describe_names(every, held)} got {agree(held, 'gradients', 'a gradient')} that "
                    f"{agree(held, 'were', 'was')} thrown away (zero_grad) before its step() ran, so "
                    f"{agree(held, 'they never change', 'it never changes')}. Call its step() after the backward that "
                    "feeds it (in Lightning manual optimization: its opt.step() after self.manual_backward(loss) in its "
                    "toggle_optimizer phase; the other optimizer's step() there does not update these)",
                    params=tuple(held), step=step, data={"optimizer": k, "class": type(opt).__name__, "checks": n}))
        return found

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The streaks, and each optimizer's step counts at its last check (a checkpoint holds no
        gradients: not the witnesses)."""
        return {"streak": {str(k): n for k, n in self.streak.items()},
                "seen": {str(k): [s[1], s[2]] for k, s in self._seen.items() if s is not None}}

    def load_state_dict(self, state: dict, optimizers: int) -> None:
        """Every key checked (:mod:`gradhealth.check.state`), then loaded. The gradients the last check saw are gone
        with the checkpoint: taken as thrown away where the optimizer's streak says the loop threw
        them away before, else as unknown (the streak neither grows nor ends at the next check)."""
        checked.exact(state, ("streak", "seen"), "state['unstepped']")
        for key in state:
            if not isinstance(state[key], dict):
                raise TypeError(f"state['unstepped'][{key!r}] must map optimizer indices")
        streak = {checked.index(k, "state['unstepped']['streak'] key", optimizers):
                  checked.count(v, f"state['unstepped']['streak'][{k!r}]") for k, v in state["streak"].items()}
        seen = {}
        for k, v in state["seen"].items():
            i = checked.index(k, "state['unstepped']['seen'] key", optimizers)
            if not isinstance(v, list) or len(v) != 2:
                raise TypeError(f"state['unstepped']['seen'][{k!r}] must be [its steps, all steps]")
            mine, total = (checked.count(x, f"state['unstepped']['seen'][{k!r}]") for x in v)
            seen[i] = (_GONE if streak.get(i) else (), mine, total)
        self.streak, self._seen = streak, seen


#: a witness whose parameter is gone: :func:`gradhealth.measure.stale.discarded` reads it as thrown away
_GONE = [(lambda: None, lambda: None, 0)]
