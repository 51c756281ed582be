"""Deferred checks (``lag=1``): a check that never makes the host wait for the device.

A synchronous check ends in one device-to-host transfer: on a GPU the host stops queueing kernels
until the device has drained, so the next step's launches no longer hide behind this step's work.
A deferred check launches one fused reduction per (device, dtype) group that is exact at once (it
accumulates in float64, see ``stats.Launched``: no max |g| pass, no re-check to come), packs the
numbers as the synchronous check does, starts a non-blocking copy of them into pinned host memory
with an event (two buffers and events per size, used in turn: nothing allocated per check), and
returns the report of the *previous* check, whose copy finished long ago (None at the first check;
``flush()`` and ``close()`` deliver the last one). What the rank saw besides numbers (the loss's cause, an eval
forward, stale gradients, a step that already ran on these gradients, the witnesses of its
gradients) is taken at launch, so each report is labelled with its own step and holds what the
synchronous check would have found for it. Where the two can differ:

* the norms accumulate in float64 (the synchronous check's in float32, re-checked exactly where
  they came back 0 or inf): the two agree to float32's rounding (within 1e-6), and exactly at the
  under- and overflow edges;
* the change test of the step after check N is armed when N is launched, from what the checks
  completed before it said (a synchronous check also uses N's own report);
* ``on_problem="raise"`` raises one check later; ``skip_spikes`` needs the norm on the host before
  the step and is refused with ``lag=1``;
* the NaN tracer is armed when the NaN's report completes (during the next step's check, after its
  forward), so it watches the forward after that and is resolved with that step's report;
* a report is judged with its own step's setup: the optimizers' membership and every
  ``requires_grad`` are taken at launch, and a check in flight completes against the parameters
  it was launched with before the monitor's view of them is rebuilt.

**The step guard on the device.** With ``skip_nonfinite=True`` the guard must act before
``optimizer.step()``. torch's fused optimizers (``fused=True`` Adam, AdamW, SGD, Adagrad, on CPU
too) take a ``found_inf`` device tensor and skip the step inside the kernel, as ``GradScaler`` uses
them: a deferred check hands them its "some gradient is non-finite" flag, decided from the packed
norms on the device (exact: non-finite exactly where a gradient holds a NaN or inf); the poisoned
step leaves parameters and optimizer state bit for bit as they were, and no host read happens. Any other optimizer needs the decision on the host: the guard reads
that one flag (a synchronisation) and says so once.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base.errors import GradHealthError, GradHealthInternalWarning
from ..base.hooks import guarded
from ..base.status import Status
from ..model.gradients import grads_of
from ..measure.observe import Pending, failed_observation
from ..measure.stale import witnesses
from ..measure.stats import dense_view, joined
from ..judge.classify import _REQUIRES_GRAD
from . import skipping

__all__ = ["Launch", "Transfer", "Deferred", "due_test"]

log = logging.getLogger("gradhealth")

_PLAIN = type(x for x in ())  # (a check in flight that is a plain check's generator, not a Launch: `gradhealth.check.quiet`)


@dataclass
class Launch:
    """One check from the moment it was made: what it judged and what the rank saw then."""

    step: int
    sel: object
    optimizer: object
    reeval: bool
    obs: object  # an Observation, or (deferred) a Pending until its numbers arrive
    steps_ran: int | None
    after_step: bool
    output_grad: object
    discarded: bool | None  # (deferred) were the armed check's gradients thrown away, as of launch
    counts: tuple | None  # (several optimizers: :mod:`gradhealth.judge.unstepped`) their step counts as of launch
    transfer: Transfer | None = None  # (deferred) its numbers on their way to the host
    ranks: list | None = None  # (deferred, torch.distributed) what DDP's hooks saw: see ``Monitor._reduce``
    setup: tuple | None = None  # (deferred) the optimizers' ids, all inside, every requires_grad: as launched
    calls: list | None = None  # the loop's calls into the model since the check before (:mod:`gradhealth.origin.calls`)
    seen: list | None = None  # (deferred, a plain check's) its gradients' witnesses, taken at launch (:mod:`.quiet`)
    lean: object = None  # (deferred, a plain check's, where a Launch was made for it) its generator: next() -> its report (:mod:`.quiet`)


def due_test(carry, report) -> bool:
    """Run the change test at the step after ``report``: after a step that changed nothing, or
    while a frozen parameter holds a gradient (momentum or weight decay may move it)."""
    frozen = report.frozen_names
    if frozen is None:  # (a report built elsewhere)
        frozen = [n for n, s in report.status.items() if s is Status.FROZEN]
    return carry.still > 0 or any(map(report.grad_norm.__contains__, frozen))


def _norms_now(view, sel) -> Tensor | None:
    """The judged gradients' norms, exact (float64), one kernel each: a failed observation's guard only."""
    grads = [g for g in grads_of([view.params[i] for i in sel.idx]) if g is not None]
    if not grads:
        return None
    device = grads[0].device
    return torch.stack([torch.linalg.vector_norm(dense_view(g.detach()), dtype=torch.float64).to(device) for g in grads])


def _said(step, exc: Exception, depth: int) -> None:
    warnings.warn(f"gradhealth: check at step {step} failed internally and was skipped ({type(exc).__name__}: {exc}); "
                  "training continues", GradHealthInternalWarning, stacklevel=depth)


class Transfer:
    """Packed device numbers on their way to host memory: a non-blocking copy into pinned memory and
    an event (on the CPU they are there already). :meth:`values` is the deferred path's only read.
    ``pinned``: the monitor's own buffers, (device, size, dtype) -> two (pinned buffer, event) pairs
    used in turn (one monitor has at most one check in flight; another monitor's checks, with
    their own buffers, never write into it)."""

    __slots__ = ("host", "event")
    HOST = "cpu"  # (the device type whose numbers are on the host already)

    def __init__(self, packed: Tensor | None, pinned: dict):
        self.host, self.event = packed, None  # (on the CPU they are there already)
        if packed is None:
            self.host = torch.zeros(0, dtype=torch.float64)
        elif packed.device.type != self.HOST:
            self.host, self.event = self._buffer(pinned, packed.device, packed.numel(), packed.dtype)
            self.host.copy_(packed, non_blocking=True)
            self.event.record()  # (re-recorded: nothing allocated per check)

    @staticmethod
    def _buffer(pinned: dict, device, n: int, dtype) -> tuple[Tensor, object]:
        key = (str(device), n, dtype)
        pair = pinned.get(key)
        if pair is None:
            pin = device.type == "cuda"
            new_event = (lambda: torch.Event(device=device)) if hasattr(torch, "Event") else torch.cuda.Event
            pair = pinned[key] = [(torch.empty(n, dtype=dtype, pin_memory=pin), new_event()) for _ in range(2)]
        pair.reverse()  # (the other one may still be read by a launch not completed yet)
        return pair[0]

    def values(self) -> list[float]:
        """The numbers, read: the deferred path's one read point. A Transfer's, its event waited for; or
        (``Transfer.values(packed)``) a packed tensor's that is in host memory already (a CPU check's
        plain launch makes no Transfer for it)."""
        if self.__class__ is not Transfer:
            return self.tolist()
        if self.event is not None:
            self.event.synchronize()  # (recorded a whole step ago: long complete)
        return self.host.tolist()


class Deferred:
    """The monitor's deferred checks: at most one in flight."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.inflight: Launch | None = None  # (or a plain unguarded check's generator: `gradhealth.check.quiet`)
        self._said_host_guard = False
        self._handles: dict = {}  # optimizer id -> the post-hook that takes the flag back after its step
        self._step = None  # the step of the check last completed
        self._launched = None  # the step of the plain check in flight (`gradhealth.check.quiet`)
        self.pinned: dict = {}  # this monitor's pinned buffers (:class:`Transfer`)
        self.early = None  # a report completed before a rebuild of the view (:meth:`settle`), not returned yet
        # a check completes in the call that launches the next one, after that one's forward (``traced``)
        monitor.carry.launching = True
        #: the step guard, decided at launch on the device (a grad scaler's own skip stands in for it)
        self.guarding = monitor.options.skip_nonfinite and monitor.scaler is None

    def check(self, step: int, loss, optimizer):
        """Complete the check in flight (its report, or None), then launch this one (also when the
        one in flight failed: under torch.distributed every rank fails it together, and goes on).
        A failure in either is said as a synchronous check's is, and loses nothing else."""
        done, m, prior, launch = self.early, self.monitor, self.inflight, None
        if done is not None:
            self.early = None  # (settled before a rebuild: its report is this call's)
        try:
            if prior is not None:
                try:
                    if prior.__class__ is _PLAIN:  # (a plain check's, unguarded: its report, kept and counted)
                        self.inflight = None
                        done = next(prior)
                    else:
                        done = self.complete()
                except GradHealthError:
                    raise
                except Exception as exc:  # (as a synchronous check's failure: said, and training goes on)
                    _said(self._launched if prior.__class__ is _PLAIN else prior.step, exc, 5)
            if m._steady:  # (a plain check, all of it: `gradhealth.check.quiet`)
                plain = m._later(step, loss, optimizer, self)
                launch = next(plain, None)  # (None: not a plain check, nothing changed)
                if launch is not None:
                    if launch is True:
                        self.inflight, self._launched = plain, step
                    else:  # (its step guard's Launch, holding it)
                        self.inflight, launch.lean = launch, plain
                    return done
            launch = m._launch(step, loss, optimizer, deferred=True)
            pending = launch.obs  # (not a Pending: this rank's observation failed; it joins the ranks flagged, later)
            if type(pending) is Pending:
                packed, with_grad = pending.launched.packed, pending.with_grad
            else:
                packed = with_grad = None
            if m.ranks.active:  # what DDP's hooks saw of this backward, read with the same copy
                packed = self._seen(launch, pending if with_grad is not None else None, packed)
            launch.transfer = Transfer(packed, self.pinned)
            v = m.view  # (what the report is judged against, as of now: the loop may change it before completion)
            requires = list(map(_REQUIRES_GRAD, v.params))
            launch.setup = ((v.optimizer_ids(), v.all_inside, requires) if optimizer is None
                            else (launch.sel.opt_ids, None, requires))
            tracker = m.tracker
            if with_grad is not None and tracker is not None and not launch.reeval:
                last = m.last_report  # (and a frozen parameter holding a gradient now: its step may move it)
                tracker.arm(step, m.optimizers if optimizer is None else [optimizer],
                            last is not None and due_test(m.carry, last) or not all(map(requires.__getitem__, with_grad)))
                if not launch.after_step:
                    m.carry.stage(step, launch.seen if launch.seen is not None else witnesses(v.params, with_grad))
            elif tracker is not None and not launch.reeval and type(pending) is not Pending:  # (failed here alone)
                tracker.disarm(m.optimizers if optimizer is None else [optimizer])
            if self.guarding:
                norms = None if with_grad is not None else _norms_now(v, launch.sel)  # (a failed observation: taken again)
                if with_grad is not None or norms is not None:
                    self._guard(launch, norms)
            self.inflight = launch
        except GradHealthError:
            raise
        except Exception as exc:  # (the report completed above is not lost with it)
            if m.ranks.active and launch is not None and self.inflight is not launch:
                self._join_flagged(launch, exc)
            _said(step, exc, 5)
        return done

    def _seen(self, launch: Launch, pending: Pending | None, packed: Tensor | None) -> Tensor | None:
        """(torch.distributed) What DDP's hooks saw of this backward, taken now; the tensor to copy
        to the host: the check's own numbers, then those of the hooks' (read with the same copy)."""
        r, m = self.monitor.ranks, self.monitor
        snap = r.origin.snapshot([m.view.params[i] for i in launch.sel.idx]) if r.origin else None
        launch.ranks = [snap, None, r.origin is not None and r.origin.unsynced() and bool(pending and pending.with_grad),
                        r.take_nosync_step()]
        if snap is not None and snap[1] is not None:
            packed = snap[1] if packed is None else joined([packed, snap[1]])
        return packed

    def _join_flagged(self, launch: Launch, exc: Exception) -> None:
        """A launch that failed on this rank after its observation still completes with the other
        ranks' checks: an empty contribution and the failure flag in that check's one collective
        (every rank skips the check together; no rank waits in a collective another never joins)."""
        m, pending = self.monitor, launch.obs
        if type(pending) is Pending:
            launch.obs = failed_observation(m.view, launch.sel, *pending.asked)
        m._failed, launch.setup = exc, None
        launch.transfer = Transfer(None, self.pinned)  # (nothing of this rank's is read: DDP's hooks' neither)
        launch.ranks = [None, None, False, launch.ranks[3] if launch.ranks is not None else m.ranks.take_nosync_step()]
        self.inflight = launch

    def launched_at(self, step) -> bool:
        """Whether the check in flight was launched at ``step`` (the adapters keep what it saw)."""
        inflight = self.inflight
        return inflight is not None and (self._launched if inflight.__class__ is _PLAIN else inflight.step) == step

    def settle(self) -> None:
        """Before the monitor's view of the parameters is rebuilt: complete the check in flight now,
        against the parameters it was launched with; :meth:`check` returns its report."""
        if self.inflight is not None:
            self.early = self._completed(6)

    def drain(self):
        """(``flush()``) The report not delivered yet: one settled early, or the check in flight's
        (its failure said, not raised); None when there is none."""
        report, self.early = self.early, None
        if report is not None or self.inflight is None:
            return report
        self.monitor.carry.launching = False  # (no check is launched after this one: see ``traced``)
        try:
            return self._completed(5)
        finally:
            self.monitor.carry.launching = True

    def _completed(self, depth: int):
        """:meth:`complete`, a failure said (``depth``: the user's frame, for the warning)."""
        try:
            return self.complete()
        except GradHealthError:
            raise
        except Exception as exc:  # (as a synchronous check's failure: said, and training goes on)
            _said(self._step, exc, depth)
            return None

    def complete(self):
        """The report of the check in flight (its numbers read now: their copy finished long ago)."""
        launch, self.inflight, m = self.inflight, None, self.monitor
        if launch.__class__ is _PLAIN:  # (a plain check's, unguarded: `gradhealth.check.quiet`'s generator, its report kept and counted)
            self._step = self._launched
            return next(launch)
        self._step = launch.step
        lean = launch.lean  # (a plain check's, guarded: the same generator, in the Launch its guard needs)
        if lean is not None:
            report = next(lean)  # (kept and counted)
        else:
            report, pending = None, launch.obs
            values = launch.transfer.values()  # (the one transfer point)
            if launch.ranks is not None:  # (torch.distributed: the ranks' numbers follow the check's own)
                values = self._split(launch, pending, values)
            if type(pending) is Pending:
                try:
                    launch.obs = pending.complete(values)
                except Exception as exc:
                    if not m.ranks.active:
                        raise  # (the other ranks must not be left waiting in the collective: joined, flagged)
                    launch.obs, m._failed = failed_observation(m.view, launch.sel, *pending.asked), exc
            m.last_report = report = m._complete(launch)
            m.carry.checks += 1
        if self.guarding:
            self._guard_finding(report, launch)
        return report

    def _guard_finding(self, report, launch: Launch) -> None:
        """A poisoned step was skipped at launch: the finding."""
        m = self.monitor
        v = m.view
        skipping.guard(report, m.options, m.carry, None, [v.params[i] for i in launch.sel.idx], False, None,
                       drop=False, kept=all(map(fused, [launch.optimizer] if launch.optimizer else m.optimizers)))

    @staticmethod
    def _split(launch: Launch, pending, values: list[float]) -> list[float]:
        """The check's own numbers; DDP's hooks' (after them) into ``launch.ranks``."""
        packed = pending.launched.packed if type(pending) is Pending else None
        k = 0 if packed is None else packed.numel()
        values, launch.ranks[1] = values[:k], values[k:]
        return values

    # ------------------------------------------------------------------ the step guard
    def _guard(self, launch: Launch, norms=None) -> None:
        """Make the step after this check skip itself when a gradient is non-finite, decided on the
        device where the optimizer can take it (see the module's docstring). ``norms``: where this
        rank's observation failed, the gradients' norms taken now (the other ranks decide alike)."""
        m = self.monitor
        norms = launch.obs.launched.norms_part() if norms is None else norms
        if norms is None:
            return
        flag = (~torch.isfinite(norms)).any().to(torch.float32)  # (0-d, as GradScaler hands it over)
        judged = [launch.optimizer] if launch.optimizer is not None else m.optimizers
        host = [opt for opt in judged if not fused(opt)]
        for opt in judged:
            if opt not in host:
                device = next((p.device for g in opt.param_groups for p in g["params"]), flag.device)
                opt.found_inf = flag.to(device, non_blocking=True)
                if id(opt) not in self._handles:
                    self._handles[id(opt)] = opt.register_step_post_hook(guarded(_forget_found_inf, "step post-hook (lag=1)"))
        v = m.view
        inside = v.optimizer_ids() or set()  # (kept while the param_groups hold: no pass over them per check)
        if len(host) < len(judged) and not v.all_inside:  # gradients no optimizer consumes: emptied on the device
            outside = [g for i in launch.sel.idx if v.pids[i] not in inside
                       and (g := v.params[i].grad) is not None and g.layout is torch.strided]
            for g in outside:
                g.masked_fill_(flag.to(g.device, non_blocking=True).bool(), 0.0)
        if host:
            if not self._said_host_guard:
                self._said_host_guard = True
                names = ", ".join(sorted({type(o).__name__ for o in host}))
                log.warning("gradhealth: skip_nonfinite with lag=1 and %s (not a fused torch optimizer): the guard "
                            "reads one flag on the host before each step (a synchronisation). A fused optimizer "
                            "(torch.optim.AdamW(..., fused=True)) takes the decision on the device.", names)
            if bool(flag.item()):  # (the one host read this guard needs)
                for i in launch.sel.idx:
                    v.params[i].grad = None

    def close(self) -> None:
        for h in self._handles.values():
            h.remove()
        self._handles = {}


def fused(opt) -> bool:
    """Does ``opt`` take a ``found_inf`` tensor and skip its step inside the kernel (torch's fused
    optimizers, as ``GradScaler`` drives them)?"""
    return (type(opt).__module__.startswith("torch.optim.") and bool(getattr(opt, "_step_supports_amp_scaling", False))
            and any(g.get("fused") for g in opt.param_groups))


def _forget_found_inf(opt, _args, _kwargs) -> None:
    if hasattr(opt, "found_inf"):
        del opt.found_inf
