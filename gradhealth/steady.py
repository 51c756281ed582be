"""The healthy steady-state check's completion: the report of a check whose every judged parameter
is trainable, in the optimizers, with a finite non-zero gradient norm, and where nothing else was
seen, built without the stages that can only speak on a change (``GradHealth._complete``'s fast path).

:func:`complete` first tests, without changing anything, that the check is such a check (each test
below names the stage it stands for); where one fails it returns None and the monitor runs the full
path. Where all hold, each stage is the full stage's result on that input, argued from its code:

* classification (:func:`.classify.classify_selection`): every entry trainable, in the optimizers,
  with a norm in (0, inf): every state OK, every ``in_optimizer`` True, nothing not OK, nothing FROZEN;
* :func:`.patience.persist` with nothing not OK and nothing frozen now or at the last check, no gap
  open: no copy is picked (``Copies.pick``: no name not OK), no gap opens or closes, the faint reader
  reads then keeps this check's norms, the judging count advances, ``blank`` is 0, the streaks are
  empty and nothing is said (``Copies.see`` of no copies says nothing);
* ``Faint.prefix`` with no streak and a first norm at or above every dtype's smallest normal
  number and not FROZEN: the lead is emptied, nothing is said;
* :func:`.verdict.judge`: with nothing not OK, nothing frozen, no experts, one process, no grad
  scaler and ``_nothing_seen`` (its own test of everything else), it returns at its first test;
  with no NaN tracer armed, with no findings.

The stories that must see every check (the previous step's updates, the pile-up, the norm history,
the fitted loss, the arming of the next step) run as on the full path, in the same order.
"""

from __future__ import annotations

import math
import operator

from . import clip, stats
from .classify import classify_selection
from .quick import quick
from .report import Report
from .status import Status
from .underflow import _WIDEST
from .verdict import _nothing_seen

__all__ = ["complete"]

_REPORT = quick(Report)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_OK, _INF = Status.OK, math.inf


class Template:
    """A classification that holds while its inputs do: the view's names, the optimizers' ids
    (replaced at any change of their param_groups: :meth:`.params.ParamView.optimizer_ids`), the
    selection, the entries with a gradient and every ``requires_grad``; with every norm in (0, inf)
    the decision tree gives the same states again."""

    __slots__ = ("names", "ids", "sel", "with_grad", "requires", "status", "in_opt", "not_ok", "copies", "gnames")

    def fits(self, names, ids, sel, with_grad, requires) -> bool:
        return (self.names is names and self.ids is ids and self.sel is sel and self.with_grad == with_grad
                and self.requires == requires)


def _template(names, params, pids, sel, obs, ids, requires) -> Template:
    """The classification of this check (:func:`.classify.classify_selection`, which changes
    nothing), kept when it is a steady one: nothing FROZEN and every name not OK a copy (NO_GRAD,
    in no optimizer: :mod:`.copies`); else None."""
    status, in_opt, not_ok, frozen = classify_selection(names, params, pids, sel.idx, obs.norm_of, ids, obs.norms,
                                                        None, requires)
    t = Template()
    t.names, t.ids, t.sel, t.with_grad, t.requires = names, ids, sel, list(obs.with_grad), requires
    if frozen or not_ok and (in_opt is None or any(status[n] is not Status.NO_GRAD or in_opt[n] for n in not_ok)):
        t.status = None  # (not a steady classification: the full path decides while these inputs hold)
        return t
    t.status, t.in_opt, t.not_ok, t.copies = status, in_opt, not_ok, frozenset(not_ok)
    t.gnames = [names[i] for i in obs.with_grad]
    return t


def complete(m, launch) -> Report | None:
    """The report of the launched check ``launch`` when it is a healthy steady-state one (see the
    module docstring), else None (nothing changed: the full path runs)."""
    obs = launch.obs
    norms = obs.norms
    if launch.reeval or launch.counts is not None or not norms or not (0.0 < min(norms) and sum(norms) < _INF):
        return None
    v, carry = m.view, m.carry
    if (m.ranks.active or v.stacks or m.scaler is not None or carry.owed or carry.tracer is not None
            or obs.loss == 0.0):
        return None
    optimizer, sel, setup = launch.optimizer, launch.sel, launch.setup
    if setup is not None:  # (a deferred check: as it was launched)
        ids, _, requires = setup
    else:
        ids = sel.opt_ids if optimizer is not None else v.optimizer_ids()
        requires = None
    if requires is None:
        requires = list(map(_REQUIRES_GRAD, v.params))
    names = v.names
    t = m._template
    if t is None or not t.fits(names, ids, sel, obs.with_grad, requires):
        t = m._template = _template(names, v.params, v.pids, sel, obs, ids, requires)
    if t.status is None:
        return None
    streaks = carry.streaks
    reader = streaks.faint_reader
    if streaks.frozen or streaks.open or reader.streak or norms[0] < _WIDEST or not _nothing_seen(obs, carry, m, m.options):
        return None
    # (from here on: the full path's stages, or what they come to on this input)
    step = launch.step
    index = v.optimizer_index(optimizer) if optimizer is not None else None
    grad_norm = dict(zip(t.gnames, norms))
    report = _REPORT(step=step, status=t.status.copy(), grad_norm=grad_norm, total_grad_norm=stats.combine_norms(norms),
                     meta=v.meta, in_optimizer=None if t.in_opt is None else t.in_opt.copy(), loss=obs.loss,
                     valid_counts=obs.valid, not_ok=list(t.not_ok), frozen_names=[], optimizer_index=index)
    tracker = m.tracker
    delivery = carry.resolve_step(report, obs.updates, launch.steps_ran, v.params, names, obs.scale, False,
                                  m.options.amp_skip_alarm, launch.after_step, launch.discarded)
    if delivery is not None:
        m.publisher.deliver(delivery, report)
    for u in obs.updates:
        tracker.settle(u)
    # persist(): nothing frozen now or at the last check, no gap open, every name not OK a copy (set
    # aside before the rule: see the module docstring)
    if names is not reader._names:
        reader._names, reader._index = names, {n: i for i, n in enumerate(names)}
    reader.norms = reader.last = grad_norm
    reader._params = v.params
    streaks.n[index] = streaks.n.get(index, 0) + 1
    streaks.blank = 0
    if t.copies:
        report.findings.append(streaks.copies.see(t.copies, report.status, names, v.params, step, launch.transfer is None))
        report.tolerated = report.tolerated | t.copies
    reader.lead = []  # (Faint.prefix: no streak, a normal first norm)
    if tracker is not None:
        report.findings += carry.pileup.update(report, names, v.params, tracker)
    w = m._watch  # (verdict.judge's first return)
    if w is not None and w.probe:
        w.probe = set()
    report.module_grad_norm = module = stats.module_norms(obs.with_grad, norms, v.module_index, v.modules, v.module_runs)
    history = carry.history_for(index)
    fit = carry.fit
    if history is not None:
        report.findings += fit.explain(history.update(step, report.total_grad_norm, module, streaks.skipping),
                                       report.loss, step)
    fit.add(report.loss)
    m._arm_next(report, obs, optimizer, launch)
    if launch.transfer is None:
        clip.keep(m, report, obs.with_grad, norms, optimizer is None)
    return report
