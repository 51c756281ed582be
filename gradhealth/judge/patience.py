"""Transient or persistent: each unit's gaps without a usable gradient, judged against its own past.

A NO_GRAD or ZERO_GRAD status is exact at every check, but not every one is a bug: LoRA's
``lora_A`` gets an exactly zero gradient at the first step because ``lora_B`` starts at zero;
LayerDrop and stochastic depth skip layers on purpose; an expert of a mixture-of-experts layer gets
no token in some batches. A *unit* (a parameter, or one expert of a stacked tensor) keeps three
numbers: the checks with a usable gradient (``used``), those without one before its current gap
(``missed``), and the current gap (``gap``). The rule (``Persistence.judge``):

* **never used** (no usable gradient since its first check): an error once the gap reaches
  ``grad_patience``, whatever other units do: it has no transient past, and a block that LayerDrop
  skips says nothing about a head the forward never uses. Only its siblings are a reference: an
  expert's (``experts.3``, ``experts[3]``: a router picks among them), and, while they skip, the
  other blocks of its numbered stack (``blocks.5.1.weight`` beside ``blocks.<i>.1.weight``, the
  units stochastic depth skips); then the gap must also be improbable at their pooled rate;
* **intermittent** (it had gradients, and now misses some): an error once the gap is at least
  ``grad_patience`` and its probability under the unit's own past rate is below ``ALPHA``. With
  ``m`` misses in ``m + u`` earlier checks (a Beta(1, 1) prior on its skip rate ``q``), the
  probability that the next ``g`` checks all miss is the posterior predictive
  ``E[q^g] = B(m + 1 + g, u + 1) / B(m + 1, u + 1)``: for a well-known rate about ``q^g``, larger
  (more patient) while the rate is uncertain. A unit skipped independently with probability ``q``
  therefore raises a false alarm with probability about ``ALPHA`` per gap, and one that stops for
  good is an error after about ``log(ALPHA) / log(q)`` checks (``gap_limit`` computes it);
* **nothing trained**: at a check where no judged trainable unit had a usable gradient (a cut
  graph, a detached loss), skipping cannot be the reason: every unit is an error at
  ``grad_patience`` checks in a row of that.

Counts are halved once a unit's ``used + missed`` passes ``CAP``, so the rate follows a
schedule that changes (and the state stays bounded: a few ints per unit that ever missed). Units
that never missed have no record and cost nothing. :mod:`.partners` recognises the
zero-initialised-partner start (a sibling weight that is exactly zero), read only at a check where
a parameter's zero gradient is new; :mod:`.copies` sets aside the parameters in no optimizer.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import compress, filterfalse, repeat

from ..base import saved as checked
from ..base.naming import module_of
from ..base.status import Status
from .copies import Copies
from .partners import frozen_partner, zero_partners
from .underflow import Faint, underflow

__all__ = ["Persistence", "Verdict", "persist", "predictive", "gap_limit", "family_of", "siblings_of", "zero_partners", "frozen_partner", "ALPHA", "CAP"]

#: the probability below which a unit's current gap is no longer taken for chance
ALPHA = 1e-8
#: counts are halved past this many checks per unit (a bounded memory that follows a schedule)
CAP = 4096

_NO_USABLE = (Status.NO_GRAD, Status.ZERO_GRAD)
_USABLE = (Status.OK, Status.NON_FINITE_GRAD, Status.NOT_IN_OPTIMIZER)
_LOG_ALPHA = math.log(ALPHA)
_NEVER = operator.itemgetter(5)  # (a unit's record: never had a usable gradient)


def predictive(missed: float, used: float, gap: int) -> float:
    """log P(the next ``gap`` checks all miss) for a unit that missed ``missed`` of
    ``missed + used`` earlier checks (Beta(1, 1) prior on its skip rate)."""
    a, b = max(missed, 0.0) + 1.0, max(used, 0.0) + 1.0
    return math.lgamma(a + gap) - math.lgamma(a) + math.lgamma(a + b) - math.lgamma(a + b + gap)


def gap_limit(missed: float, used: float, patience: int = 3) -> int:
    """The gap at which a unit with this history becomes an error (the field guide's delays)."""
    g = max(1, patience)
    while predictive(missed, used, g) >= _LOG_ALPHA:
        g += 1
    return g


@dataclass
class Verdict:
    """The persistence rule's answer for the units without a usable gradient at one check."""

    gaps: dict  # name -> current gap (this check included)
    errors: set  # names the rule counts as persistent
    history: dict  # name -> (used, missed) before the current gap, for intermittent units
    blank: int = 0  # checks in a row where nothing trainable had a usable gradient


class Persistence:
    def __init__(self) -> None:
        # name -> [used, missed, gap, mark, key, never]; ``used`` is exact at ``mark`` (the
        # judging count then) and grows by one per judging check while the gap is 0
        self.rec: dict[str, list] = {}
        self.n: dict = {}  # checks made, per selection key (None: every parameter; i: optimizer i)
        self.open: set[str] = set()  # records whose gap is open
        #: modules with a unit that went without a gradient at some check (their norms come and go)
        self.skipping: set[str] = set()
        self.blank = 0
        #: ZERO_GRAD units whose trainable partner weight was exactly zero at the last check
        self.partnered: set[str] = set()
        #: FROZEN parameters at the last check, and the judging count at which each unit last left
        #: that state: checks it spent frozen are not checks at which it had a gradient
        self.frozen: set[str] = set()
        self.thawed: dict[str, int] = {}
        #: ZERO_GRAD units whose zero partner weight is frozen (nothing can move it off zero)
        self.stuck_partner: set[str] = set()
        #: units whose gradient, back after a gap or before it, was faint: their zeros are underflow
        #: (a gradient vanishing through depth), not skipping: no proxy for a never-used unit
        self.faint: set[str] = set()
        self._dropped: set[str] = set()  # units with a NO_GRAD check in their open gap
        self.faint_reader = Faint()  # (this check's gradient norms and the last one's)
        #: NO_GRAD parameters in no optimizer (target / EMA copies): set aside, not judged here
        self.copies = Copies()

    # ------------------------------------------------------------------ update
    def _judged(self, key) -> int:
        return self.n.get(None, 0) + (self.n.get(key, 0) if key is not None else 0)

    def _used(self, r: list) -> int:
        return r[0] + (self._judged(r[4]) - r[3] if r[2] == 0 else 0)

    def update(self, status: dict, not_ok: list, key=None, faint: Faint | None = None, frozen=None, aside: int = 0) -> dict:
        """Count this check; return the gap of every NO_GRAD / ZERO_GRAD unit now. Units not
        judged at this check (another optimizer's) keep their numbers. ``faint``: this check's
        gradient norms, for the units whose gap opens or closes now (:class:`.underflow.Faint`).
        ``aside``: how many of ``status`` are left out of ``not_ok`` (copies, :mod:`.copies`)."""
        missing = list(compress(not_ok, map(_NO_USABLE.__contains__, map(status.__getitem__, not_ok))))
        rec = self.rec
        now = self._judged(key)
        if self.frozen or not_ok or frozen:  # (``frozen``: the FROZEN names, where not among ``not_ok``)
            frozen = set(frozen) if frozen is not None else {n for n in not_ok if status[n] is Status.FROZEN}
            if frozen != self.frozen:
                for n in self.frozen - frozen:
                    self.thawed[n] = now
                self.frozen = frozen
        gaps = {}
        for n in missing:
            r = rec.get(n)
            if r is None:  # its first miss: every earlier check that judged it, not frozen, had a gradient
                used = max(0, now - self.thawed.get(n, 0))  # (thawed at another optimizer's count: never below 0)
                r = rec[n] = [used, 0, 0, now, key, used == 0]
                self.skipping.add(_module(n))
                if faint is not None and status[n] is Status.ZERO_GRAD and faint.before(n):
                    self.faint.add(n)  # (its gradient before this first gap, exactly zero now, was faint)
            if status[n] is Status.NO_GRAD:  # (None: skipped, whatever its size when it is there)
                self.faint.discard(n)
                self._dropped.add(n)
            if r[2] == 0:
                r[0] = self._used(r)
                self.open.add(n)
            r[2] += 1
            gaps[n] = r[2]
        if self.open:
            miss = set(missing)
            for n in [n for n in self.open if n not in miss and n in status and status[n] in _USABLE]:
                r = rec[n]
                r[1] += r[2]
                r[0] += 1
                r[2], r[5] = 0, False
                r[3] = now + 1
                self.open.discard(n)
                if faint is not None and n not in self._dropped and faint.now(n):
                    self.faint.add(n)
                else:
                    self.faint.discard(n)
                self._dropped.discard(n)
                if r[0] + r[1] > CAP:
                    r[0], r[1] = r[0] // 2, r[1] // 2
        self.n[key] = self.n.get(key, 0) + 1
        if faint is not None:
            faint.keep()
        trainable = len(status) - operator.countOf(status.values(), Status.FROZEN) - aside if missing else 0
        self.blank = self.blank + 1 if missing and len(missing) == trainable else 0
        return gaps

    def forgive(self, names) -> None:
        """Take back the misses of units whose zero gradient a zero partner explains (LoRA's start):
        they are not skipping, so they make no other unit's gap look like chance."""
        for n in names:
            r = self.rec.get(n)
            if r is None:
                continue
            if r[1] == 0:  # every miss it had is this explained gap: no record, as if it never missed
                del self.rec[n]
                self.open.discard(n)
                if not any(_module(m) == _module(n) for m in self.rec):
                    self.skipping.discard(_module(n))

    # ------------------------------------------------------------------- judge
    def judge(self, gaps: dict, patience: int, status: dict | None = None) -> Verdict:
        """Which of the gaps the rule counts as persistent now (see the module docstring).
        ``status`` (every judged name) finds the siblings of a never-used unit."""
        errors, history, alone = set(), {}, []
        if self.blank >= patience:
            return Verdict(gaps, {n for n, g in gaps.items() if g >= patience}, history, self.blank)
        for n, g in gaps.items():
            r = self.rec[n]
            if not r[5]:
                history[n] = (r[0], r[1])
            if g < patience:
                continue
            if r[5]:  # never used: no transient past of its own (judged by its siblings, if it has any)
                alone.append(n)
            elif predictive(r[1], r[0], g) < _LOG_ALPHA:
                errors.add(n)
        if alone:
            # (a stack's siblings count only where some unit skips: none does in most models, and
            # then a never-used unit that is not an expert is an error without a look at the others)
            skips = not all(map(_NEVER, self.rec.values()))
            keys = {}
            for n in alone:
                expert = family_of(n)
                key = expert or (siblings_of(n) if skips else None)
                if key is None:
                    errors.add(n)
                else:
                    keys[n] = (key, expert is not None)
            pooled = self._families({k for k, _ in keys.values()}, status or {}) if keys else {}
            for n, (key, expert) in keys.items():
                missed, used = pooled.get(key, (0, 0))
                # (blocks that never skip are no sign of a stochastic model: the unit is an error now)
                if not used or not (missed or expert) or predictive(missed, used, gaps[n]) < _LOG_ALPHA:
                    errors.add(n)
        return Verdict(gaps, errors, history, self.blank)

    def _families(self, keys: set, status: dict) -> dict:
        """Each family's pooled (misses, uses) over its members that are not frozen (one pass over
        the judged names, only at a check where a never-used unit has reached its patience). A
        family is an expert's siblings (a router picks among them) or the same parameter of the
        other blocks of a numbered stack (``blocks.3.1.weight``: ``blocks.<i>.1.weight``, the units
        LayerDrop / stochastic depth skip): a unit never used while its siblings skip at random is
        judged by how often they go without, not taken for an unused layer at once (blocks that
        never skip say nothing of the kind: an error at ``grad_patience``); a head beside them has
        no siblings and is an error at ``grad_patience``, whatever the blocks do."""
        out: dict = {}
        if not keys:
            return out
        judged, rec, faint = self._judged(None), self.rec, self.faint
        for other, state in status.items():
            key = family_of(other) or siblings_of(other)
            if key not in keys or state is Status.FROZEN or other in faint:  # (faint: underflow, not skipping)
                continue
            missed, used = out.get(key, (0, 0))
            r = rec.get(other)
            if r is None:
                used += judged
            elif not r[5]:
                used, missed = used + self._used(r), missed + r[1] + r[2]
            out[key] = (missed, used)
        return out

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        return {"n": {("all" if k is None else str(k)): v for k, v in self.n.items()},
                "units": {n: list(r) for n, r in self.rec.items()}, "blank": self.blank,
                "faint": sorted(self.faint), "frozen": sorted(self.frozen), "thawed": dict(self.thawed),
                "skipping": sorted(self.skipping), "partnered": sorted(self.partnered),
                "stuck": sorted(self.stuck_partner), "dropped": sorted(self._dropped),
                "reader": self.faint_reader.state_dict()}

    def load_state_dict(self, state: dict, units: set[str] | None = None) -> None:
        """Every key checked (:mod:`gradhealth.check.state`: exactly the keys :meth:`state_dict` writes), then loaded."""
        checked.exact(state, ("n", "units", "blank", "faint", "frozen", "thawed", "skipping", "partnered", "stuck",
                              "dropped", "reader"), "state['streaks']")
        for key in ("n", "units", "thawed"):  # (None is no mapping: refused, not read as an empty one)
            if not isinstance(state[key], dict):
                raise TypeError(f"state['streaks'][{key!r}] must be a dict; got {type(state[key]).__name__}")
        n = {}
        for k, v in state["n"].items():
            n[None if k == "all" else _count(int(k) if isinstance(k, str) and k.isdigit() and len(k) < 20 else k)] = _count(v)
        rec = {}
        for name, r in state["units"].items():
            if not isinstance(r, (list, tuple)) or len(r) != 6:
                raise ValueError(f"streaks unit {name!r} must be [used, missed, gap, mark, key, never]")
            key = None if r[4] is None else _count(r[4])
            if not isinstance(r[5], bool):
                raise TypeError(f"streaks unit {name!r}: 'never' must be a bool")
            rec[str(name)] = [_count(r[0]), _count(r[1]), _count(r[2]), _count(r[3]), key, r[5]]
        checked.names(list(rec), "state['streaks']['units']", units)
        sets = {key: set(checked.names(state[key], f"state['streaks'][{key!r}]", units if key != "skipping" else None))
                for key in ("faint", "frozen", "partnered", "stuck", "dropped", "skipping")}
        checked.names(list(state["thawed"]), "state['streaks']['thawed']", units)
        thawed = {k: _count(v) for k, v in state["thawed"].items()}
        reader = Faint()
        reader.load_state_dict(state["reader"], units)
        self.thawed, self.faint, self.frozen = thawed, sets["faint"], sets["frozen"]
        self.partnered, self.stuck_partner, self._dropped, self.skipping = (sets["partnered"], sets["stuck"],
                                                                            sets["dropped"], sets["skipping"])
        self.n, self.rec, self.blank, self.faint_reader = n, rec, _count(state["blank"]), reader
        self.open = {k for k, r in rec.items() if r[2] > 0}


_EXPERT = re.compile(r"^(.*?(?:^|\.)experts?)(?:\.(\d+)(\..*)?|\[(\d+)\])$", re.IGNORECASE)


@lru_cache(maxsize=65536)  # (a model's names, judged check after check)
def family_of(name: str) -> tuple[str, str] | None:
    """``("layers.0.mlp.experts", ".weight")`` for ``layers.0.mlp.experts.3.weight`` (and
    ``("layers.0.mlp.experts", "")`` for the stacked expert ``layers.0.mlp.experts[3]``); None for
    a name that is not an expert's."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    return m.group(1), m.group(3) or ""


@lru_cache(maxsize=65536)
def siblings_of(name: str) -> tuple[str, str] | None:
    """``("blocks", ".1.weight")`` for ``blocks.3.1.weight`` (the outermost numbered container:
    the stack LayerDrop and stochastic depth skip blocks of); None for a name outside one."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), "".join("." + p for p in parts[i + 1:])
    return None


def _module(unit: str) -> str:
    """The module of a parameter, or the experts module of a stacked expert ``m.experts[3]``."""
    return unit[:unit.rindex("[")] if unit.endswith("]") else module_of(unit)


def _count(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 2**62:
        raise ValueError(f"a count must be an int in [0, 2**62]; got {v!r}")
    return v


def persist(report, persistence: Persistence, patience: int, names: list[str], params: list, sync: bool = True) -> list:
    """The stage of a check: update ``persistence`` from ``report`` (its parameters, and its
    stacked experts as units of their own) and set its ``grad_streak``, ``grad_history`` and
    ``tolerated``; returns the TRANSIENT_GRAD / DEAD_EXPERT / TARGET_COPY findings. ``sync``: a
    device read is allowed now (not in the deferred mode)."""
    status, not_ok, units, frozen = report.status, report.not_ok or [], report.expert_status, report.frozen_names
    if units:
        status = {**status, **units}
        not_ok = list(not_ok) + [u for u, s in units.items() if s is not Status.OK]
        frozen = None if frozen is None else frozen + [u for u, s in units.items() if s is Status.FROZEN]
    # in no optimizer and without a gradient (a target network, an EMA copy): nothing should move
    # them by gradient; set aside from the rule, tolerated, said at info with what was seen
    copies = persistence.copies.pick(report)
    if copies:
        not_ok = list(filterfalse(copies.__contains__, not_ok))
    faint = persistence.faint_reader.read(report.grad_norm, names, params)
    gaps = persistence.update(status, not_ok, report.optimizer_index, faint, frozen, len(copies))
    report.grad_streak = gaps
    aside = persistence.copies.see(copies, report.status, names, params, report.step, sync)
    if not gaps:
        if aside is not None:
            report.tolerated = report.tolerated | copies
        return [aside] if aside is not None else []
    from .judges import idle_experts, transient_grads  # (judges import the report module, which this one need not)

    verdict = persistence.judge(gaps, patience, status)
    report.grad_history = verdict.history
    # a zero gradient explained by a trainable partner that is still exactly zero (LoRA's B before
    # its first real step: a warmup from lr 0 and accumulation make that several checks) is no
    # persistent fault; the partner is read at the first zero and again while it stays zero
    # (the candidates picked in C: a first zero, or a partnered one; then their states looked at)
    new = set(compress(gaps, map(operator.eq, gaps.values(), repeat(1))))
    zeros = [n for n in gaps if (n in new or n in persistence.partnered) and n not in units
             and status[n] is Status.ZERO_GRAD] if new or persistence.partnered else []
    partners = persistence.partnered = zero_partners(zeros, names, params) if zeros else set()
    persistence.forgive(partners)
    # a zero gradient beside a frozen partner that is exactly zero (LoRA's B frozen at its zero
    # init while A trains): nothing can move the partner, so the gradient stays zero: an error now
    lone = [n for n in gaps if (n in new or n in persistence.stuck_partner) and n not in units and n not in partners
            and status[n] is Status.ZERO_GRAD] if new or persistence.stuck_partner else []
    stuck = persistence.stuck_partner = zero_partners(lone, names, params, frozen=True) if lone else set()
    mine = Verdict({n: g for n, g in gaps.items() if n not in units} if units else gaps,
                   (verdict.errors - set(units) - partners) | stuck, verdict.history)
    report.tolerated, found = transient_grads(report.status, mine, patience, partners, report.step)
    if aside is not None:
        report.tolerated, found = report.tolerated | copies, found + [aside]
    if mine.errors:
        found += underflow(report.status, mine.errors - stuck, report.grad_norm, gaps, report.step, faint)
    if stuck:
        found += frozen_partner(report.status, stuck, report.step)
    if units:
        found += idle_experts({n: g for n, g in gaps.items() if n in units}, verdict.errors & set(units),
                              verdict.history, report.step, report.expert_tokens)
    return found
