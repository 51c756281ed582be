"""After a report is built: every sink gets it, then the policy warns or raises (``on_problem``)."""

from __future__ import annotations

import re
import sys
import warnings

from ..base.errors import GradHealthError, GradHealthInternalWarning, GradHealthWarning
from ..base.naming import terminal_safe
from ..base.report import LONG, Report, describe_groups, group_by_module
from ..base.status import NO_BACKWARD, Status, hint
from ..judge.patience import ALPHA
from .once import SILENT, Once

__all__ = ["alarm", "explain", "Publisher"]

_EXPERT = re.compile(r"(^|\.)(experts?|moe)[._]?\d*(\.|$)|expert_?\d", re.IGNORECASE)


def _how_long(report: Report, rows) -> str:
    """`` for 3 checks in a row`` when these parameters have gone without a usable gradient, with
    the history the gap was judged against when they had gradients before."""
    names = [n for _, names, _ in rows for n in names if n in report.grad_streak]
    if not names:
        return ""
    gap = min(report.grad_streak[n] for n in names)
    past = [report.grad_history[n] for n in names if n in report.grad_history]
    if past:
        used, missed = past[0]  # the parameters of one module share their history
        seen = used + missed
        return (f" for {gap} checks in a row, after having one at {used} of {seen} earlier checks (a gap this long "
                f"is below {ALPHA:g} likely at that rate: it stopped training),")
    return f" for {gap} checks in a row," if gap > 1 else ""


def _explained(report: Report, rows) -> str | None:
    """The finding that explains every zero gradient of these rows (a frozen zero partner, underflow)."""
    for cause, kind in (("frozen_zero_partner", "FROZEN_PARTNER"), ("underflow", "VANISHING_GRAD")):
        named = {n for f in report.findings if f.data.get("cause") == cause for n in f.params}
        if named and all(n in named for _, names, _ in rows for n in names):
            return kind
    return None


def alarm(report: Report) -> bool:
    """Whether the policy acts on this report: anything ``report.ok`` counts (problems the policy
    does not tolerate, error findings; a grad scaler's expected skip is tolerated where it is found)."""
    return not report.ok


def explain(report: Report) -> str:
    """The warning text: problems grouped by module, each with its usual causes and fix."""
    lines = [f"gradhealth step {report.step}: {report.headline()}"]
    by_state: dict[Status, list] = {}
    errors = report.errors
    for row in group_by_module(report.status, errors):
        by_state.setdefault(row[2], []).append(row)
    for state, rows in by_state.items():
        count = sum(len(names) for _, names, _ in rows)
        words = hint(state, count)
        if state is Status.NO_GRAD and report.backward is False:
            words = NO_BACKWARD
        if state is Status.ZERO_GRAD and (kind := _explained(report, rows)):  # (the cause is known: said below)
            words = f"exactly zero gradients: see {kind} below."
        if state is Status.NON_FINITE_GRAD and report.findings_of("NONFINITE_ORIGIN"):
            words = words.split(" Wrap one step in")[0]  # the origin is said below: no hint to go and trace it
        lines.append(f"  {state.value}: {describe_groups(rows, LONG)}{_how_long(report, rows)} {words}")
        experts = [label for label, _, _ in rows if _EXPERT.search(label)]
        if experts and state in (Status.NO_GRAD, Status.ZERO_GRAD):
            lines.append(f"    expert{'s' if len(experts) > 1 else ''} {', '.join(experts)} received no tokens"
                         f"{_how_long(report, rows).rstrip(',')}: a dead expert (the router "
                         "collapsed onto the others); add or raise the load-balancing auxiliary loss, add router "
                         "noise or capacity, or check the routing code")
    for f in report.findings:
        if f.level != "info":
            lines.append(f"  {f.kind}: {f.message}")
    return terminal_safe("\n".join(lines))  # (names come from the user's model: no raw control characters)


