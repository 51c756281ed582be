"""``Carry``: everything a monitor keeps from one check to the next, in one place.

The check counters, the report whose optimizer step is still to be measured (and the gradient
witnesses that tell a skipped step from gradient accumulation), the grad scaler's last scale and
the AMP skips in a row, the armed NaN tracer, what the forward watch saw, the valid counts
recorded since the last check, the norm histories (one per optimizer when checks are made per
optimizer) and each unit's record of checks with and without a usable gradient. ``state_dict()`` holds what a checkpoint must keep.
"""

from __future__ import annotations

import copy
import math
import operator
import weakref
from dataclasses import dataclass, field
from collections import deque
from itertools import compress, repeat

import torch
from torch import Tensor

from ..base import saved as checked
from ..base.findings import Finding, FindingKind
from ..base.report import Report
from ..base.status import Status
from ..measure.observe import ForwardRecord
from ..measure.stale import discarded, witnesses
from ..measure.steps import StepStats
from ..measure.window import Window
from ..judge import judges
from ..judge.fitted import LossFit
from ..judge.history import NormHistory
from ..judge.patience import Persistence
from ..judge.pileup import PileUp

__all__ = ["Carry", "Delivery"]


@dataclass
class Delivery:
    """Findings about an earlier check's optimizer step, for its report (and the current one)."""

    target: Report
    findings: list[Finding] = field(default_factory=list)


