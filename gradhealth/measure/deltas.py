"""Optimizer steps, through the optimizer's own step hooks: did each parameter change (exact, on
every ``change_every``-th step and every step after one that changed nothing), how much (checks 0,
1, 2, 4, ... up to half ``update_every``, then every ``update_every``; ``mode="exact"``: every
step), and stale gradients (:mod:`.stale`).

Each check arms the step that follows it; the step post-hook measures it on the device, and the
numbers travel in the next check's single transfer (or ``monitor.flush()``). Arming happens at the
check, not in a step pre-hook: Lightning's ``optimizer.step(closure)`` calls that before the check.

**Did it change? (exact, no copy of θ).** Every step, each group's learning rate is read on the host
(:mod:`.lrstory`: a hold, a warm-up from 0, a fall, stuck); lr 0 in SGD/Adam/AdamW decides at once
(θ - 0·u is θ), any other optimizer gets the change test at a step at lr 0. The change test proper
runs at the step after every ``change_every``-th check (default 8), at every step after one that
changed none of the parameters it decided (an update rule that stops working is an error within
``change_every + 2`` steps), and at every step while a frozen parameter still holds a gradient.
The steps between are undecided: no finding either way.
For torch.optim's own single-tensor and foreach optimizers a parameter whose version counter did
not move was not touched (fused kernels and ``p.data`` writes move none: all count as touched, see
``versions_tell``). A touched one is compared exactly on a fixed sample of its elements (up to
``SAMPLE``, walking rows and columns), ``WINDOW`` tensors per test in turns: a sampled element that
differs proves a change. One whose sample did not move (a sparse update, updates below the ulp) is
watched: copied exactly across a tested step, in turns, as many as fit the transient budget, and
decided at its turn (one larger than the budget by its sample alone). **How much?** ||Δθ|| per
parameter from the optimizer's own rule for SGD, Adam and AdamW (:mod:`.rules`); for any other
optimizer an exact copy of the parameters that fit the memory budget, in turns.
"""

from __future__ import annotations

import math
import operator
import warnings
from array import array
from itertools import compress, repeat
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from ..base.distributed import dtensor_type, to_local
from ..base.errors import GradHealthInternalWarning
from ..base.hooks import step_hooks
from .compare import Packed, apply, flat, in_turn, norms, sample_view, versions_tell, water_fill
from .host import host_to
from .lrstory import LrStory, all_positive
from .ranon import RanOn
from .rules import _RULES, rule_norms, rule_of
from .stale import WITNESSES, StaleWatch
from .stats import joined, plan_groups
from .steps import StepStats, found_inf, unarmed_skip, with_found_inf
from .tracker_state import TrackerState

__all__ = ["UpdateTracker", "StepStats", "WITNESSES", "SAMPLE", "UPDATE_EVERY", "CHANGE_EVERY"]

#: at most this many elements per tensor are compared exactly across a step to prove it changed
#: (the samples together stay within 1% of the parameters, the rule's temporaries within another 1%)
SAMPLE = 256
#: default: update norms measured at every this many checks (and at checks 1, 2, 4, ..., 32 before)
UPDATE_EVERY = 100
#: default: the change test (version counters, samples, exact copies) runs on the step after every
#: this many checks; a learning rate of 0 is seen at every step
CHANGE_EVERY = 8
#: the change test compares the samples of at most this many tensors per step, in turns: on the
#: CPU every tensor touched costs a kernel launch, as much as a small tensor's whole norm
WINDOW, _VERSION = 64, operator.attrgetter("_version")
_MIN_BUDGET = 1 << 18  # elements: the floor of the transient budget for tiny models (1 MiB of fp32)


@dataclass
class _OptPlan:
    ids: array  # id of every parameter in the optimizer's param_groups, in order
    ptrs: array  # their storage addresses: .half(), .to(), a new tensor change them
    idx: list[int]  # entry indices
    params: list[Tensor]  # local, detached
    windows: list[tuple[list[int], Packed]]  # the sampled elements (auto mode), WINDOW tensors each
    whole: list[bool]  # the sample is the whole tensor
    groups: list[list[int]]  # (device, dtype) groups of params
    group_of: list[int]  # the param group of each
    local: bool = False  # some are local shards of DTensors (their views have version counters of their own)
    empty: Tensor | None = None  # the numbers of a step between change tests: none
    flats: dict | None = None  # (auto mode) k -> the 1-D view of params[k] the samples and exact copies read


