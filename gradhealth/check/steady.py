"""The healthy steady-state check's report, without the stages that can only speak on a change
(``GradHealth._complete``'s fast path; :mod:`.quiet` launches and reads a plain check for it).

:func:`ready` first tests, without changing anything, that the check is such a check: every norm
read back in (0, inf), the loss not 0, nothing seen by the rank but the numbers, one process, no
stacked experts, no grad scaler, no NaN tracer, nothing owed, and a kept :class:`Template` of the
classification for the same names, optimizers' membership, selection, entries with a gradient and
``requires_grad`` whose states are OK but for tolerated copies (NO_GRAD, in no optimizer: a target
network's) and FROZEN entries without a gradient (a LoRA base's), the FROZEN set the last check's
(nothing thawed or frozen anew); where one test fails, the monitor runs the full path. Where all hold, :func:`finish`
gives each stage's result on that input, argued from its code:

* classification (:func:`gradhealth.judge.classify.classify_selection`): with every norm in (0, inf) and the same
  inputs, the decision tree gives the template's states again (copies included; FROZEN is decided
  by ``requires_grad`` alone, the same list, so the same frozen names, ``frozen_names`` included);
* :func:`.carry.Carry.resolve_step` of a step that ran and that no one measured: the grad scaler's
  skip count is reset, nothing is delivered (with updates: the call itself);
* :func:`gradhealth.judge.patience.persist` with the same FROZEN set now as at the last check (``Persistence.frozen``),
  no gap open and every name not OK a copy: ``update`` finds the set unchanged (nothing enters
  ``thawed``, ``frozen`` kept), no FROZEN name is among ``not_ok``, so none is missing and ``blank``
  is 0 whatever the trainable count; the copies are set aside before the rule (``Copies.see`` says its info
  finding, they are tolerated), no gap opens or closes, the faint reader reads then keeps this
  check's norms, the judging count advances, ``blank`` is 0, the streaks are empty;
* ``Faint.prefix`` with no streak and a first norm at or above every dtype's smallest normal
  number (not FROZEN): the lead is emptied, nothing is said;
* :func:`gradhealth.judge.verdict.judge`: with nothing not OK but copies, no experts, one process, no grad scaler
  and ``_nothing_seen`` (tested by ``ready`` and its caller), it returns at its first test with
  nothing frozen; with FROZEN names it goes on and says nothing either: the grads are finite,
  ``errors`` is empty (no NO_GRAD to probe: the probe set emptied, as here), ``carry.frozen_norms``
  is empty (tested), the first check's frozen summary is past (``carry.checks``), no
  ``expect_frozen``, no meta or lazy parameters, no tracer; with no NaN tracer armed, no findings;
* the change test's arming (``deferred.due_test``): the FROZEN names have no gradient, so it is
  due only after a step that changed nothing (``carry.still``), as armed here; the report's
  ``frozen_names`` are the full path's, so the next check's ``FROZEN_BUT_CHANGED`` test
  (``Carry._measured``) looks at the same names;
* ``fit.explain`` of no findings: none.

The stories that must see every check run in the same order: the pile-up (``PileUp.quiet``, else
``update``), the module norms, the norm history (``NormHistory.quiet``, else ``update``), the
fitted loss, the arming of the next step (``GradHealth._arm_next``, inline).
"""

from __future__ import annotations

import math
import operator
import weakref
from collections import deque
from itertools import compress, starmap

from ..base.quick import quick
from ..base.report import Report
from ..base.status import Status
from ..measure import stats
from ..measure.stale import witnesses
from ..judge.classify import classify_selection
from ..judge.underflow import _WIDEST
from . import clip

__all__ = ["complete", "entry_norms", "finish", "ready", "Template"]

_REPORT = quick(Report)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_OK, _INF = Status.OK, math.inf
_hypot, _ref = math.hypot, weakref.ref


class Template:
    """A classification that holds while its inputs do: the view's names, the optimizers' ids
    (replaced at any change of their param_groups: :meth:`gradhealth.model.params.ParamView.optimizer_ids`), the
    selection, the entries with a gradient and every ``requires_grad``; with every norm in (0, inf)
    the decision tree gives the same states again."""

    __slots__ = ("names", "ids", "sel", "with_grad", "requires", "status", "in_opt", "not_ok", "copies", "frozen", "cold",
                 "gnames", "runs", "modules", "pos")


def seen(params: list, with_grad: list[int], grads: list) -> list:
    """``stale.witnesses(params, with_grad)`` from the gradients just read (``grads``, aligned with
    ``with_grad``, not empty): the first and the last, as they are now."""
    g = grads[0]
    if len(grads) == 1:
        return [(_ref(params[with_grad[0]]), _ref(g), g._version)]
    h = grads[-1]
    return [(_ref(params[with_grad[0]]), _ref(g), g._version), (_ref(params[with_grad[-1]]), _ref(h), h._version)]


