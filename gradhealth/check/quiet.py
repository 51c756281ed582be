"""The launch and report of a plain synchronous check (``GradHealth._build``'s fast path): one process, no grad
scaler, no stacked experts, no masters, nothing the loop handed the check besides the gradients
(no valid masks, no router counts, no deferred window), no step inside backward, outside any
optimizer step: the judged gradients' norms and the loss read back in one transfer, with the
previous step's pending updates, and what the rank saw besides (stale-gradient witnesses, a step
that already ran on these gradients, the loss's cause, an eval-mode backward), as
:func:`.launch.observe_rank` and :func:`gradhealth.measure.observe.observe` make them on that input.

:func:`build` first tests, without changing anything, that the check is such a check; where one
test fails it returns None and the full launch runs. Its numbers are then judged by :mod:`.steady`
where they are healthy (no ``Observation`` or ``Launch`` is made for them), else by the full
completion (``GradHealth._complete``), given the observation the full launch makes.

:func:`later` is the same for a plain deferred check (``lag=1``), fused with ``Deferred.check``'s part
after the launch (the copy to the host, the setup, the arming of its step, the staged witnesses,
the step guard): what is in flight is the generator itself, suspended after the launch with its
locals; ``Deferred`` resumes it at the next check to read the numbers back and make the report (the steady one, else the full completion's, of
the observation it makes then): no ``Pending`` is made for a plain check, and no ``Launch`` unless
its guard or the full completion needs one.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from itertools import compress, repeat

import torch
from torch import Tensor

from ..base.quick import quick
from ..model.gradients import grads_there
from ..measure import stats
from ..measure.observe import Observation
from ..measure.stale import witnesses
from ..judge.classify import _REQUIRES_GRAD
from ..judge.guards import diagnose_loss
from . import deferred, steady
from .deferred import Launch, due_test

__all__ = ["build", "later"]

_LAUNCH = quick(Launch)
_OBSERVATION = quick(Observation)
_IS, _NONE = operator.is_, repeat(None)
_NEW = object.__new__
_SCALER_FLAG = operator.attrgetter("scaler_flag")
_STACK, _FOREACH_NORM, _F64 = torch.stack, torch._foreach_norm, torch.float64


def _read(grads: Sequence[Tensor], plan, loss: Tensor | None = None) -> list[float] | None:
    """``Launched(grads, [loss], plan).read()``'s norms then loss, in one list, for the usual check of
    a small model (dense real gradients of one device and dtype, under a plan of one fused kernel
    that fits them; a 0-d float loss or none): the same kernels and transfer, without the general
    path's packing; None where the plan does not say so (nothing was launched)."""
    if plan is None or plan.single is not stats.foreach_norms or not plan.plain or plan.later or stats.plan_key(grads) != plan.key \
            or loss is not None and (loss.dim() or not loss.is_floating_point()):
        return None
    pieces = stats.foreach_norms(grads)
    if loss is not None:
        pieces.append(loss)
    values = stats.fetch([torch.stack(pieces)])  # (joined: scalars, floats: one stack; read at the one transfer point)
    n = len(grads)
    if 0.0 in values[:n] or math.inf in values[:n]:  # (the exact re-check of read(), on no exact kernel yet)
        suspects = list(compress(range(n), map((0.0, math.inf).__contains__, values[:n])))
        for i, v in zip(suspects, stats.exact_norms([grads[i] for i in suspects])):
            values[i] = v
        plan.learn(suspects, grads)
    return values


