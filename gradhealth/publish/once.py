"""Say each thing once: which problems of a report are new, still there, or resolved.

The live channel (warnings, the logging sink) says a problem when it starts, again when it changes
(other parameters, another state, level or kind), once when it clears ("resolved at step N"), and
otherwise only as a reminder at growing intervals while it persists: at its 10th, 100th, 1000th ...
check in a row. A problem is a parameter state with the parameters in it (``NOT_IN_OPTIMIZER:
head.weight, head.bias``) or a finding of warning or error level with its kind, level and
parameters. Reports, metrics and ``on_problem="raise"`` are not affected: every report still
carries every step. Checks of different optimizers (``check(optimizer=...)``) are tracked apart.
"""

from __future__ import annotations

import operator
from collections import deque

from dataclasses import dataclass, field

from ..base import saved as checked

__all__ = ["Once", "Said", "SILENT", "problems_of"]


def problems_of(report) -> dict[tuple, str]:
    """Each problem of ``report`` the policy acts on (errors, warnings), with a few words for it."""
    out: dict[tuple, str] = {}
    errors = report.errors
    states = set(errors.values())  # (keyed by the member: ``.value`` is a Python property)
    by_state: dict = {states.pop(): list(errors)} if len(states) == 1 else {}  # state -> names (one: the usual)
    if not by_state:
        for name, state in errors.items():
            by_state.setdefault(state, []).append(name)
    for member, names in by_state.items():
        state = member.value
        out[("state", state, frozenset(names))] = f"{state} ({len(names)} parameter{'s' if len(names) != 1 else ''})"
    for f in report.findings:
        if f.level != "info":  # (a finding about the previous step, delivered now, counts now)
            out[("finding", str(f.kind), f.level, frozenset(f.params))] = f"{f.kind} ({f.level})"
    return out


@dataclass
class Said:
    """What to say for one report: ``new`` (say the report), ``reminder`` (say it as still going),
    ``resolved`` (the words of the problems that cleared)."""

    new: bool = False
    reminder: int = 0  # checks in a row the current problems have lasted, when this is a reminder
    since: int | None = None  # the step they began
    resolved: list[str] = field(default_factory=list)

    @property
    def anything(self) -> bool:
        return self.new or bool(self.reminder) or bool(self.resolved)


_INFO = "info"


_ONLY_INFO, _LEVEL = frozenset((_INFO,)), operator.attrgetter("level")  # (every finding's level "info": tested in C)


SILENT = Said()  # (what most checks get: nothing open, nothing now; shared, never changed)