class Carry:
    def __init__(self, history: NormHistory | None):
        self.calls = 0  # check() calls, skipped ones included
        self.checks = 0  # checks that produced a report
        self.armed: Report | None = None  # the report whose optimizer step is pending
        self.witnesses: list[tuple[weakref.ref, weakref.ref, int]] = []  # (parameter, its gradient, version)
        self.last_scale: float | None = None
        self.amp_skips = 0
        self.amp_settled = False  # a step has run under the grad scaler: its scale has settled
        self.tracer = None
        self.trace_from: int | None = None
        self.trace_said: set = set()  # (each tracer hook's failure said once per monitor)
        self.trace_ops = False  # the last traced failing step named no module: watch the operations next time
        #: (lag=1, but at ``flush()``) a check completes in the call that launches the next one, whose
        #: forward ran before: a tracer armed then watches the forward after it, and waits one completion more
        self.launching, self.trace_wait = False, False
        self.forward: ForwardRecord | None = None
        self.eval_backward: ForwardRecord | None = None
        self.frozen_norms: set[str] = set()  # normalisation layers run in eval with frozen affine parameters
        self.frozen_norms_said = False
        self.norm_eval: set[str] = set()  # normalisation layers run in eval with trainable affine parameters
        self.norm_eval_said = False
        self.reentrant = False  # a module ran under a reentrant torch.utils.checkpoint
        self.valid: dict[str, Tensor] = {}
        self.window = Window()  # the deferred checks of the accumulation window under way (:mod:`gradhealth.measure.window`)
        self.router: list[Tensor] | None = None  # tokens per expert of each MoE layer since the last check
        #: the model's outputs since the last check and the gradients that reached them, read only at a
        #: check with NaN/inf gradients (:func:`gradhealth.judge.guards.output_maxima`)
        self.output_grad: list | None = None
        # the options' history is a template: each monitor keeps copies of its own (the default one,
        # for checks of every parameter, and one per optimizer)
        self.history = copy.deepcopy(history)
        self._template = copy.deepcopy(history)
        self.histories: dict[int, NormHistory] = {}  # per optimizer index
        self.streaks = Persistence()  # each unit's gaps without a usable gradient, and its past rate
        self.still = 0  # consecutive steps that changed no OK parameter (with lr > 0) that was decided
        self._still_seen: set[int] = set()  # ... the entries those steps decided
        self.skips = 0  # optimizer steps the step guard dropped (skip_nonfinite / skip_spikes)
        self.skips_in_a_row = 0
        self.gone: set[int] = set()  # the checks whose gradients were gone when their step began
        self.witness_step: int | None = None  # the check the witnesses are of
        self.patience = 3
        self.fit = LossFit()  # what the loss explains about the gradients (:mod:`gradhealth.judge.fitted`)
        self.pileup = PileUp()  # gradients growing with no step that changes their parameter
        #: findings about a step resolved at ``state_dict()`` (delivered to its report): the next report carries them
        self.owed: list[Finding] = []

    # ---------------------------------------------------------------- between
    def add_valid(self, mask: Tensor, name: str) -> None:
        """``monitor.track_valid``: this step's count of ``mask`` (a device sum, no host sync)."""
        if not isinstance(mask, Tensor):
            raise TypeError(f"track_valid: mask must be a torch.Tensor; got {type(mask).__name__}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"track_valid: name must be a non-empty str (the key in report.valid_counts); got {name!r}")
        self.add_count((mask if mask.dtype == torch.bool else mask != 0).sum(), name)

    def add_count(self, count, name: str) -> None:
        """A count already made (the Trainer adapter's label tokens), added to this step's ``name``."""
        count = torch.as_tensor(count).detach().reshape(-1).sum()
        prev = self.valid.get(name)
        self.valid[name] = count if prev is None else prev + count.to(prev.device)

    def take_valid(self) -> dict[str, Tensor]:
        valid, self.valid = self.valid, {}
        return valid

    def take_router(self) -> list[Tensor] | None:
        router, self.router = self.router, None
        return router

    def take_output_grad(self) -> list | None:
        seen, self.output_grad = self.output_grad, None
        return seen

    def take_eval_backward(self) -> ForwardRecord | None:
        record, self.eval_backward = self.eval_backward, None
        return record

    def history_for(self, optimizer_index: int | None) -> NormHistory | None:
        if self.history is None or optimizer_index is None:
            return self.history
        h = self.histories.get(optimizer_index)
        if h is None:
            h = self.histories[optimizer_index] = copy.deepcopy(self._template)
        return h

    def arm(self, report: Report, params: list, with_grad: list[int] | None, scale: float | None) -> None:
        """Remember ``report`` until its optimizer step is measured, and a few of its gradients
        (``with_grad`` None: the witnesses a deferred check staged when it was launched)."""
        self.armed = report
        if with_grad is not None:
            self.stage(report.step, witnesses(params, with_grad))
        self.last_scale = scale

    def stage(self, step: int, seen: list) -> None:
        """The witnesses of check ``step``'s gradients, for the step that follows it."""
        self.witnesses, self.witness_step = seen, step

    def note_step_start(self, _opt) -> None:
        """Before the step that follows the armed check: are that check's gradients still there?
        (``zero_grad()`` between ``backward()`` and ``step()`` leaves the step nothing to apply.)"""
        if self.witness_step is not None and self.witnesses and self._discarded():
            self.gone.add(self.witness_step)

    # -------------------------------------------------------- previous step
    def resolve_step(self, report: Report | None, updates: list[StepStats], steps_ran: int, params: list, names: list[str],
                     scale: float | None, scaler: bool, amp_alarm: int, after_step: bool = False,
                     discarded: bool | None = None) -> Delivery | None:
        """What became of the optimizer step after the armed check: its measured updates, or why
        it did not run. ``report`` is the current check's (None at a flush). ``after_step``: the
        check came after the step that consumed its gradients (a one-call step: backward, clip and
        step in one call, timm's ``NativeScaler``): that step's numbers are this report's."""
        if after_step and report is not None and updates:
            self.armed = report
        own = [u.cause for u in updates if u.skipped and u.cause]  # steps the optimizer itself skipped (:mod:`gradhealth.model.masters`)
        if any(u.skipped or not u.indices for u in updates):  # a fused step its grad scaler skipped did not run
            steps_ran = max(0, steps_ran - sum(u.skips for u in updates))
            updates = [u for u in updates if not u.skipped and u.indices]  # (no indices: unarmed steps' skips)
        if steps_ran:
            self.amp_skips = 0
            self.amp_settled = self.amp_settled or scaler
        if updates:
            return self._measured(updates, names)
        if self.armed is None or steps_ran != 0:
            return None
        if own and not scaler:
            prev, self.armed = self.armed, None
            return Delivery(prev, judges.optimizer_skip(own[-1], prev.status, prev.step, amp_alarm))
        if not (self._discarded() if discarded is None else discarded):  # (a deferred check's: when it was launched)
            return None  # gradient accumulation: several backwards, then one step
        prev, self.armed = self.armed, None
        if scaler:
            # The scaler skipped it (inf/NaN in the scaled gradients): said as AMP_SKIPPED in that
            # step's report when its check saw the overflow; count it, and say it now if not.
            self.amp_skips += 1
            if not prev.findings_of(FindingKind.AMP_SKIPPED) and scale is not None and self.last_scale is not None \
                    and scale < self.last_scale:
                return Delivery(prev, judges.amp_skip(scale, self.amp_skips, amp_alarm, prev.step, not self.amp_settled))
            return None
        found = judges.skipped_step(prev.status, prev.in_optimizer, prev.step)
        return Delivery(prev, found) if found else None

    def _discarded(self) -> bool:
        """Were the armed check's gradients thrown away (zeroed or set to None) since?"""
        return discarded(self.witnesses)

    def _measured(self, updates: list[StepStats], names: list[str]) -> Delivery | None:
        """Write the measured update norms into the armed report; NOT_UPDATED / FROZEN_BUT_CHANGED
        from the exact change test (an undecided parameter is neither)."""
        target, self.armed = self.armed, None
        if target is None:
            return None
        unchanged: dict[str, str] = {}
        moved: list[str] = []
        status = target.status
        changed_any, decided, judged = False, set(), set()
        for u in updates:
            if u.measured:  # (decided exactly unchanged: 0, whatever the rule computed)
                upd = u.update
                if 0.0 in u.changed:  # (frozen ones in the optimizer: many, set in C)
                    upd = list(upd)
                    deque(map(upd.__setitem__, compress(range(len(upd)), map(operator.eq, u.changed, repeat(0.0))),
                              repeat(0.0)), maxlen=0)
                keys = list(map(names.__getitem__, u.indices))
                if all(map(operator.eq, upd, upd)) and all(map(operator.gt, u.param, repeat(0.0))):  # (in C: no NaN, b > 0)
                    target.update_norm.update(zip(keys, upd))
                    target.update_ratio.update(zip(keys, map(operator.truediv, upd, u.param)))
                else:
                    for n, d, b in zip(keys, upd, u.param):
                        if d == d:
                            target.update_norm[n] = d
                            target.update_ratio[n] = (d / b if b > 0 else math.inf) if d else 0.0
            if not u.decided:  # a step between change tests
                continue
            decided.update(compress(u.indices, map(operator.eq, u.changed, u.changed)))  # (NaN: undecided)
            judged.update(u.indices)
            # the decisions: only the few unchanged ones, and the frozen ones, are looked at
            still = list(compress(range(len(u.changed)), map(operator.eq, u.changed, repeat(0.0))))
            seen = list(map(names.__getitem__, map(u.indices.__getitem__, still)))
            ok = list(map(operator.is_, map(status.get, seen), repeat(Status.OK)))
            unchanged.update(zip(compress(seen, ok), compress(map(u.lr_zero.__getitem__, still), ok)))
            changed_any = changed_any or 1.0 in u.changed
            if target.frozen_names:
                frozen = set(target.frozen_names)
                if frozen:
                    seen = list(map(names.__getitem__, compress(u.indices, map(operator.eq, u.changed, repeat(1.0)))))
                    moved += filter(frozen.__contains__, seen)
        if any(w == "" for w in unchanged.values()) and not changed_any:
            self.still += 1  # a step that moved nothing it was seen to move
            self._still_seen |= decided
        elif changed_any:
            self.still, self._still_seen = 0, set()
        # (tests in turns decide a window of the parameters each: "changed no parameter" only once the
        # streak decided every one this step judged; a deep model whose first windows vanish is not a
        # stopped update rule. The entries of this step's view: a rebuilt view's new ones get decided)
        still = self.still if self._still_seen >= judged else min(self.still, self.patience - 1)
        gone, self.gone = target.step in self.gone, {s for s in self.gone if s > target.step}
        found = (judges.not_updated(target.status, unchanged, target.step, still, self.patience, gone)
                 if unchanged else [])
        if moved:
            found += judges.frozen_but_changed(target.status, moved, target.step)
        return Delivery(target, found)

    # ------------------------------------------------------------ checkpoint
    #: the carry's keys in a state (the monitor adds its own: :mod:`.state`)
    KEYS = ("calls", "checks", "amp_skips", "amp_settled", "history", "histories", "streaks", "still", "skips",
            "skips_in_a_row", "still_seen", "last_scale", "said", "reentrant", "trace", "fit", "pileup", "owed")

    def state_dict(self, names: list[str] = (), optimizers=()) -> dict:
        """Everything a later check's verdict rests on (``names``: the view's, for the entries
        ``still`` decided; ``optimizers``: the monitor's, by index)."""
        return {
            "calls": self.calls,
            "checks": self.checks,
            "amp_skips": self.amp_skips,
            "amp_settled": self.amp_settled,
            "history": self.history.state_dict() if self.history is not None else None,
            "histories": {i: h.state_dict() for i, h in self.histories.items()},
            "streaks": self.streaks.state_dict(),
            "still": self.still,
            "skips": self.skips,
            "skips_in_a_row": self.skips_in_a_row,
            "still_seen": sorted(names[i] for i in self._still_seen if i < len(names)),
            "last_scale": self.last_scale,
            "said": {"frozen_norms": self.frozen_norms_said, "norm_eval": self.norm_eval_said},
            "reentrant": self.reentrant,
            # a tracer armed after a check with NaN/inf gradients watches the next step: armed again after a load
            "trace": {"from": self.trace_from if self.tracer is not None and self.tracer.armed else None,
                      "ops": self.trace_ops},
            "fit": self.fit.state_dict(),
            "pileup": self.pileup.state_dict(optimizers),
            "owed": [owed_state(f) for f in self.owed],
        }

    def load_state_dict(self, state: dict, modules: set[str] | None = None, units: set[str] | None = None,
                        names: list[str] = (), optimizers=()):
        """All or nothing: every key is checked (:mod:`.state`) and read into new objects first; a
        malformed state raises ValueError naming the key and leaves this carry as it was.
        ``modules`` / ``units``: this model's module and unit names, which the state must not exceed.
        Returns the step a tracer was armed after (to arm one again), or None."""
        try:
            checked.exact(state, self.KEYS, "state")
            counts = {k: checked.count(state[k], f"state[{k!r}]")
                      for k in ("calls", "checks", "amp_skips", "still", "skips", "skips_in_a_row")}
            settled = checked.flag(state["amp_settled"], "state['amp_settled']")
            checked.check_persistence(state["streaks"], "state['streaks']", units)
            streaks = Persistence()
            streaks.load_state_dict(state["streaks"], units)
            history, histories = self.history, self.histories
            if not isinstance(state["histories"], dict):
                raise TypeError("state['histories'] must be a dict")
            if self.history is not None:
                history = copy.deepcopy(self._template)
                if state["history"] is not None:
                    checked.check_history(state["history"], "state['history']", modules, history.window)
                    history.load_state_dict(state["history"])
                histories = {}
                for i, h in state["histories"].items():
                    k = checked.count(int(i) if isinstance(i, str) and i.isdigit() and len(i) < 20 else i,
                                      "state['histories'] key")
                    histories[k] = copy.deepcopy(self._template)
                    checked.check_history(h, f"state['histories'][{i!r}]", modules, histories[k].window)
                    histories[k].load_state_dict(h)
            else:  # (this monitor keeps no history: one in the state is checked all the same, and not kept)
                for path, h in [("state['history']", state["history"])] + [
                        (f"state['histories'][{i!r}]", h) for i, h in state["histories"].items()]:
                    if h is not None or path != "state['history']":
                        checked.check_history(h, path, modules, checked.MAX_COUNT)
            where = {n: i for i, n in enumerate(names)}
            still_seen = {where[n] for n in checked.names(state["still_seen"], "state['still_seen']", set(where))}
            scale = state["last_scale"]
            scale = None if scale is None else checked.norm(scale, "state['last_scale']")
            checked.exact(state["said"], ("frozen_norms", "norm_eval"), "state['said']")
            said = [checked.flag(state["said"][k], f"state['said'][{k!r}]") for k in ("frozen_norms", "norm_eval")]
            reentrant = checked.flag(state["reentrant"], "state['reentrant']")
            checked.exact(state["trace"], ("from", "ops"), "state['trace']")
            trace_from, trace_ops = state["trace"]["from"], checked.flag(state["trace"]["ops"], "state['trace']['ops']")
            if trace_from is not None and (isinstance(trace_from, bool) or not isinstance(trace_from, int)):
                raise TypeError(f"state['trace']['from'] must be a step or None; got {trace_from!r}")
            fit = LossFit()
            fit.load_state_dict(state["fit"])
            pileup = PileUp()
            pileup.load_state_dict(state["pileup"], list(optimizers), set(names))
            if not isinstance(state["owed"], list):
                raise TypeError("state['owed'] must be a list of findings")
            owed = [owed_finding(f, f"state['owed'][{k}]") for k, f in enumerate(state["owed"])]
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, IndexError) as exc:
            detail = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            raise ValueError(f"load_state_dict: not a valid state from GradHealth.state_dict() ({detail}); "
                             "the monitor was left unchanged") from None
        return lambda: self._restore(counts, settled, streaks, history, histories, still_seen, scale, said, reentrant,
                                     trace_ops, fit, pileup, owed, trace_from)

    def _restore(self, counts, settled, streaks, history, histories, still_seen, scale, said, reentrant, trace_ops,
                 fit, pileup, owed, trace_from):
        self.calls, self.checks, self.amp_skips, self.still, self.skips, self.skips_in_a_row = (
            counts[k] for k in ("calls", "checks", "amp_skips", "still", "skips", "skips_in_a_row"))
        self.amp_settled, self.streaks, self.history, self.histories = settled, streaks, history, histories
        self._still_seen, self.last_scale, self.reentrant, self.trace_ops = still_seen, scale, reentrant, trace_ops
        self.frozen_norms_said, self.norm_eval_said = said
        self.fit, self.pileup, self.owed = fit, pileup, owed
        self.armed, self.witnesses, self.witness_step, self.gone = None, [], None, set()
        return trace_from


def owed_state(f: Finding) -> dict:
    """A finding as plain data (its ``data`` keeps only what is plain)."""
    data = {}
    for k, v in f.data.items():
        try:
            data[str(k)] = checked.plain(v, "data")
        except (TypeError, ValueError):
            pass
    return {"kind": str(f.kind), "message": f.message, "params": list(f.params), "level": f.level, "step": f.step,
            "data": data}


def owed_finding(state, path: str) -> Finding:
    checked.exact(state, ("kind", "message", "params", "level", "step", "data"), path)
    if not isinstance(state["message"], str) or not isinstance(state["kind"], str):
        raise TypeError(f"{path}: kind and message must be str")
    step = state["step"]
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"{path}['step'] must be an int or None")
    if not isinstance(state["data"], dict):
        raise TypeError(f"{path}['data'] must be a dict")
    params = state["params"]
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise TypeError(f"{path}['params'] must be a list of names")
    return Finding(state["kind"], state["message"], tuple(params), state["level"], step,
                   checked.plain(state["data"], f"{path}['data']"))