def entry_norms(norms: list[float], n: int, with_grad: list[int]) -> list:
    """Per entry of a view of ``n``, its norm or None (``with_grad``: the entries ``norms`` are of)."""
    if len(norms) == n:
        return list(norms)
    out = [None] * n
    deque(map(out.__setitem__, with_grad, norms), maxlen=0)
    return out


def _template(view, sel, norm_of, norms, with_grad, ids, requires) -> Template:
    """The classification of this check (:func:`gradhealth.judge.classify.classify_selection`, which changes
    nothing), kept: a steady one (every FROZEN entry without a gradient and every name not OK a
    copy, NO_GRAD and in no optimizer: :mod:`gradhealth.judge.copies`), or one that is not (``status`` None: the full path runs while its
    inputs hold)."""
    names = view.names
    status, in_opt, not_ok, frozen = classify_selection(names, view.params, view.pids, sel.idx, norm_of, ids, norms, None,
                                                        requires)
    t = Template()
    t.names, t.ids, t.sel, t.with_grad, t.requires = names, ids, sel, list(with_grad), requires
    if frozen and not all(map(requires.__getitem__, with_grad)) or not_ok and (
            in_opt is None or any(status[n] is not Status.NO_GRAD or in_opt[n] for n in not_ok)):
        t.status = None  # (not a steady classification: the full path decides while these inputs hold)
        return t
    t.status, t.in_opt, t.not_ok, t.copies = status, in_opt, not_ok, frozenset(not_ok)
    t.frozen, t.cold = frozen, set(frozen)  # (FROZEN: requires_grad False and no gradient, a LoRA base's)
    t.gnames = [names[i] for i in with_grad]
    runs = view.module_runs  # (stats.module_norms: the modules with a gradient, and their runs)
    if runs is not None:
        has = [False] * len(view.module_index)
        for i in with_grad:
            has[i] = True
        keep = list(map(any, map(has.__getitem__, runs)))
        t.runs, t.modules = list(compress(runs, keep)), list(compress(view.modules, keep))
        # the kept modules' runs in ``norms`` (with_grad's order) where each holds a gradient in every entry
        # (the usual case): hypot of the same numbers, the zeros of entries without a gradient left out
        # (a 0 adds exactly nothing to hypot)
        at = {e: k for k, e in enumerate(with_grad)}
        t.pos = ([slice(at[r.start], at[r.start] + r.stop - r.start) for r in t.runs]
                 if all(map(operator.lt, with_grad, with_grad[1:]))
                 and all(all(map(has.__getitem__, range(r.start, r.stop))) for r in t.runs) else None)
    else:
        t.runs = t.modules = t.pos = None
    return t


def ready(m, sel, optimizer, with_grad, norms, norm_of, loss, setup=None, plain: bool = False) -> Template | None:
    """The template of a check whose numbers came back healthy (every norm in (0, inf), the loss
    not 0, and, the caller's part of ``verdict._nothing_seen``, nothing else seen by the rank) when
    the monitor's stories allow the steady completion (see the module docstring); else None.
    ``norm_of``: per entry, its norm or None (a list, or None: made from ``norms`` only when
    the template is made again; ``plain``: one process, no stacks, no grad scaler: tested already)."""
    if not norms or not (0.0 < min(norms) and sum(norms) < _INF) or loss == 0.0:
        return None
    v, carry = m.view, m.carry
    if (not plain and (m.ranks.active or v.stacks or m.scaler is not None) or carry.owed or carry.tracer is not None
            or carry.frozen_norms or carry.norm_eval or not carry.checks or m.options.expect_frozen is not None
            or v.meta_names or m._changes.lazy):
        return None
    if setup is not None:  # (a deferred check: as it was launched)
        ids, _, requires = setup
    else:
        ids = sel.opt_ids if optimizer is not None else v.optimizer_ids()
        requires = None
    if requires is None:
        requires = list(map(_REQUIRES_GRAD, v.params))
    names = v.names
    t = m._template
    if t is None or not (t.names is names and t.ids is ids and t.sel is sel and t.with_grad == with_grad
                         and t.requires == requires):  # (the inputs it was made for)
        t = m._template = _template(v, sel, norm_of if norm_of is not None else entry_norms(norms, len(v.params), with_grad),
                                    norms, with_grad, ids, requires)
    if t.status is None:
        return None
    streaks = carry.streaks
    if streaks.frozen != t.cold or streaks.open or streaks.faint_reader.streak or norms[0] < _WIDEST:
        return None
    return t


def complete(m, launch) -> Report | None:
    """The report of the launched check ``launch`` when it is a healthy steady-state one (see the
    module docstring), else None (nothing changed: the full path runs)."""
    obs = launch.obs
    if launch.reeval or launch.counts is not None or obs.stale or obs.loss_cause is not None \
            or obs.eval_record is not None or obs.valid or obs.window is not None \
            or obs.loss is not None and not math.isfinite(obs.loss):  # (verdict._nothing_seen: the rank's part)
        return None
    t = ready(m, launch.sel, launch.optimizer, obs.with_grad, obs.norms, obs.norm_of, obs.loss, launch.setup)
    if t is None:
        return None
    return finish(m, t, launch.step, launch.optimizer, obs.with_grad, obs.norms, obs.loss, obs.updates,
                  launch.steps_ran, launch.after_step, launch.discarded, launch.transfer is None)