def _launch_later(grads: Sequence[Tensor], plan, loss: Tensor | None = None) -> Tensor | None:
    """``Launched(grads, [loss], plan, later=True).packed`` for the usual deferred check of a small model
    (dense real gradients of one device and dtype, under a deferred plan of one exact kernel that
    fits them; a 0-d float loss or none): the same kernels and packed vector (the float64 norms, the
    loss after them: ``stack`` promotes it exactly), without the general path's tests and object;
    None where the plan does not say so (nothing was launched)."""
    if plan is None or plan.single is not stats.exact_pieces or not plan.plain or not plan.later or stats.plan_key(grads) != plan.key \
            or loss is not None and (loss.dim() or not loss.is_floating_point()):
        return None
    if grads[0].dtype is not _F64:  # (stats.exact_pieces of 32-bit and narrower gradients: one fused kernel)
        norms = _FOREACH_NORM(grads, 2, dtype=_F64)
        return _STACK(norms if loss is None else norms + (loss,))
    parts = stats.exact_pieces(grads)
    if loss is not None:
        parts.append(loss)
    return stats.joined(parts)  # (float64 gradients: one vector of norms)


def _fetched(flat: list[float], loss: bool, updates: list, sizes: list[int]) -> None:
    """The pending updates' numbers, after the loss's (``loss``: one is there) in ``flat``."""
    k = 1 if loss else 0
    for u, size in zip(updates, sizes):
        u.fetched(flat[k:k + size])
        k += size


def _made(step: int, sel, optimizer, transfer) -> Launch:
    """The Launch of a plain deferred check: what its completion, its guard and ``Deferred.launched_at`` read."""
    launch = _NEW(Launch)
    launch.step, launch.sel, launch.optimizer, launch.obs, launch.ranks = step, sel, optimizer, None, None
    launch.transfer = transfer
    launch.lean = None  # (a guarded check's: its generator, set by ``Deferred.check``)
    return launch


