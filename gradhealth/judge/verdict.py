"""The judges of a check, in order, on a report the monitor built (:mod:`gradhealth.monitor`): adding a judge
is one function (in :mod:`.judges`, or a module of this stage) and one line in :func:`judge`.

Each judge is a pure function of observed values (:mod:`.judges`, :mod:`gradhealth.ranks.crossrank`,
:mod:`gradhealth.origin.replay`); this is the order they run in and what each is given. Around them, the
facade's ``_complete`` runs the stories that keep state from check to check, of this stage too: before
:func:`judge`, which optimizers never step (:mod:`.unstepped`), transient or persistent gaps
(:mod:`.patience`), underflow (:mod:`.underflow`) and pile-ups (:mod:`.pileup`), since they decide what a
report tolerates; after it, the norm history (:mod:`.history`, :mod:`.fitted`), which needs the module norms.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from dataclasses import replace
from itertools import compress, filterfalse, repeat

from ..base import distributed as dist
from ..base.naming import module_of
from ..base.report import frozen_summary
from ..base.status import Status
from ..model import experts
from ..model.checkpointing import checkpoint_cut
from ..model.wrappers import unwrap
from ..measure import window
from ..ranks import crossrank
from ..origin.calls import origin as loop_origin
from ..origin.replay import arm_tracer, traced
from . import judges, micro_batches
from .guards import output_maxima

__all__ = ["judge"]

log = logging.getLogger("gradhealth")


def _nothing_seen(obs, carry, m, o) -> bool:
    """The usual check of one process: nothing but the numbers to judge, and they are fine (every
    judge below would say nothing and change nothing)."""
    return (not obs.stale and obs.loss_cause is None and obs.eval_record is None and not obs.valid
            and (obs.loss is None or math.isfinite(obs.loss)) and not carry.frozen_norms and not carry.norm_eval
            and carry.checks > 0 and o.expect_frozen is None and not m.view.meta_names
            and not m._changes.lazy and (obs.window is None or not obs.window.notable))


def _copies_only(not_ok: list, report, carry) -> bool:
    """Every name not OK is a tolerated copy (NO_GRAD, in no optimizer: :mod:`.copies`): the judges
    below would say nothing of them (they are no error, no NO_GRAD to look for a checkpoint in)."""
    return (report.tolerated.issuperset(not_ok) and carry.streaks.copies.names.issuperset(not_ok)
            and all(map(operator.is_, map(report.status.__getitem__, not_ok), repeat(Status.NO_GRAD))))


def _named(states: dict, state) -> list[str]:
    """The names in ``states`` (name -> state) whose state is ``state``, picked in C."""
    return list(compress(states, map(operator.is_, states.values(), repeat(state))))


def judge(m, report, obs, across, sel, launch=None) -> list:
    """The findings of monitor ``m``'s judges for ``report`` (``launch``: the check as launched, with
    the output gradient the loss's backward left and the loop's calls into the model)."""
    step, o, carry, names = report.step, m.options, m.carry, m.view.names
    seen = launch.output_grad if launch is not None else None
    not_ok = report.not_ok  # (every one OK, or NO_GRAD only where tolerated as a copy: a target network's; the usual check)
    quiet = (not_ok == [] or not_ok is not None and _copies_only(not_ok, report, carry)) and not report.frozen_names \
        and not report.expert_status
    if quiet and across is None and m.scaler is None and _nothing_seen(obs, carry, m, o):
        if m._watch is not None and m._watch.probe:
            m._watch.probe = set()
        return traced(carry, m.model, report, False) if carry.tracer is not None else []
    nonfinite = not quiet and not report.grads_finite
    found = []
    if m.scaler is not None and obs.scale is not None:
        if nonfinite:
            skip = judges.amp_skip(obs.scale, carry.amp_skips + 1, o.amp_skip_alarm, step, not carry.amp_settled)
            if skip[0].level == "info":  # the scaler skips this step: nothing for the user to do
                report.tolerated = report.tolerated | {n for n, s in report.problems.items() if s is Status.NON_FINITE_GRAD}
            found += skip
        found += judges.amp_floor(obs.scale, o.amp_scale_floor, step)
    stale = {names[i] for i in obs.stale}
    if across is None:
        found += judges.loss_cause(obs.loss_cause, step)
        found += judges.eval_mode(obs.eval_record, step)
        if stale:
            found += judges.stale_grad(report.status, stale, step)
    else:  # what single ranks saw, said the same way on every rank
        where = lambda mask: crossrank.where(mask, across.world)  # noqa: E731
        if across.cause_mask:
            found += judges.loss_cause(obs.loss_cause or "see that rank's warning", step, where(across.cause_mask))
        if across.eval_mask:  # (what read the mode is one rank's view: the same error on every rank)
            record = crossrank.remote_record(obs.eval_record)
            found += judges.eval_mode(dataclasses.replace(record, readers=None), step, where(across.eval_mask))
        if across.stale_mask:
            found += judges.stale_grad(report.status, stale or set(report.status), step, where(across.stale_mask))
        found += crossrank.rank_findings(report, across, obs, names, any(
            f.kind == "AMP_SKIPPED" and f.level == "info" for f in found))  # (the scaler's own overflow)
        found += crossrank.replica_findings(across, obs, names, report.status, step, m.ranks.device,
                                            m.replicas, m._counts, m._fp, m._missed)
    if obs.valid or obs.loss is not None and not math.isfinite(obs.loss):
        found += judges.empty_valid_set(obs.valid, obs.loss, obs.norms, step, obs.loss_ranks)
    if across is not None and across.window_mask > 0:  # (inside the window this check ends: every rank's, gathered)
        names_v = sorted(obs.valid)
        row = obs.window.row(names_v) if obs.window is not None else window.quiet_row(names_v)
        found += micro_batches.findings(dist.all_gather(row, m.ranks.device), names_v, step, report.grads_finite, True)
    elif across is None and obs.window is not None and obs.window.notable:
        names_v = sorted(obs.valid)
        found += micro_batches.findings([obs.window.row(names_v)], names_v, step, report.grads_finite, False)
    if nonfinite and report.expert_status:
        found += judges.nonfinite_experts(report.expert_status, step)
    no_grad = _named(report.errors, Status.NO_GRAD) if not quiet else []
    if m._watch is not None:  # NO_GRAD now: the next forwards look for a reentrant checkpoint
        m._watch.probe = set() if quiet else set(map(module_of, filterfalse(  # (a copy's NO_GRAD is by design)
            m.carry.streaks.copies.names.__contains__, _named(report.problems, Status.NO_GRAD))))
    if no_grad:  # only then: did a reentrant checkpoint run their modules with grad disabled?
        cut, configured = checkpoint_cut(no_grad, m._watch, report.grad_streak, unwrap(m.model))
        found += judges.checkpoint_no_grad(cut, configured, report.status, step, carry.reentrant)
    # said once, at the first check after they ran (not beside an eval() mistake)
    if obs.eval_record is None and (carry.frozen_norms or carry.norm_eval):
        found += judges.norm_idioms(carry, step)
    if carry.checks == 0:  # at the first check: what is frozen, what trains beside it, which stacks
        for line in (frozen_summary(report.status), experts.describe_stacks(m.view.stacks)):
            if line:
                log.info("%s", line)
    if o.expect_frozen is not None:
        untrainable = m.view.cannot_train  # (an integer tensor, a framework's state: never frozen trouble)
        status = {n: s for n, s in report.status.items() if n not in untrainable} if untrainable else report.status
        found += judges.expect_frozen(status, o.expect_frozen, step, m.view.spelled(o.expect_frozen))
    if m.view.meta_names:
        found += judges.meta_params(m.view.meta_names, step)
    if m._changes.lazy:
        found += m._changes.judge_lazy(m.optimizers, m.tracker.total_steps if m.tracker is not None else 0,
                                       o.grad_patience, step)
    armable = nonfinite and o.trace_on_nonfinite and m.scaler is None
    found += traced(carry, m.model, report, False)  # resolve the tracer armed after the last NaN
    named = None
    if armable and across is None and launch is not None and launch.calls and not any(
            f.kind == "NONFINITE_ORIGIN" and f.level == "error" for f in found):  # the batch, or a replay (:mod:`gradhealth.origin.calls`)
        named = loop_origin(m, launch.calls, step, launch.transfer is None and not m.masters.views
                       and m.ranks.accumulation is None)
        found += [named] if named is not None else []
    if armable and (named is None or named.level != "error"):  # not named now: traced at the next step
        arm_tracer(carry, m.model, step)
    if nonfinite and across is None and m.scaler is None:  # one process's output; under a scaler, the scale
        origin = any(f.kind == "NONFINITE_ORIGIN" and f.level == "error" for f in found)
        found += judges.nan_from_loss(None if origin else output_maxima(seen), step, origin)
    checks, every = carry.checks, o.desync_every
    stepped_apart = across is not None and across.nosync_step_mask > 0  # (did that step move the replicas apart?)
    if across is not None and (checks == 0 or nonfinite or stepped_apart or (every > 0 and checks % every == 0)):
        keep = [k for k, i in enumerate(sel.idx) if not experts.per_rank(m.view.stacks.get(i), m.ranks.world)]
        found += crossrank.desync_findings([m.view.params[sel.idx[k]] for k in keep], [sel.names[k] for k in keep],
                                           report.status, step, m.ranks.device)
        if stepped_apart and not any(f.kind == "DESYNC" for f in found):
            found = [replace(f, against="the replicas' parameters still agree after that step (its gradients were "
                             "reduced another way, e.g. by hand, or were the same on every rank)")
                     if f.data.get("cause") == "step_on_local_gradients" else f for f in found]
    return found