def finish(m, t: Template, step: int, optimizer, with_grad: list[int], norms: list[float], loss, updates, steps_ran,
           after_step: bool, discarded, sync: bool, grads=None) -> Report:
    """The steady completion (``ready`` said so): the full path's stages, or what they come to on
    this input (see the module docstring). ``sync``: the check is read now (not deferred);
    ``grads``: the gradients of ``with_grad`` it read (else read again for the witnesses)."""
    v, carry = m.view, m.carry
    names = v.names
    index = None if optimizer is None else 0 if v.optimizers[0] is optimizer else v.optimizer_index(optimizer)
    grad_norm = dict(zip(t.gnames, norms))
    # (stats.combine_norms: no NaN among them, so hypot is the norm)
    total = _hypot(*norms) if len(norms) > 1 else norms[0]
    report = _REPORT(step=step, status=t.status.copy(), grad_norm=grad_norm, total_grad_norm=total,
                     meta=v.meta, in_optimizer=None if t.in_opt is None else t.in_opt.copy(), loss=loss,
                     valid_counts={}, not_ok=list(t.not_ok), frozen_names=list(t.frozen), optimizer_index=index)
    tracker = m.tracker
    if not updates and steps_ran and not after_step:  # (Carry.resolve_step of a step that ran, measured by no one)
        carry.amp_skips = 0
        carry.amp_settled = carry.amp_settled or False
    else:
        delivery = carry.resolve_step(report, updates, steps_ran, v.params, names, None, False,
                                      m.options.amp_skip_alarm, after_step, discarded)
        if delivery is not None:
            m.publisher.deliver(delivery, report)
        for u in updates:
            tracker.settle(u)
    # persist(): the same FROZEN set now as at the last check, no gap open, every name not OK a copy (set
    # aside before the rule: see the module docstring)
    streaks = carry.streaks
    reader = streaks.faint_reader
    if names is not reader._names:
        reader._names, reader._index = names, {n: i for i, n in enumerate(names)}
    reader.norms = reader.last = grad_norm
    reader._params = v.params
    streaks.n[index] = streaks.n.get(index, 0) + 1
    streaks.blank = 0
    if t.copies:
        report.findings.append(streaks.copies.see(t.copies, report.status, names, v.params, step, sync))
        report.tolerated = report.tolerated | t.copies  # (as persist() sets them aside, where the full path does)
    reader.lead = []  # (Faint.prefix: no streak, a normal first norm)
    if tracker is not None and not carry.pileup.quiet(t.gnames, norms, v.params, tracker):
        report.findings += carry.pileup.update(report, names, v.params, tracker)
    w = m._watch  # (verdict.judge's first return)
    if w is not None and w.probe:
        w.probe = set()
    runs = t.runs  # (stats.module_norms: each module's runs of entries, those of modules with a gradient)
    if runs is not None:
        if t.pos is not None:  # (every entry of those modules with a gradient: their runs in ``norms``)
            values = list(starmap(_hypot, map(norms.__getitem__, t.pos)))
        else:
            full = [0.0] * len(v.module_index)
            deque(map(full.__setitem__, with_grad, norms), maxlen=0)
            values = list(starmap(_hypot, map(full.__getitem__, runs)))
        module = dict(zip(t.modules, values)) if _INF not in values else stats.module_norms(
            with_grad, norms, v.module_index, v.modules, v.module_runs)
    else:
        module = stats.module_norms(with_grad, norms, v.module_index, v.modules, v.module_runs)
    report.module_grad_norm = module
    history = carry.history  # (carry.history_for(index): the one history, else that optimizer's, once made)
    if index is not None and history is not None:
        history = carry.histories.get(index) or carry.history_for(index)
    fit = carry.fit
    if history is not None:  # (fit.explain of no findings says nothing: nothing to explain)
        if not history.quiet(total, module):
            report.findings += fit.explain(history.update(step, total, module, streaks.skipping),
                                           loss, step)
    fit.add(loss)
    if tracker is not None:  # (GradHealth._arm_next; due_test: FROZEN ones have no gradient)
        if sync:  # (a deferred check armed its step when it was launched)
            tracker.arm(step, [optimizer] if optimizer is not None else m.optimizers, carry.still > 0)
        if after_step:
            carry.armed = None
        else:  # (carry.arm; deferred: the witnesses staged at launch)
            carry.armed = report
            if sync:
                carry.witnesses = witnesses(v.params, with_grad) if grads is None else seen(v.params, with_grad, grads)
                carry.witness_step = step
    carry.last_scale = None
    if sync and m._clip_source is not False:  # (clip.keep: from the run's first clip on)
        clip.keep(m, report, with_grad, norms, optimizer is None)
    return report