#: the in-flight state of a step between change tests (its learning rates are read, nothing else)
_LIGHT = (None, None, None, None, False)


class UpdateTracker(TrackerState):
    """Installs a step post-hook on each optimizer; measures the steps that follow a check."""

    def __init__(self, entries, optimizers, mode: str = "auto", update_every: int = UPDATE_EVERY,
                 budget: float = 0.02, seed: int = 0, change_every: int = CHANGE_EVERY, held=None):
        self.entries = entries
        #: the tensor a step writes for a parameter: its local shard, or its master (:mod:`gradhealth.model.masters`)
        self.held = held or (lambda p: to_local(p.detach()))
        self.mode = mode
        self.update_every = update_every
        self.change_every = change_every
        sizes = [self.held(p).numel() for _, p in entries]
        self.budget = max(_MIN_BUDGET, int(budget / 2 * sum(sizes)))  # elements of rule temporaries
        self.sample = water_fill(sizes, int(budget / 2 * sum(sizes)), SAMPLE)
        self.index = {id(p): i for i, (_, p) in enumerate(entries)}
        self.armed_step: int | None = None
        self.steps_since_check = 0
        self.stepped: dict[int, int] = {}  # per optimizer id: its steps so far
        self.total_steps = 0
        self.pending: list[StepStats] = []
        self._unarmed: StepStats | None = None  # the skips of steps no check armed, in pending
        self.watched: set[int] = set()  # entries whose change test uses the checksum
        self._seed = seed
        self._arms: dict[int, int] = {}  # per optimizer: checks that armed its step
        self._tests: dict[int, int] = {}  # per optimizer: change tests armed (the windows take turns)
        self._turn: dict[int, int] = {}  # per optimizer: where the next generic exact copy starts
        self.lrs = LrStory(optimizers)  # each group's learning rate across steps (:mod:`.lrstory`)
        self._inflight: dict[int, tuple] = {}
        self.ran = RanOn()  # which gradients a step already ran on (one-call steps, steps inside backward)
        self._plans: dict[int, _OptPlan] = {}
        self.witness = StaleWatch(defer=len(optimizers) > 1)
        self._in_step: dict[int, int] = {}  # optimizers inside their step(): checks made there so far
        self._packs: dict[tuple, tuple] = {}  # the exact copies' last plans (:meth:`_copies_in_turn`)
        #: called with the optimizer before each step (the monitor notes whether the armed check's gradients are still there)
        self.before_step = None
        #: called first, with the step hook's arguments (:class:`gradhealth.ranks.lockstep.MissedChecks`)
        self.on_step = None
        #: called last in the step post-hook, with the optimizer (:meth:`gradhealth.ranks.replicas.Replicas.verified`)
        self.after_step = None
        self._handles = step_hooks(self, optimizers)  # (guarded: :mod:`gradhealth.base.hooks`)

    def rebind(self, entries) -> None:
        """The model's parameters changed (added, replaced, loaded with assign=True): follow them.
        A step measured against the old ones is dropped."""
        self.entries = entries
        self.index = {id(p): i for i, (_, p) in enumerate(entries)}
        self._plans.clear(), self._packs.clear(), self.watched.clear(), self.pending.clear()
        self.witness.close()
        self.witness = StaleWatch(defer=self.witness.defer)  # its entry indices were the old ones
        self.disarm()

    def settle(self, stats: StepStats) -> None:
        """After a fetch: parameters proven to change need no exact copy any more."""
        if self.watched:
            self.watched.difference_update(compress(stats.indices, map(operator.eq, stats.changed, repeat(1.0))))

    def extra_elements(self) -> int:
        """Elements held across a step in this mode at most (what the memory bound counts)."""
        sizes = [self.held(p).numel() for _, p in self.entries]
        if self.mode == "exact":
            return sum(sizes)
        return sum(min(n, self.sample) for n in sizes) + self.budget

    # ------------------------------------------------------------------- plans
    def _plan(self, opt) -> _OptPlan | None:
        """The optimizer's monitored parameters, their samples and (device, dtype) groups,
        rebuilt whenever a parameter is replaced, converted (``.half()``) or moved."""
        groups = opt.param_groups
        ps = groups[0]["params"] if len(groups) == 1 else [p for g in groups for p in g["params"]]
        ids = array("Q", map(id, ps))  # raw addresses: compared without touching an int object each
        try:
            ptrs = array("Q", map(Tensor.data_ptr, ps))
        except ValueError:  # an uninitialised (lazy) parameter has no data yet: address 0 until materialised
            ptrs = array("Q", (0 if is_lazy(p) else p.data_ptr() for p in ps))
        plan = self._plans.get(id(opt))
        if plan is not None and plan.ids == ids and plan.ptrs == ptrs:
            return plan
        index, group_of = self.index, []
        for gi, g in enumerate(opt.param_groups):
            group_of += [gi for p in g["params"] if id(p) in index]
        idx = [index[i] for i in ids if i in index]
        if not idx:
            return None
        # local shards of DTensor parameters (FSDP2): a DTensor op here would hide a collective
        params = [self.held(self.entries[i][1]) for i in idx]
        windows, whole = [], [False] * len(params)
        flats = None
        if self.mode == "auto":  # (the 1-D views made once: the samples and the exact copies read them)
            flats = dict(enumerate(map(flat, params)))
            views = [sample_view(p, self.sample, self._seed + i, flats[k])
                     for k, (p, i) in enumerate(zip(params, idx))]
            whole = [v is not None and v.numel() == p.numel() for v, p in zip(views, params)]
            # non-contiguous parameters get an empty sample: decided by the exact copies
            views = [v if v is not None else p.new_empty(0) for v, p in zip(views, params)]
            for start in range(0, len(views), WINDOW):
                ks = list(range(start, min(start + WINDOW, len(views))))
                windows.append((ks, Packed([views[k] for k in ks], reuse=True)))
        dtensor = dtensor_type()
        local = dtensor is not None and any(isinstance(self.entries[i][1], dtensor) for i in idx)
        plan = _OptPlan(ids, ptrs, idx, params, windows, whole, [g for _, _, g in plan_groups(params)], group_of, local,
                        flats=flats)
        self._plans[id(opt)] = plan
        return plan

    # ------------------------------------------------------------------ arming
    def arm(self, step: int, optimizers, due: bool = False) -> None:
        """Prepare the change test (every ``change_every`` checks, or now if ``due``) and the update
        norms (the optimizer's checks 0, 1, 2, 4, ... to half ``update_every``, then every
        ``update_every``) of the step after check ``step``; the others are counted, their lrs read."""
        self.armed_step = step
        self.steps_since_check = 0
        inflight, arms, every = self._inflight, self._arms, self.update_every
        inflight.clear()
        if self.mode == "off":
            return
        exact = self.mode == "exact"
        for opt in optimizers:  # counted per optimizer: two that take turns (a GAN) both get turns
            key = id(opt)
            k = arms.get(key, 0)
            arms[key] = k + 1
            # lr 0 under a rule not known here (rule_of None): the change test decides this step (lr 0: judged at every step)
            zero = type(opt) not in _RULES and not all_positive(opt) and not self.lrs.quiet(opt)
            if not (due or exact or zero) and k % every and k % self.change_every and (2 * k > every or k & (k - 1)):
                inflight[key] = _LIGHT  # a light step (neither of the two below): the plan is not even re-validated
                continue
            measure = exact or k % every == 0 or 2 * k <= every and not k & (k - 1)  # (update norms; else a change test)
            tests = self._tests[id(opt)] = self._tests.get(id(opt), -1) + 1
            plan = self._plan(opt)
            if plan is None:
                continue
            versions = list(map(_VERSION, plan.params))
            if exact:
                snap = apply(torch._foreach_mul, plan.groups, plan.params, 1)
            else:  # this test's window of samples
                ks, packed = plan.windows[tests % len(plan.windows)]
                snap = (ks, packed, packed.snapshot())
            # exact copies, within the budget and in turns: the watched parameters (undecided by
            # their sample before), and for an optimizer without a known rule, the ones measured
            generic = (measure or zero) and not exact and rule_of(opt) is None
            if generic:  # (at lr 0: copied in turns, so the step is decided now, not by a later sample)
                wanted = list(range(len(plan.idx)))
            elif self.watched:  # (picked in C: a vanishing model's watched parameters are most of them)
                wanted = list(compress(range(len(plan.idx)), map(operator.and_, map(self.watched.__contains__, plan.idx),
                                                                  map(operator.not_, plan.whole))))
            else:
                wanted = []
            copies = self._copies_in_turn(opt, plan, wanted) if wanted and not exact else None
            self._inflight[id(opt)] = (plan, versions, snap, copies, measure)

    def _copies_in_turn(self, opt, plan, wanted: list[int]):
        """Exact copies of the next ``wanted`` parameters in turn that fit the budget together
        (one that alone is larger than the budget is never copied)."""
        start = self._turn.get(id(opt), 0) % len(wanted)
        chosen = in_turn(wanted, plan.params, start, self.budget)
        self._turn[id(opt)] = start + max(1, len(chosen))
        if not chosen:
            return None
        key = (id(plan), tuple(chosen))  # (the same ones test after test while they stay undecided: planned once)
        was, packed = self._packs.pop(key, (None, None))
        if was is not plan:
            packed = Packed(list(map(plan.flats.__getitem__, chosen)))
        self._packs[key] = (plan, packed)
        while len(self._packs) > 4:
            self._packs.pop(next(iter(self._packs)))
        return chosen, packed, packed.snapshot()

    def disarm(self, counted=()) -> None:  # counted: a check that failed on this rank alone still counts
        self.armed_step = None  # for these optimizers' cadence (every rank measures the same steps, and flushes them)
        self._inflight.clear()
        for opt in counted:
            self._arms[id(opt)] = self._arms.get(id(opt), 0) + 1

    def reevaluation(self) -> bool:
        """Is this check a closure's second (or later) evaluation inside one ``optimizer.step()``
        (LBFGS calls its closure several times per step)? Counts the check. The first check inside a
        step (Lightning's closure, or an LBFGS closure's first call) is an ordinary check."""
        again = False
        for k, n in self._in_step.items():
            again = again or n > 0
            self._in_step[k] = n + 1
        return again

    # ----------------------------------------------------------- measurement
    def _pre(self, opt, args, kwargs) -> None:
        if torch._C._current_graph_task_id() != -1:  # a step inside backward (optimizer in backward)
            self.ran.capture(opt)
        if self.on_step is not None:  # (before anything here: it may run the check this step lacks)
            self.on_step(opt, args, kwargs)
        self._in_step[id(opt)] = 0
        self.witness.confirm(opt)
        if self.before_step is not None and self.armed_step is not None and self.steps_since_check == 0:
            try:
                self.before_step(opt)
            except Exception:  # inside the user's optimizer.step(): never break it
                pass

    def _post(self, opt, args, kwargs) -> None:
        key = id(opt)
        self._in_step.pop(key, None)
        self.steps_since_check += 1
        self.stepped[key] = self.stepped.get(key, 0) + 1
        self.total_steps += 1
        state = self._inflight.pop(key, None)
        if state is not None:
            try:
                self._zeros = ()
                stats = self._light(opt) if state is _LIGHT else self._measure(opt, *state)
                if stats is not None:
                    stats.on_skip = (lambda z=self._zeros: self.lrs.unskip(z)) if self._zeros else None
                    self.pending.append(with_found_inf(opt, stats))
            except Exception as exc:  # inside the user's optimizer.step(): never break it
                warnings.warn(f"gradhealth: measuring the update of {type(opt).__name__}.step() failed "
                              f"({type(exc).__name__}: {exc}); this step's update is not reported",
                              GradHealthInternalWarning, stacklevel=3)
        else:  # a step no check armed (every_n_steps): count its skip
            self._unarmed = unarmed_skip(opt, self.pending, self._unarmed)
        try:
            seen = None
            if self.armed_step is not None:  # (the stale witnesses, and what the one-call-step test keeps)
                plan = self._plans.get(key) or self._plan(opt)
                seen = self.witness.arm(opt, plan.idx if plan else [], self.entries)
            self.ran.stepped(opt, seen or None)
        finally:  # (a guess about this optimizer's reduction, verified now: a collective every rank joins)
            if self.after_step is not None:
                try:
                    self.after_step(opt)
                except Exception:  # inside the user's optimizer.step(): never break it
                    pass

    def _light(self, opt) -> StepStats | None:
        """A step between change tests: what the learning rates decide (lr 0 in SGD/Adam/AdamW changes
        nothing, exactly), or None (the usual one: nothing decided or skipped, nothing to read)."""
        if not self.lrs.zero and getattr(opt, "found_inf", None) is None:  # (the usual step: every lr a
            for g in opt.param_groups:  # positive float, no lr 0 before, no grad scaler's flag)
                lr = g["lr"]
                if lr.__class__ is not float or not lr > 0:
                    break
            else:
                if id(opt) not in self.lrs.rose:
                    self.lrs.mark_rose(opt)
                return None
        plan = self._plans.get(id(opt)) or self._plan(opt)
        if plan is None:
            return None
        lr_zero = self._lr_zero(opt, plan)
        if not any(lr_zero) and found_inf(opt) is None:
            return None
        touched = [not z for z in lr_zero] if rule_of(opt) is not None and any(lr_zero) else None
        device = self.entries[plan.idx[0]][1].device  # (the plan's aliases may predate a .to())
        if plan.empty is None or plan.empty.device != device:
            plan.empty = torch.empty(0, dtype=torch.float64, device=device)
        return StepStats(plan.idx, plan.empty, touched, [], [], False, lr_zero)

    def _measure(self, opt, plan, versions, snap, copies, measure) -> StepStats:
        params, n = plan.params, len(plan.params)
        touched: list[bool] | None = None  # None: every parameter touched (the common case)
        if versions_tell(opt) and not plan.local:
            moved_on = list(map(operator.ne, map(_VERSION, params), versions))
            touched = None if all(moved_on) else moved_on
        # else: fused kernels, writes through .data and DTensor shards move no counter; compare all
        lr_zero = self._lr_zero(opt, plan)
        if rule_of(opt) is not None and any(lr_zero):  # lr 0 in SGD/Adam/AdamW: θ - 0·u is θ, exactly
            touched = [t and not z for t, z in zip(touched or [True] * n, lr_zero)]
        device = params[0].device
        parts: list[Tensor] = []
        diff = None
        copied, exact_norms = [], None
        if self.mode == "exact":
            pos = [k for k in range(n) if touched is None or touched[k]]
            diff = apply(torch._foreach_sub, plan.groups, params, snap)
            moved = norms(diff, plan.groups, math.inf) > 0  # max |Δ|: no square can underflow to 0
            sure = [True] * len(pos)
        else:
            ks, window, before_w = snap
            counts = window.changed(before_w)
            if copies is None and touched is None:  # the window decides its parameters, no others
                pos, moved = ks, None
                parts += counts
            else:
                moved = torch.zeros(n, dtype=torch.bool, device=device)
                moved[ks[0] : ks[-1] + 1] = joined(counts) > 0
                tested = set(ks)
                if copies is not None:  # the exact copies decide their parameters
                    copied, packed, before = copies
                    where = host_to(copied, device)
                    # (no boolean-mask indexing: its size would need a host sync)
                    now = (joined(packed.changed(before)) > 0).to(device)
                    moved = moved.index_copy(0, where, moved.index_select(0, where) | now)
                    tested |= set(copied)
                    if measure:
                        exact_norms = packed.diff_norms(before)
                # touched parameters outside this step's window and copies stay undecided (nan)
                pos = sorted(k for k in tested if touched is None or touched[k])
            done = set(copied)
            sure = [plan.whole[k] or k in done for k in pos]
        if pos and moved is not None:  # the device decides the touched ones; the untouched are unchanged
            parts.append((moved if len(pos) == n else moved.index_select(0, host_to(pos, device))).to(torch.float64))
        if measure:  # ||θ||: before the step where a copy exists, after it otherwise
            theta = snap if self.mode == "exact" else params
            parts += [self._update_norms(opt, plan, diff, copied, exact_norms).to(device), norms(theta, plan.groups)]
        packed_out = parts if parts else torch.zeros(0, dtype=torch.float64, device=device)  # (read with the check)
        self.watched |= {plan.idx[k] for k, s in zip(pos, sure) if not s}  # decided from a later step on
        return StepStats(plan.idx, packed_out, touched, pos, sure, measure, lr_zero)

    def _update_norms(self, opt, plan, diff, copied, exact_norms) -> Tensor:
        params = plan.params
        if self.mode == "exact":
            return norms(diff, plan.groups)
        rule = rule_of(opt)
        if rule is not None:
            return rule_norms(opt, rule, [self.entries[i][1] for i in plan.idx], self.budget)
        out = torch.full((len(params),), math.nan, dtype=torch.float64, device=params[0].device)
        if exact_norms is not None:
            out.index_copy_(0, host_to(copied, out.device), exact_norms.to(out))
        return out

    def _lr_zero(self, opt, plan) -> list[str]:
        """Per parameter: its group's learning-rate word at this step (:class:`.lrstory.LrStory`:
        "" for lr > 0; "new", "again", "stuck", "held", "quiet" for lr 0)."""
        words = self.lrs.words(opt)
        if not any(words):
            return [""] * len(plan.group_of)
        self._zeros = [(id(opt), g) for g, w in enumerate(words) if w]  # (undone if the step skipped itself)
        return [words[g] for g in plan.group_of]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.witness.close()
        self._inflight.clear()
        self._plans.clear(), self._packs.clear()