class Once:
    def __init__(self):
        self._open: dict = {}  # per optimizer index: {problem: (first step, checks in a row, words)}
        self._steps: dict = {}  # per optimizer index: the steps of its last checks (where a gap began)
        self._held: dict = {}  # per optimizer index: problems of a _CONFIRMED kind absent at one check

    def update(self, report) -> Said:
        key = report.optimizer_index
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = deque(maxlen=_KEPT)
        steps.append(report.step)
        before = self._open.get(key)
        if not before:
            findings, not_ok = report.findings, report.not_ok
            if (not findings or _ONLY_INFO.issuperset(map(_LEVEL, findings))) and (not_ok == [] or (  # (no errors: every
                    report.tolerated.issuperset(not_ok) if not_ok is not None else not report.errors)):  # name not OK tolerated)
                return SILENT  # (nothing open, nothing now: tolerated states and info findings are no problem, see problems_of)
            before = {}
        now = problems_of(report)
        held = self._held.setdefault(key, set())
        gone = [p for p in before if p[0] == "finding" and p[1] in _CONFIRMED and p not in now]
        keep = {p for p in gone if p not in held}  # absent once: not resolved yet
        held.intersection_update(gone)
        held |= keep
        said = Said()
        said.resolved = _resolved(before, {**now, **{p: before[p][2] for p in keep}})
        current = {p: before[p] for p in keep}
        for p, words in now.items():
            first, count, _ = before.get(p) or _began(p, report, steps, words)
            current[p] = (first, count + 1, words)
        self._open[key] = current
        if any(p not in before for p in now):
            said.new = True
        elif current:
            counts = [c for _, c, _ in current.values()]
            n = min(counts)
            if n >= 10 and _power_of_ten(n):
                said.reminder, said.since = n, min(f for f, _, _ in current.values())
        return said

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """The problems said and still open, per optimizer index ("all": checks of every parameter),
        and the steps of the last checks."""
        key = lambda k: "all" if k is None else str(k)  # noqa: E731
        return {"open": {key(k): [[*p[:-1], sorted(p[-1]), *v] for p, v in problems.items()]
                         for k, problems in self._open.items()},
                "steps": {key(k): list(v) for k, v in self._steps.items()}}

    def load_state_dict(self, state: dict, optimizers: int) -> None:
        """Every key checked (:mod:`gradhealth.check.state`), then loaded."""
        checked.exact(state, ("open", "steps"), "state['once']")
        for name in state:
            if not isinstance(state[name], dict):
                raise TypeError(f"state['once'][{name!r}] must map 'all' or optimizer indices")
        opened, steps = {}, {}
        for k, problems in state["open"].items():
            path = f"state['once']['open'][{k!r}]"
            if not isinstance(problems, list):
                raise TypeError(f"{path} must be a list of problems")
            mine = opened[checked.key_of(k, f"{path} key", optimizers)] = {}
            for j, p in enumerate(problems):
                # ["state", state, names, first, count, words] or ["finding", kind, level, params, first, count, words]
                size = 6 if isinstance(p, list) and p[:1] == ["state"] else 7
                if not isinstance(p, list) or len(p) != size or p[0] not in ("state", "finding") \
                        or not all(isinstance(x, str) for x in p[1:size - 4]) or not isinstance(p[-1], str):
                    raise TypeError(f"{path}[{j}] must be a problem as state_dict() writes it")
                names = checked.names(p[size - 4], f"{path}[{j}] names")
                first = p[size - 3]
                if isinstance(first, bool) or not isinstance(first, int):
                    raise TypeError(f"{path}[{j}]: its first step must be an int; got {first!r}")
                mine[(*p[:size - 4], frozenset(names))] = (first, checked.count(p[size - 2], f"{path}[{j}] count"), p[-1])
        for k, v in state["steps"].items():
            path = f"state['once']['steps'][{k!r}]"
            if not isinstance(v, list) or len(v) > _KEPT or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise TypeError(f"{path} must be a list of at most {_KEPT} steps")
            steps[checked.key_of(k, f"{path} key", optimizers)] = deque(v, maxlen=_KEPT)
        self._open, self._steps = opened, steps


#: kinds about one batch, not a state that lasts: nothing "resolves" when the next batch differs
_EVENTS = frozenset({"NOTHING_TO_LEARN"})
#: kinds resolved only when absent at two checks in a row: a loop that never zeroes its gradients
#: adds onto consumed ones at every backward but the one after something else cleared them
#: (Lightning sets them to None before each validation run), and that one check is no fix
_CONFIRMED = frozenset({"STALE_GRAD"})
#: the steps of this many recent checks are kept, to say where a gap without gradients began
_KEPT = 128


def _began(problem: tuple, report, steps: list, words: str) -> tuple:
    """(first step, checks before this one, words) of a problem said for the first time: a state of
    parameters that went without a usable gradient for several checks before the policy counted it
    (the persistence rule's tolerated gap) began with that gap, as the report's own words say."""
    if problem[0] == "state" and report.grad_streak:
        gaps = [report.grad_streak.get(n) for n in problem[2]]
        if gaps and None not in gaps:
            gap = min(gaps)
            return (steps[-gap] if gap <= len(steps) else report.step - gap + 1), gap - 1, words
    return report.step, 0, words


def _resolved(before: dict, now: dict) -> list[str]:
    """What cleared: parameters no longer in a state they were in, finding kinds no longer found
    (a problem that grew or moved to other parameters is a change, not a resolution). ``before``
    maps each problem to (first step, checks, words)."""
    def names(items, state) -> set:
        return set().union(*[p[2] for p in items if p[0] == "state" and p[1] == state])

    out = []
    for state in sorted({p[1] for p in before if p[0] == "state"}):
        gone = sorted(names(before, state) - names(now, state))
        if gone:
            since = min(v[0] for p, v in before.items() if p[0] == "state" and p[1] == state)
            shown = ", ".join(gone[:4]) + (f" and {len(gone) - 4} more" if len(gone) > 4 else "")
            out.append(f"{state} of {shown} (since step {since})")
    found_now = {(p[1], p[2]) for p in now if p[0] == "finding"}
    for kind, level in sorted({(p[1], p[2]) for p in before if p[0] == "finding" and p[1] not in _EVENTS} - found_now):
        since = min(v[0] for p, v in before.items() if p[0] == "finding" and (p[1], p[2]) == (kind, level))
        out.append(f"{kind} ({level}, since step {since})")
    return out


def _power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1