def later(m, step: int, loss, optimizer, d):
    """A plain check launched for a later read (``launch.launch(deferred=True)`` on that input, its
    ``Pending`` observation completed by ``Deferred.complete``), as a generator that runs in two
    parts, its locals kept between them (no closure, no object made to hold them): the first
    ``next()`` launches the check and yields True, or with the step guard on the ``Launch`` the
    guard needs; where it is not a plain check it ends there, nothing changed. The second
    ``next()``, at the next check, reads its numbers back (the one transfer point) and yields its
    report (kept and counted): the steady report where they make a steady check (:mod:`.steady`; no
    Observation is made for it), else the full completion's, of the observation
    ``Pending.complete`` would make on this input.
    ``d``: the :class:`.deferred.Deferred` launching it, whose part after the launch (``Deferred.check``:
    the transfer, the setup, the arming of its step, the witnesses staged) is done here too, on this input."""
    t, carry, v, ranks = m.tracker, m.carry, m.view, m.ranks
    if (t is None or t._in_step or t.ran.captured or ranks.active or ranks.ddp is not None or v.stacks
            or m.scaler is not None or carry.valid or carry.router is not None or carry.window.n or m.unstepped is not None):
        return  # (not a plain check)
    sel = v.selection(optimizer)
    judged = [optimizer] if optimizer is not None else m.optimizers
    updates, steps_ran, t.pending = t.pending, t.steps_since_check, []
    # (launch(): were the armed check's gradients thrown away since? where no step ran since it)
    discarded = None if steps_ran and not updates else (
        carry._discarded() if not steps_ran or any(map(_SCALER_FLAG, updates)) else None)
    t.witness.clear()
    stale = t.witness.take(v.entries, judged, len(judged) == 1)
    after_step, _ = t.ran.take(judged)  # (nothing captured: no step inside backward)
    m._after_step = after_step
    if m.masters.views:
        m.masters.checked(after_step)
    params, idx = v.params, sel.idx
    grads, there = grads_there(params if len(idx) == len(params) else [params[i] for i in idx])
    if there is not None:
        with_grad, grads = list(compress(idx, there)), list(compress(grads, there))
    else:
        with_grad = list(idx)
    loss_t = loss.detach() if isinstance(loss, Tensor) and loss.numel() == 1 else None
    sizes = []
    packed = _launch_later(grads, m._plan, loss_t) if not updates else None  # (the usual check: one kernel)
    if packed is None:
        parts = [] if loss_t is None else [loss_t]
        for u in updates:  # (Layout.put's parts: a tensor, or several)
            packed, size = u.packed, u.size
            sizes.append(size)
            if isinstance(packed, list):
                parts += packed
            elif size:
                parts.append(packed)
        launched = stats.Launched(grads, parts, m._plan, later=True)
        m._plan, packed = launched.plan, launched.packed
        transfer = deferred.Transfer(packed, d.pinned)
    else:
        launched = None  # (the norms first, in order, then the loss)
        # (in host memory already, a CPU check's: read as they are, by the same read point, no copy)
        transfer = packed if packed.device.type == deferred.Transfer.HOST else deferred.Transfer(packed, d.pinned)
    cause = diagnose_loss(loss, m.model, carry.forward) if loss is not None else None
    record, carry.eval_backward = carry.eval_backward, None  # (carry.take_eval_backward)
    m._failed = None
    w = m._watch
    output_grad, carry.output_grad = carry.output_grad, None
    calls = w.calls.take() if w is not None and w.calls is not None else None
    seen = steady.seen(params, with_grad, grads) if with_grad else None
    # (Deferred.check's part after a plain launch: one process, no DDP hooks' numbers)
    requires = list(map(_REQUIRES_GRAD, params))
    setup = (v.optimizer_ids(), v.all_inside, requires) if optimizer is None else (sel.opt_ids, None, requires)
    last = m.last_report  # (due_test of a steady report, made by the check before: its FROZEN names have no gradient)
    due = carry.still > 0 if last is m._steady_report else last is not None and (
        carry.still > 0 or last.frozen_names != [] and due_test(carry, last))
    t.arm(step, judged, due or False in requires and not all(map(requires.__getitem__, with_grad)))
    if not after_step:  # (carry.stage)
        carry.witnesses, carry.witness_step = seen if with_grad else witnesses(params, with_grad), step
    del grads, there, loss  # (not held by this frame in flight; the general path's `launched` holds the gradients)
    if d.guarding:  # (Deferred._guard: decided on the device at launch; its finding needs the Launch)
        launch = _made(step, sel, optimizer, transfer)
        d._guard(launch, packed[:len(with_grad)])  # (launched.norms_part(): a view, no kernel)
        yield launch
    else:
        yield True
    # (the next check: this one's report)
    values = deferred.Transfer.values(transfer)  # (the one transfer point)
    if launched is None:  # (the usual check: its norms in order, then the loss; no update norms)
        norms, value = (values, None) if loss_t is None else (values[:-1], values[-1])
    else:  # (launched.resolve: the norms, the loss, the update norms)
        k = len(with_grad)
        norms = values[:k] if launched.identity else launched._order(values)
        value = values[k] if loss_t is not None else None
    # (nothing else seen by the rank, and a finite loss: inf - inf and NaN are NaN)
    if not stale and cause is None and record is None and (value is None or value - value == 0.0):
        template = steady.ready(m, sel, optimizer, with_grad, norms, None, value, setup, True)
        if template is not None:
            if updates:
                _fetched(values[k:], loss_t is not None, updates, sizes)
            m.last_report = m._steady_report = report = steady.finish(
                m, template, step, optimizer, with_grad, norms, value, updates, steps_ran, after_step, discarded, False)
            carry.checks += 1
            yield report
            return
    if updates:
        _fetched(values[k:], loss_t is not None, updates, sizes)  # (observe's, on this input)
    full = _made(step, sel, optimizer, transfer)  # (a guarded check's too: its guard read nothing of its Launch)
    full.__dict__.update(reeval=False, steps_ran=steps_ran, after_step=after_step, output_grad=output_grad,
                         discarded=discarded, counts=None, setup=setup, calls=calls, seen=seen)
    full.obs = _OBSERVATION(idx=idx, norm_of=steady.entry_norms(norms, len(params), with_grad), loss=value, valid={}, updates=updates,
                            scale=None, sharded=set(), with_grad=with_grad, norms=norms, slices={}, holders={}, pieces={},
                            ex_parts={}, loss_cause=cause, eval_record=record, stale=stale, local=False)
    m.last_report = report = m._complete(full)
    carry.checks += 1
    yield report