class Publisher:
    """The sinks and the policy. A failing sink warns once and is skipped from then on, unless
    ``on_problem="raise"``: then its error propagates."""

    def __init__(self, sinks: tuple, on_problem: str):
        self.sinks = sinks
        self.on_problem = on_problem
        #: False silences the warnings (not the raises): on ranks other than zero
        self.emit_warnings = True
        self._broken: set[int] = set()
        self._closed: set[int] = set()  # sinks closed
        self.once = Once()  # what the warnings have said already

    def _call(self, i: int, sink, method: str, report: Report | None, stacklevel: int) -> None:
        fn = getattr(sink, method, None)
        if not callable(fn):
            return
        try:
            fn(report) if report is not None else fn()
        except Exception as exc:
            if self.on_problem == "raise" and report is not None:
                raise
            if i not in self._broken:
                self._broken.add(i)
                warnings.warn(f"gradhealth: sink {type(sink).__name__}.{method}() failed ({type(exc).__name__}: {exc}); "
                              "its reports are lost, training continues", GradHealthInternalWarning, stacklevel=stacklevel)

    def publish(self, report: Report, stacklevel: int) -> None:
        report.published = True
        if self.sinks:
            for i, sink in enumerate(self.sinks):
                self._call(i, sink, "write", report, stacklevel + 2)
        said = self.once.update(report)  # (said once: new, reminders at growing intervals, resolved)
        if said is SILENT or self.on_problem == "ignore":  # (SILENT: nothing open, nothing now: no alarm, no warning)
            return
        loud = alarm(report)
        if not loud and not (report.findings and any(f.level == "warning" for f in report.findings)):
            if said.resolved and self.on_problem != "ignore":
                self._warn(f"gradhealth step {report.step}: resolved: {'; '.join(said.resolved)}", stacklevel)
            return
        message = explain(report)
        if self.on_problem == "raise" and loud:
            self.write_stop(report.step, f"GradHealthError: {message}")
            raise GradHealthError(message, report)
        if said.reminder:
            message = message.replace(f"gradhealth step {report.step}: ", f"gradhealth step {report.step}: still, "
                                      f"{said.reminder} checks in a row since step {said.since} (said again at "
                                      f"{10 * said.reminder}): ", 1)
        if said.resolved:
            message += f"\n  resolved: {'; '.join(said.resolved)}"
        if said.anything:
            self._warn(message, stacklevel)

    def _warn(self, message: str, stacklevel: int) -> None:
        if self.emit_warnings:
            # warn_explicit with a throwaway registry: warnings.warn would keep every distinct
            # message (each names its step) in the caller's __warningregistry__ for ever
            frame = sys._getframe(stacklevel + 1)
            where = (message, GradHealthWarning, frame.f_code.co_filename, frame.f_lineno)
            try:
                warnings.warn_explicit(*where, module=frame.f_globals.get("__name__"), registry={},
                                       module_globals=frame.f_globals)
            except Warning:
                raise  # (a filter turned it into an error: the user's choice)
            except Exception:
                # the source lookup failed, before anything was shown: code with no source file
                # whose loader cannot give one (``python -c``, a script on standard input, exec of a
                # string, where __main__'s loader is BuiltinImporter); said without the source line
                warnings.warn_explicit(*where, module=frame.f_globals.get("__name__"), registry={})

    def write_stop(self, step: int | None, message: str) -> None:
        """Tell the sinks (``write_stop(step, message)``, where they have it) the error that is
        about to stop training, so the logs say why the run ended. Never raises itself."""
        for sink in self.sinks:
            fn = getattr(sink, "write_stop", None)
            if callable(fn):
                try:
                    fn(step, message)
                except Exception:  # the error being raised is the one the user must see
                    pass

    def publish_clip(self, report: Report) -> None:
        """A report again, once ``monitor.clip_grad_norm_`` clipped its gradients (``write_clip``)."""
        for i, sink in enumerate(self.sinks):
            self._call(i, sink, "write_clip", report, 5)

    def deliver(self, delivery, current) -> None:
        """Findings about an earlier step (a :class:`~gradhealth.check.carry.Delivery`, or None) go into its
        report and the current one (``current``, or None); the sinks get that report again."""
        if delivery is None:
            return
        delivery.target.findings.extend(delivery.findings)
        if current is not None and current is not delivery.target:
            current.findings.extend(delivery.findings)
        self.publish_update(delivery.target)

    def publish_update(self, report: Report) -> None:
        """A report again, once its step's update norms (and findings) are known."""
        for i, sink in enumerate(self.sinks):
            self._call(i, sink, "write_update", report, 5)

    def close(self) -> None:
        """Flush and close every sink, each once: one that raises (KeyboardInterrupt included) does
        not leave the others open; the first such error is raised after all were tried, and a
        later close() tries again only the sinks that did not close."""
        first = None
        for i, sink in enumerate(self.sinks):
            if i in self._closed:
                continue
            try:
                for method in ("flush", "close"):
                    self._call(i, sink, method, None, 4)
                self._closed.add(i)
            except BaseException as exc:  # (KeyboardInterrupt, SystemExit, a sink's own error under raise)
                first = first or exc
        if first is not None:
            raise first
