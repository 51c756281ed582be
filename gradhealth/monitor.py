"""``GradHealth``: the plain-loop monitor, a facade that orders the stages of one ``check()``.

A check, in order (each step names the module that does it; ``gradhealth/``'s subpackages are the stages, the
imports between them running one way: docs/design.md, "Layout"):

1. gate: ``every_n_steps``, DDP ``no_sync``, an engine's accumulation window (here);
2. gather and ONE transfer: the judged gradients' exact norms with the loss, valid counts, the
   previous optimizer step's update numbers and the scaler's scale (:mod:`gradhealth.measure.observe`);
3. under ``torch.distributed``, ONE all_reduce of a packed vector (:mod:`gradhealth.ranks.crossrank`);
4. classify: the six-state decision tree (:func:`gradhealth.judge.classify.classify_selection`) -> ``Report``;
5. resolve the previous optimizer step: its update norms, or why it did not run (:mod:`gradhealth.check.carry`);
   transient or persistent NO_GRAD / ZERO_GRAD (:mod:`gradhealth.judge.patience`);
6. judges: loss, eval mode, stale gradients, AMP, empty masks, expect_frozen, NaN origin,
   replicas (:mod:`gradhealth.judge.judges`, :mod:`gradhealth.ranks.crossrank`, :mod:`gradhealth.origin.replay`); then the norm history;
7. arm the next step: the update tracker's snapshot, gradient witnesses (:mod:`gradhealth.measure.deltas`);
8. ``publish``: every sink, then the policy warns or raises (:mod:`gradhealth.publish.policy`).

An optimizer step that follows check N is measured on the device by the optimizer's own step
hooks; its numbers travel in check N+1's transfer (or ``flush()``/``close()``), are written into
report N, which sinks receive again through ``write_update(report)``; report N+1 carries the same
findings, so the policy acts on them at check N+1 at the latest.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import Tensor, nn

from .base.errors import GradHealthError, GradHealthInternalWarning
from .base.hooks import Owned
from .base.quick import quick
from .base.report import Report
from .model.masters import Masters
from .model.optimizers import as_optimizers, unwrap_optimizer, wrapper_scaler
from .model.params import ModelChanges, ParamView, Selection
from .model.wrappers import unwrap
from .measure import stats
from .measure.deltas import UpdateTracker
from .measure.observe import Observation
from .ranks import crossrank, lockstep
from .ranks.ddp import Ranks
from .ranks.replicas import Replicas, group_members, reduce_check, verify_step
from .judge import verdict
from .judge.classify import classify_selection, fill_experts
from .judge.guards import ForwardWatch, diagnose_loss
from .judge.patience import persist
from .judge.unstepped import Unstepped
from .publish.policy import Publisher, alarm, explain
from .check import clip, quiet, skipping, steady
from .check import state as checked
from .check.carry import Carry
from .check.deferred import Deferred, Launch, due_test
from .check.launch import launch
from .options import Options, check_scaler, check_step, check_tensor

__all__ = ["GradHealth"]

log = logging.getLogger("gradhealth")
_REPORT = quick(Report)  # (a Report as Report(...) makes it, without its __init__'s per-field tests)


class GradHealth:
    """Classify every parameter after each backward pass and report what is wrong.

    Args:
        model: the module being trained, under any wrappers (names are its own: `gradhealth.model.wrappers`).
        optimizer: one optimizer, a list of them, or None (then NOT_IN_OPTIMIZER, deltas and
            STALE_GRAD are not available).
        scaler: a ``torch.amp.GradScaler``: norms unscaled, a step the scaler skips AMP_SKIPPED.
        ddp_model: the DistributedDataParallel wrapper, when it cannot be found from ``model``.
        options: an [Options][gradhealth.Options]; keyword options (``on_problem="raise"``, ...) on top.
    """

    def __init__(self, model: nn.Module, optimizer=None, *, scaler=None, ddp_model=None,
                 options: Options | None = None, **kwargs):
        self.options = o = Options.build(options, **kwargs)
        self.model = model
        scaler = wrapper_scaler(optimizer) if scaler is None else scaler  # Accelerate's wrapper carries one
        self.optimizers = as_optimizers(optimizer)
        self.masters = Masters(self.optimizers)  # (optimizers that train through masters: DeepSpeed, fp16 wrappers)
        scaler = self.masters.loss_scale() if scaler is None else scaler  # (an fp16 wrapper's own loss scale)
        self.view = ParamView(model, self.optimizers, o.experts, strict=True)
        self.scaler = check_scaler(scaler)
        self.ranks = Ranks(model, ddp_model, o.rank_origin, self.optimizers)
        self.replicas = Replicas(o.grad_sync, self.ranks)  # where the gradients are reduced
        self.carry = Carry(o.history)
        self.carry.patience = o.grad_patience
        self.publisher = Publisher(o.sinks, o.on_problem)
        self.publisher.emit_warnings = self.ranks.rank == 0  # the same verdict is on every rank; rank 0 says it
        self.last_report: Report | None = None
        self._closed = False
        self._plan, self._shards, self._clip_source, self._after_step = None, (set(), {}), False, False
        self._unwrapped: dict[int, tuple] = {}  # id -> (an optimizer given to check(), the monitor's it stands for)
        self._given = self._given_as = None  # the last of them, and the monitor's it stands for
        self.tracker = (UpdateTracker(self.view.entries, self.optimizers, mode=o.deltas, update_every=o.update_every,
                                      change_every=o.change_every, held=self.masters.held())
                        if self.optimizers else None)
        if self.tracker is not None:  # (to name a zero_grad() between backward() and step())
            self.tracker.before_step = self.carry.note_step_start
        self.unstepped = Unstepped() if len(self.optimizers) > 1 else None  # (one optimizer: a skipped step)
        self._watch = (ForwardWatch(model, unwrap(model), self.carry, bool(self.view.stacks), o.trace_on_nonfinite)
                       if o.watch_forward else None)
        self._changes = ModelChanges(model)
        self._owned = Owned(self, self._watch, self._changes, self.tracker, self.carry, self.ranks, self.masters)
        if self.tracker is not None:
            self.masters.attach(self.tracker)
            if self.ranks.active:  # where the replicas are reduced: inferred per optimizer, verified in its step
                self.replicas.members, self.tracker.after_step = self._members, self._verify
        self._missed = lockstep.MissedChecks.attach(self)  # (a rank whose loop skips a check() joins it from its step)
        self._deferred = Deferred(self) if o.lag else None
        self._owned.deferred = self._deferred
        self._changes.note_lazy()

    # ------------------------------------------------------------------ public
    def check(self, loss: Tensor | None = None, *, step: int | None = None, optimizer=None) -> Report | None:
        """Classify every parameter now (call after ``loss.backward()``).

        Returns the [Report][gradhealth.Report], or None on a call that ``every_n_steps`` skips, inside DDP's
        ``no_sync()`` or between an engine's accumulation boundaries (`gradhealth.model.accumulation`). ``loss``, when
        given, is judged too (can it produce gradients? is it finite?) in the same transfer.
        ``step`` overrides the monitor's own count of calls (e.g. a trainer's global step).
        ``optimizer`` (one of the monitor's) judges only that optimizer's parameters: the check
        before its step when several optimizers take turns (GANs, manual optimization).
        """
        report = self.measure(loss, step=step, optimizer=optimizer)
        if report is not None:
            self.publish(report, stacklevel=3)
        return report

    def measure(self, loss: Tensor | None = None, *, step: int | None = None, optimizer=None) -> Report | None:
        """The first half of [check][gradhealth.GradHealth.check]: build the report, send it nowhere yet (for adapters
        that add to it first); [publish][gradhealth.GradHealth.publish] then sends it to the sinks and the policy."""
        if self._closed:
            warnings.warn("gradhealth: check() on a closed monitor does nothing", GradHealthInternalWarning, stacklevel=3)
            return None
        if self.ranks.defers():  # (partial gradients: the window's end judges them, with what this call saw; None)
            return self.carry.window.add(loss, self.carry.take_valid())
        if self._changes.stale(self.last_report, self.view):  # (a deferred check in flight is judged with the parameters it was launched with)
            self._deferred is None or self._deferred.settle()
            self._refresh()
        if loss is not None:
            check_tensor("check(loss=...)", loss, optional=True)
        if optimizer is not None:  # (unwrapped once per object given: a wrapper holds its optimizer for the run)
            if optimizer is self._given:  # (the one given last: a loop gives the same one at every check)
                optimizer = self._given_as
            else:
                known = self._unwrapped.get(id(optimizer))
                if known is None or known[0] is not optimizer:
                    known = (optimizer, unwrap_optimizer(optimizer))
                    self.view.optimizer_index(known[1])  # a clear error for an optimizer the monitor does not know
                    self._unwrapped[id(optimizer)] = known
                self._given, self._given_as = known
                optimizer = known[1]
        if self._missed is not None:
            self._missed.called(step, optimizer)
        s = self._gate(step if step is None else check_step(step))
        if s is None:
            return None
        try:  # (inside inference_mode, the check's own tensors must be ordinary ones: they are updated later)
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False):
                    if self._deferred is not None:
                        return self._deferred.check(s, loss, optimizer)
                    report = self._build(s, loss, optimizer)
            elif self._deferred is not None:  # (lag=1: this check launched, the previous one's report)
                return self._deferred.check(s, loss, optimizer)
            else:
                report = self._build(s, loss, optimizer)
        except GradHealthError:  # said on purpose: a verdict, or the user's own mistake named
            raise
        except Exception as exc:  # an internal error never breaks a training run, whatever on_problem
            warnings.warn(f"gradhealth: check at step {s} failed internally and was skipped ({type(exc).__name__}: "
                          f"{exc}); training continues", GradHealthInternalWarning, stacklevel=3)
            return None
        self.carry.checks += 1
        self.last_report = report
        o = self.options
        if o.skip_nonfinite or o.skip_spikes is not None:  # the step guard (:mod:`gradhealth.check.skipping`)
            v = self.view  # every judged parameter, in an optimizer or not (no zero_grad() clears the others)
            skipping.guard(report, o, self.carry, self.carry.history_for(report.optimizer_index),
                           [v.params[i] for i in v.selection(optimizer).idx], self.scaler is not None, self.tracker)
        return report

    _steady, _template = True, None  # (False: every check takes the full path; the tests compare the two)
    _steady_report = False  # (deferred) the last report the steady completion made (:mod:`gradhealth.check.quiet`)

    _members = lambda self: group_members(self.view.pids, self.optimizers)  # noqa: E731
    _verify = lambda self, opt: verify_step(self, opt)  # noqa: E731 (:mod:`gradhealth.ranks.replicas`)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None, *, parameters=None, unscale: bool = True) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` right after ``check()`` (of ``parameters``, default: every
        parameter with a gradient) with the check's norms: the gradients are read once (`gradhealth.check.clip`)."""
        return clip.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach, parameters, unscale)

    def publish(self, report: Report, stacklevel: int = 2) -> None:
        """The second half of [check][gradhealth.GradHealth.check]: every sink gets the report, then the policy acts."""
        self.publisher.publish(report, stacklevel)

    def track_valid(self, mask: Tensor, name: str = "valid") -> None:
        """Record how many elements ``mask`` selects in this step (a device sum, no host sync).

        Read with the next check: its report's ``valid_counts[name]``, and EMPTY_VALID_SET if 0.
        Several calls with one name in a step (micro-batches) add up.
        """
        self.carry.add_valid(mask, name)

    def flush(self) -> None:
        """Fetch the last measured optimizer step now (one transfer) instead of at the next check;
        with ``lag=1``, first deliver the check in flight (its report reaches the sinks and the policy)."""
        report = self._deferred.drain() if self._deferred is not None else None  # (a failure: said)
        try:
            if report is not None:
                self.publish(report)
        finally:  # (its verdict raised, under raise, once the updates reached the sinks)
            self._flush_updates()

    def _flush_updates(self, owe: bool = False) -> None:
        """``owe``: the findings also go into the next report (``state_dict()``: a resumed run's next
        report carries them as the run that saved it does). With ``lag=1`` and a check in flight, they
        wait for the next launch (that check's report, not yet armed, is theirs)."""
        tracker = self.tracker
        if tracker is None or not tracker.pending or self._deferred is not None and self._deferred.inflight is not None:
            return
        updates, tracker.pending = tracker.pending, []
        values, k = stats.fetch([p for u in updates for p in u.pieces]), 0
        for u in updates:
            u.fetched(values[k : k + u.size])
            k += u.size
            tracker.settle(u)
        if self.ranks.active:  # (every rank flushes together, at close() or Trainer's logging: shards summed)
            crossrank.reduce_updates(updates, len(self.view), self._shards, self.ranks)
        delivery = self.carry.resolve_step(None, updates, 0, self.view.params, self.view.names, None, False,
                                           self.options.amp_skip_alarm)
        self.publisher.deliver(delivery, None)
        if owe and delivery is not None:
            self.carry.owed += delivery.findings

    def close(self, _verdict: bool = True) -> None:
        """Remove every hook this monitor installed; flush and close every sink. Idempotent."""
        if self._closed:
            return self.publisher.close()  # a retry: the sinks that did not close
        verdict = None
        try:
            self.flush()
        except GradHealthError as exc:  # (lag=1: the last check's verdict, raised once everything is closed)
            verdict = exc
        except Exception as exc:
            warnings.warn(f"gradhealth: could not fetch the last step's updates: {exc}", GradHealthInternalWarning, stacklevel=2)
        self._closed = True
        self._owned.release()
        self.publisher.close()  # (every sink, even when one raises; a second close() retries the rest)
        if verdict is not None and _verdict:
            raise verdict

    __enter__ = lambda self: self  # noqa: E731
    __exit__ = lambda self, *exc: self.close(exc[0] is None)  # noqa: E731 (over an exception on its way: not raised)

    def state_dict(self) -> dict:
        """Everything a later verdict rests on: the progress, the norm histories and every story the
        checks keep (plain Python, for checkpoints; versioned: `gradhealth.check.state`). The optimizer step
        taken since the last check is measured now (one transfer): its findings reach that check's
        report, and the next report, as they would have."""
        return checked.save(self)

    def load_state_dict(self, state: dict) -> None:
        """All or nothing, every key checked (`gradhealth.check.state`); a state from another model is refused;
        one from an older version loads what it has, and a warning names what starts fresh."""
        checked.load(self, state)

    def rearm_tracer(self, step: int) -> None:
        """The NaN tracer a check armed before the checkpoint, for the step that follows (`gradhealth.origin.replay.traced`)."""
        checked.rearm(self, step)

    parameter_names = property(lambda self: list(self.view.names))
    history = property(lambda self: self.carry.history, doc="The norm history of checks over every parameter (None when off).")

    emit_warnings = property(lambda self: self.publisher.emit_warnings,
                             lambda self, value: setattr(self.publisher, "emit_warnings", bool(value)),
                             doc="False silences this monitor's warnings (not its raises): on ranks other than zero.")

    forward_record = property(lambda self: self.carry.forward, doc="What the monitor saw when the model's forward last ran.")

    def diagnose_loss(self, loss) -> str | None:  # (gradhealth.judge.guards.diagnose_loss with what this monitor saw of the forward)
        return diagnose_loss(loss, self.model, self.carry.forward)

    alarm = staticmethod(alarm)
    explain = staticmethod(explain)

    # ---------------------------------------------------------------- stages
    def _refresh(self) -> None:
        """Rebuild the view of the model's parameters (and what depends on it) if they changed:
        a registration that put back the same tensors (``module.w += 1`` re-sets the attribute)
        changes nothing, so every rank keeps the same layout."""
        view = ParamView(self.model, self.optimizers, self.options.experts)
        self._changes.note_lazy()
        if [(n, id(p)) for n, p in view.entries] == [(n, id(p)) for n, p in self.view.entries]:
            self.view.meta_names = view.meta_names  # (a meta parameter attached: named at every check)
            return
        self.view = view
        self._plan = None
        self.carry.armed = None  # its step's numbers would refer to the old parameters
        self.unstepped = Unstepped() if self.unstepped is not None else None
        if self.tracker is not None:
            self.tracker.rebind(self.view.entries)
        if self._watch is not None:
            self._watch.remove()
            kept = self._watch.calls
            self._watch = self._owned.watch = ForwardWatch(self.model, unwrap(self.model), self.carry,
                                                           bool(self.view.stacks), kept is not None)
            if kept is not None:  # (this step's calls, for this check)
                self._watch.calls.kept = kept.kept

    def _gate(self, step: int | None) -> int | None:
        s = self.carry.calls if step is None else step
        self.carry.calls += 1
        if s % self.options.every_n_steps:
            self.carry.window.take()  # (a window ends here, unjudged: the next starts afresh)
            if self._watch is not None and self._watch.calls is not None:
                self._watch.calls.kept.clear()  # (their step is not judged)
            if self.tracker is not None:
                self.tracker.disarm()  # the step after a skipped call is not measured
            return None
        return s

    def _build(self, step: int, loss, optimizer) -> Report:
        report = quiet.build(self, step, loss, optimizer) if self._steady else None  # (a plain check: `gradhealth.check.quiet`)
        return report if report is not None else self._complete(self._launch(step, loss, optimizer))

    _launch = launch  # (:mod:`gradhealth.check.launch`: the device numbers and what the rank saw)
    _later = quiet.later  # (a plain deferred check's launch and what follows it: :mod:`gradhealth.check.quiet`)

    def _complete(self, launch: Launch) -> Report:
        """The report of a launched check, from its numbers on the host (a healthy steady-state one: `gradhealth.check.steady`)."""
        if self._steady:
            report = steady.complete(self, launch)
            if report is not None:
                return report
        step, sel, optimizer, reeval, obs = launch.step, launch.sel, launch.optimizer, launch.reeval, launch.obs
        across = self._reduce(obs, launch.ranks) if self.ranks.active else None
        report = self._classify(step, sel, obs, optimizer, launch.setup)
        if self.view.stacks:
            fill_experts(report, self.view.stacks, obs.slices, obs.router)
        if not reeval:
            delivery = self.carry.resolve_step(report, obs.updates, launch.steps_ran, self.view.params, self.view.names,
                                               obs.scale, self.scaler is not None, self.options.amp_skip_alarm,
                                               launch.after_step, launch.discarded)
            self.publisher.deliver(delivery, report)
            if self.carry.owed:  # (the findings about the step before a state_dict(), as they would have come now)
                report.findings += self.carry.owed
                self.carry.owed = []
        for u in obs.updates:
            self.tracker.settle(u)
        if self.unstepped is not None and not reeval:
            report.findings += self.unstepped.update(self.view, report.optimizer_index, *launch.counts,
                                                     report.status, step, self.options.grad_patience)
        fit = self.carry.fit
        nothing = fit.nothing_to_learn(report) if report.loss == 0.0 else []  # (the loss's zeros: :mod:`gradhealth.judge.fitted`)
        report.findings += nothing or persist(  # transient or persistent NO_GRAD / ZERO_GRAD: which ones are tolerated now
            report, self.carry.streaks, self.options.grad_patience, self.view.names, self.view.params,
            launch.transfer is None)
        report.findings += self.carry.streaks.faint_reader.prefix(report.status, report.grad_norm, step,
                                                                  self.options.grad_patience)  # (:mod:`gradhealth.judge.underflow`)
        if self.tracker is not None and not reeval:
            report.findings += self.carry.pileup.update(report, self.view.names, self.view.params, self.tracker)
        report.findings += verdict.judge(self, report, obs, across, sel, launch)
        v = self.view
        report.module_grad_norm = stats.module_norms(obs.with_grad, obs.norms, v.module_index, v.modules,
                                                      v.module_runs)
        history = self.carry.history_for(report.optimizer_index)
        if history is not None and not nothing:
            report.findings += fit.explain(history.update(step, report.total_grad_norm, report.module_grad_norm,
                                                            self.carry.streaks.skipping), report.loss, step)
        fit.add(report.loss)
        if not reeval:
            self._arm_next(report, obs, optimizer, launch)
        if launch.transfer is None:  # (for a clip_grad_norm_ that follows; a deferred check's norms come too late)
            clip.keep(self, report, obs.with_grad, obs.norms, optimizer is None)
        return report

    _reduce = lambda self, obs, seen=None: reduce_check(self, obs, seen)  # noqa: E731 (:mod:`gradhealth.ranks.replicas`)

    def _classify(self, step: int, sel: Selection, obs: Observation, optimizer, setup=None) -> Report:
        v = self.view  # (``setup``: a deferred check's (optimizers' ids, all inside, requires_grad), as launched)
        ids, inside, requires = setup or (sel.opt_ids if optimizer is not None else v.optimizer_ids(),
                                          v.all_inside if optimizer is None else None, None)
        status, in_opt, not_ok, frozen = classify_selection(v.names, v.params, v.pids, sel.idx, obs.norm_of, ids,
                                                            obs.norms, inside, requires)
        return _REPORT(step=step, status=status, grad_norm=dict(zip(map(v.names.__getitem__, obs.with_grad), obs.norms)),
                      total_grad_norm=stats.combine_norms(obs.norms), meta=v.meta,
                      in_optimizer=in_opt, loss=obs.loss, valid_counts=obs.valid, not_ok=not_ok, frozen_names=frozen,
                      optimizer_index=v.optimizer_index(optimizer) if optimizer is not None else None)

    def _arm_next(self, report: Report, obs: Observation, optimizer, launch: Launch) -> None:
        if self.tracker is not None:  # the change test runs now after a step that changed nothing, or
            # while a frozen parameter holds a gradient (momentum or weight decay may move it)
            if launch.transfer is None:  # (a deferred check armed its step when it was launched)
                self.tracker.arm(report.step, [optimizer] if optimizer is not None else self.optimizers, due_test(
                    self.carry, report))
            if launch.after_step:  # its gradients' step already ran: no step is owed them
                self.carry.armed = None
            else:  # (deferred: the witnesses staged at launch)
                self.carry.arm(report, self.view.params, obs.with_grad if launch.transfer is None else None, obs.scale)
        self.carry.last_scale = obs.scale
