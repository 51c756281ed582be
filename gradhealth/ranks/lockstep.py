"""Are the ranks at the same check? The lockstep counts, and a check one rank did not call.

Every check's collective carries each rank's check count and optimizer step count (as a sum and
a sum of squares, so a difference shows in the SUM): ranks at different counts are ``LOCKSTEP``
(error) at that check, naming the ranks and their counts (gathered only then).

A rank whose loop skips ``check()`` at one step (a rank-dependent branch, ``if loss < x:``) would
leave the other ranks waiting in the check's all_reduce while it enters its next collective of its
own: DDP's bucket all-reduce of the next backward, or the optimizer's reduction. Nothing can be
caught then: gloo aborts the process on the sizes that do not match, NCCL hangs or mixes the two.
So a rank notices the skip itself, at the one point it still can: its ``optimizer.step()``. When
a plain loop (``check()`` with no ``step=`` or ``optimizer=``, one optimizer, no closure) has
called ``check()`` at least once between every two steps so far, a step with fewer calls than
that joins the missing check from the step's pre-hook, before the update, on the gradients the
check would have seen. The collective then meets the other ranks' check, its numbers are real, and
the rank's flag in it makes ``LOCKSTEP`` (error) on every rank, naming the rank that skipped. If
every rank joined the same check, that is the loop's own cadence, and every rank lowers its count
to what it called: to 0 (a loop that checks only some steps) said at info, and steps without a
check are no longer checked; to more than 0 silently (the first interval was longer than the
loop's: a grad scaler skipped ``optimizer.step()`` while its scale settled).
"""

from __future__ import annotations

import weakref

from ..base.distributed import ranks_of
from ..base.findings import Finding, FindingKind
from ..base.naming import on_ranks

__all__ = ["MissedChecks", "count_findings", "missed_findings"]


class MissedChecks:
    """One monitor's record of ``check()`` calls between optimizer steps (see the module's text)."""

    def __init__(self, monitor):
        self._monitor = weakref.ref(monitor)  # (a hook must not keep the monitor alive)
        self.joining = False  # this rank's check is being joined from its optimizer step
        self.fewest: int | None = None  # the fewest check() calls between two steps so far
        self.bare = True  # every call so far a plain check(): no step=, no optimizer=
        self._last = monitor.carry.calls
        self.calls_now = 0  # this rank's own check() calls before the step being joined

    @classmethod
    def attach(cls, monitor) -> MissedChecks | None:
        """Only where a skipped call can break a collective and its step can stand in for it."""
        if not (monitor.ranks.active and monitor.tracker is not None and len(monitor.optimizers) == 1):
            return None
        missed = cls(monitor)
        monitor.tracker.on_step = missed.before_step
        return missed

    def called(self, step, optimizer) -> None:
        self.bare = self.bare and step is None and optimizer is None

    def before_step(self, opt, args, kwargs) -> None:
        """The optimizer's pre-step hook (first of the monitor's): join the checks this step lacks."""
        m = self._monitor()
        if m is None or m._closed or self.fewest == 0:
            return
        calls = m.carry.calls
        n, self._last = calls - self._last, calls
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # (args[0]: the optimizer)
        if closure is not None or not self.bare:  # a closure (Lightning, LBFGS): its checks come inside the step
            self.fewest = 0
            return
        if n < 0:  # (a state_dict loaded since: the count restarted)
            return
        if self.fewest is None:  # (the first step: a loop that checks every Nth step has 0 here)
            self.fewest = n
        self.calls_now, joined = n, 0
        # Each joined check either names this rank (the others called check(): join until level with
        # them), or every rank joined it: the cadence was lower than the steps so far showed (a grad
        # scaler that skipped the first step makes its interval two checks long), and
        # missed_findings lowers ``fewest`` to this step's own calls, which ends the loop.
        while n + joined < self.fewest:
            joined += 1
            self.joining = True
            try:
                report = m.measure()
            finally:
                self.joining = False
            if report is not None:
                m.publish(report, stacklevel=4)
        self._last = m.carry.calls


def missed_findings(mask: float, world: int, step: int, missed: MissedChecks | None) -> list[Finding]:
    """``LOCKSTEP`` for the ranks whose check was joined from their optimizer step (``mask``)."""
    ranks = ranks_of(mask, world)
    if len(ranks) == world:  # the loop's cadence, not one rank's branch: every rank learns it
        if missed is not None:
            missed.fewest = missed.calls_now
        if missed is not None and missed.calls_now > 0:  # (fewer calls than a first interval a skipped step lengthened)
            return []
        return [Finding(FindingKind.LOCKSTEP, f"no rank called check() before the optimizer step of step {step} (every "
                        "step before had one): gradhealth checked it from optimizer.step() on every rank; steps without "
                        "a check() are no longer checked", level="info", step=step)]
    who = on_ranks(ranks) if ranks else "some ranks"
    return [Finding(FindingKind.LOCKSTEP, f"{who} did not call check() before optimizer.step() at step {step}, while the "
                    "other ranks did: the check is a collective every rank must join, so gradhealth joined it from that "
                    "rank's optimizer step (a rank that skips it leaves the others in an all_reduce it never meets: NCCL "
                    "hangs, gloo aborts). Call check() at the same point of the loop on every rank, not under `if "
                    "master_process:` or a condition on that rank's own data", step=step,
                    data={"ranks": ranks, "cause": "check_not_called"})]


def count_findings(counts: list[list[float]], step: int) -> list[Finding]:
    """``LOCKSTEP`` from every rank's [checks, optimizer steps] (gathered at a mismatch only)."""
    ref = counts[0]
    odd = [r for r, c in enumerate(counts) if c != ref]
    if not odd:
        return []
    each = "; ".join(f"rank {r}: check {int(c[0])}, {int(c[1])} optimizer steps" for r, c in enumerate(counts))
    return [Finding(
        FindingKind.LOCKSTEP, f"the ranks are not at the same check ({each}): {on_ranks(odd)} and rank 0 "
        "parted where one of them skipped a gradient sync (its check deferred while it stepped on its own "
        "gradients), a check() or an optimizer.step() the other ran; from here on each rank trains on its own. "
        "Make every rank take the same branch (nanoGPT: require_backward_grad_sync must be True at the last "
        "micro-step on every rank)",
        step=step, data={"counts": {r: [int(c[0]), int(c[1])] for r, c in enumerate(counts)}, "ranks": odd})]