def build(m, step: int, loss, optimizer):
    """The plain check's report (see the module docstring), or None: not a plain check, nothing
    changed (the full launch and completion run)."""
    t, carry, v, ranks = m.tracker, m.carry, m.view, m.ranks
    if (t is None or t._in_step or t.ran.captured or ranks.active or ranks.ddp is not None or v.stacks
            or m.scaler is not None or carry.valid or carry.router is not None or carry.window.n or m.unstepped is not None):
        return None  # (not a plain check)
    # (from here on: observe_rank's and observe's work on this input, in their order)
    sel = v.selection(optimizer)
    judged = [optimizer] if optimizer is not None else m.optimizers
    updates, steps_ran, t.pending = t.pending, t.steps_since_check, []
    t.witness.clear()
    stale = t.witness.take(v.entries, judged, len(judged) == 1)
    after_step, _ = t.ran.take(judged)  # (nothing captured: no step inside backward)
    m._after_step = after_step
    if m.masters.views:
        m.masters.checked(after_step)
    params, idx = v.params, sel.idx
    grads, there = grads_there(params if len(idx) == len(params) else [params[i] for i in idx])
    if there is not None:
        with_grad, grads = list(compress(idx, there)), list(compress(grads, there))
    else:
        with_grad = list(idx)
    loss_t = loss.detach() if isinstance(loss, Tensor) and loss.numel() == 1 else None
    flat = _read(grads, m._plan, loss_t) if not updates else None  # (the usual check: one kernel)
    if flat is not None:
        norms, value = (flat, None) if loss_t is None else (flat[:-1], flat[-1])
    else:
        parts = [] if loss_t is None else [loss_t]
        sizes = []
        for u in updates:  # (Layout.put's parts: a tensor, or several)
            packed, size = u.packed, u.size
            sizes.append(size)
            if isinstance(packed, list):
                parts += packed
            elif size:
                parts.append(packed)
        launched = stats.Launched(grads, parts, m._plan)
        m._plan = launched.plan
        norms, flat = launched.read()
        k = 0 if loss_t is None else 1
        for u, size in zip(updates, sizes):
            u.fetched(flat[k:k + size])
            k += size
        value = flat[0] if loss_t is not None else None
    cause = diagnose_loss(loss, m.model, carry.forward) if loss is not None else None
    record, carry.eval_backward = carry.eval_backward, None  # (carry.take_eval_backward)
    m._failed = None
    w = m._watch
    output_grad, carry.output_grad = carry.output_grad, None
    calls = w.calls.take() if w is not None and w.calls is not None else None

    if not stale and cause is None and record is None and (value is None or value - value == 0.0):  # (a finite loss: inf - inf and NaN are NaN)
        template = steady.ready(m, sel, optimizer, with_grad, norms, None, value, None, True)
        if template is not None:
            return steady.finish(m, template, step, optimizer, with_grad, norms, value, updates, steps_ran, after_step,
                                 None, True, grads)
    obs = _OBSERVATION(idx=idx, norm_of=steady.entry_norms(norms, len(params), with_grad), loss=value, valid={}, updates=updates, scale=None, sharded=set(),
                       with_grad=with_grad, norms=norms, slices={}, holders={}, pieces={}, ex_parts={}, stale=stale,
                       loss_cause=cause, eval_record=record)
    return m._complete(_LAUNCH(step=step, sel=sel, optimizer=optimizer, reeval=False, obs=obs, steps_ran=steps_ran,
                               after_step=after_step, output_grad=output_grad, discarded=None, counts=None, calls=calls))
