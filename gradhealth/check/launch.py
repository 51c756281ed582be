"""What a check takes at the moment it is made (``GradHealth._launch``): the device numbers, gathered
and read back at once (or launched, for a deferred check: :mod:`.deferred`), and what this rank saw
besides them (the previous optimizer step's pending updates, stale-gradient witnesses, a step that
already ran on these gradients, the loss's cause, an eval-mode backward).

Functions of the monitor (``self``), kept apart from :mod:`gradhealth.monitor`, which orders the stages.
"""

from __future__ import annotations

import operator

from ..base.quick import quick
from ..model.params import Selection
from ..measure.observe import failed_observation, observe
from ..judge.guards import diagnose_loss
from .deferred import Launch

__all__ = ["launch", "observe_rank"]

_SCALER_FLAG = operator.attrgetter("scaler_flag")  # (a step a grad scaler may have skipped)
_LAUNCH = quick(Launch)  # (a Launch as Launch(...) makes it, without its __init__'s per-field tests)


def launch(self, step: int, loss, optimizer, deferred: bool = False) -> Launch:
    """Everything a check takes from this moment: the device numbers (read now, or later when
    ``deferred``: :mod:`.deferred`) and what the rank saw besides them."""
    sel = self.view.selection(optimizer)
    # a closure's later evaluation inside one step (LBFGS): judged, but it neither resolves nor arms a step
    reeval = self.tracker is not None and self.tracker.reevaluation()
    judged = [optimizer] if optimizer is not None else self.optimizers
    t = self.tracker  # (deferred: the armed check's gradients, as of now, where no step ran since it)
    discarded = self.carry._discarded() if deferred and t is not None and (
        not t.steps_since_check or any(map(_SCALER_FLAG, t.pending))) else None
    obs, steps_ran = observe_rank(self, sel, loss, reeval, judged, deferred)
    w = self._watch
    calls = w.calls.take() if w is not None and w.calls is not None else None  # (:mod:`gradhealth.origin.calls`)
    return _LAUNCH(step=step, sel=sel, optimizer=optimizer, reeval=reeval, obs=obs, steps_ran=steps_ran,
                   after_step=self._after_step, output_grad=self.carry.take_output_grad(), discarded=discarded,
                   counts=(dict(t.stepped), t.total_steps) if t is not None and self.unstepped is not None else None,
                   calls=calls)


def observe_rank(self, sel: Selection, loss, reeval: bool = False, judged=(), deferred: bool = False):
    """Gather and read back (one transfer); what this rank saw besides numbers rides along."""
    tracker, carry = self.tracker, self.carry
    updates, stale, steps_ran, self._after_step, captured, valid = [], set(), None, False, None, carry.take_valid()
    if tracker is not None and not reeval:  # (taken before anything can fail: a failed rank still joins with them)
        updates, steps_ran, tracker.pending = tracker.pending, tracker.steps_since_check, []
    try:
        if tracker is not None and not reeval:
            tracker.witness.clear()
            stale = tracker.witness.take(self.view.entries, judged, len(judged) == 1)
            self._after_step, captured = tracker.ran.take(judged)  # (a one-call step, or steps inside backward)
            self.masters.checked(self._after_step)
        obs, self._plan = observe(self.view, sel, loss, valid, updates, self.scaler, self._plan, self.ranks.active,
                                  self.ranks.all_sharded, carry.take_router(), judged if self._after_step else (),
                                  captured, deferred, carry.window.take())  # (the window's deferred checks)
        obs.loss_cause = diagnose_loss(loss, self.model, carry.forward) if loss is not None else None
        obs.eval_record = carry.take_eval_backward()
        obs.stale, obs.local = stale, self.ranks.in_no_sync()  # (local: a check inside no_sync() made at once)
        self._failed = None
    except Exception as exc:
        if not self.ranks.active:
            raise
        # Never leave the other ranks waiting in the collective: join it with an empty
        # contribution and a failure flag, so every rank gives up on this check together.
        obs, self._failed = failed_observation(self.view, sel, valid, updates), exc
    return obs, steps_ran
