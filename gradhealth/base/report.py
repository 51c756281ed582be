"""Results of one check: ``Finding`` and ``Report``, and grouping parameter names by module."""

from __future__ import annotations

import math
import operator
from collections import Counter
from itertools import chain, compress, filterfalse, repeat
from dataclasses import dataclass, field

from .combine import combine_norms  # (torch-free: the report command reads a log without torch)
from .findings import Finding
from .naming import plural, terminal_safe
from .status import Status

__all__ = ["Finding", "Report", "ParamMeta", "group_by_module", "describe_groups", "describe_names", "is_problem",
           "frozen_summary"]

@dataclass(frozen=True)
class ParamMeta:
    """What does not change from step to step: shared by every report of a monitor."""

    numel: int
    dtype: str
    device: str


def group_by_module(status: dict[str, Status], select) -> list[tuple[str, list[str], Status]]:
    """Collapse selected parameters into the shortest module prefixes that share one state.

    ``select(name, state)`` picks the parameters to show (or ``select`` is a collection of names).
    A prefix ``enc.*`` is emitted only when *every* parameter under ``enc`` is selected and in the
    same state; otherwise its children are looked at. When that holds for the whole model the
    single row is labelled ``*``. Returns ``(label, names, state)`` rows, in the module tree's order.
    The tree of the names is built once per set of names; a call walks only the selected ones.
    """
    if callable(select):
        chosen = [n for n, s in status.items() if select(n, s)]
    else:
        chosen = list(filter(select.__contains__, status))
    if not chosen:
        return []
    tree = _tree(tuple(status))
    if len(chosen) == len(status) > 1 and len(set(map(status.__getitem__, chosen))) == 1:
        return [("*", list(status), status[chosen[0]])]
    ancestors, under, size = tree.ancestors, tree.under, tree.size
    states = list(map(status.__getitem__, chosen))
    full: dict[str, Status] = {}  # the modules whose every parameter is chosen, in one state (counted in C)
    kinds = set(states)
    for s in kinds:
        mine = chosen if len(kinds) == 1 else compress(chosen, map(operator.is_, states, repeat(s)))
        count = Counter(chain.from_iterable(map(ancestors.__getitem__, mine)))
        full.update(zip(compress(count, map(operator.eq, count.values(), map(size.__getitem__, count))), repeat(s)))
    rows: list[tuple[str, list[str], Status]] = []
    done: set[str] = set()
    for n in sorted(chosen, key=tree.position.__getitem__):
        for a in ancestors[n]:  # (top down: the first such module)
            if a in full:
                if a not in done:
                    done.add(a)
                    rows.append((f"{a}.*", list(under[a]), full[a]))  # (a copy: the tree is shared)
                break
        else:
            rows.append((n, [n], status[n]))
    return rows


class _Tree:
    """The module tree of a list of names: each name's modules from the top (``ancestors``), each
    module's parameters in tree order (``under``), and each name's place in that order."""

    def __init__(self, names: tuple[str, ...]):
        root: dict = {}
        for name in names:
            node = root
            for part in name.split("."):
                node = node.setdefault(part, {})
        self.ancestors: dict[str, list[str]] = {}
        self.under: dict[str, list[str]] = {}
        order: list[str] = []

        def walk(prefix: str, node: dict, above: list[str]) -> list[str]:
            if not node:
                self.ancestors[prefix] = above
                order.append(prefix)
                return [prefix]
            mine = above + [prefix] if prefix else above
            out: list[str] = []
            for part, child in node.items():
                out += walk(f"{prefix}.{part}" if prefix else part, child, mine)
            if prefix:
                self.under[prefix] = out
            return out

        walk("", root, [])
        for name in names:  # (a name that is also a module's prefix: a row of its own)
            if name not in self.ancestors:
                self.ancestors[name] = [name[:i] for i, c in enumerate(name) if c == "."]
                order.append(name)
        self.position = {n: i for i, n in enumerate(order)}
        self.size = {a: len(names) for a, names in self.under.items()}


_STATES = tuple(Status)  # (iterating the enum itself runs Python: once here)
_TREES: dict[tuple, _Tree] = {}


def _tree(names: tuple[str, ...]) -> _Tree:
    tree = _TREES.get(names)
    if tree is None:
        evict(_TREES, 8)  # (a few models per process: keep the latest)
        tree = _TREES[names] = _Tree(names)
    return tree


def evict(cache: dict, most: int) -> None:
    """Drop the oldest entries of ``cache`` down to ``most - 1`` (another thread may be at it: no error)."""
    try:
        while len(cache) >= most:
            cache.pop(next(iter(cache)), None)
    except (RuntimeError, StopIteration):  # (changed size during iteration, or emptied meanwhile)
        pass


#: the modules a line of words names before "and N more modules" (the report's dicts hold every name)
LONG = 8


def describe_groups(rows, most: int | None = None) -> str:
    """``enc.* (24 params), head.weight`` from :func:`group_by_module` rows (the first ``most``, then
    how many more)."""
    if most is not None and len(rows) > most:
        return describe_groups(rows[:most]) + f" and {len(rows) - most} more modules"
    parts = []
    for label, names, _ in rows:
        if label == "*":
            parts.append(f"all {len(names)} parameters" if len(names) > 1 else "the only parameter")
        elif label.endswith(".*") and len(names) == 1:
            parts.append(names[0])  # a module with one parameter: its name says more than "m.* (1 param)"
        elif label.endswith(".*"):
            parts.append(f"{label} ({plural(len(names), 'param')})")
        else:
            parts.append(label)
    return ", ".join(parts)


def describe_names(status: dict[str, Status], names, most: int | None = None) -> str:
    """``enc.* (24 params), head.weight``: ``names`` grouped by the modules they fill (the first
    ``most`` groups, then how many more)."""
    chosen = names if isinstance(names, (set, frozenset)) else set(names)
    # (the same names in the same states, check after check: the words are made once)
    key = (tuple(status), frozenset(zip(chosen, map(status.get, chosen))), most)
    text = _DESCRIBED.get(key)
    if text is None:
        evict(_DESCRIBED, 64)
        text = _DESCRIBED[key] = describe_groups(group_by_module(status, chosen), most)
    return text


_DESCRIBED: dict[tuple, str] = {}


def frozen_summary(status: dict[str, Status]) -> str | None:
    """``enc.* (24 params) frozen; 4 of 28 trainable: head.* (2 params)``, or None when nothing is
    frozen; says when the trainable ones are adapters (LoRA, prompt tuning, IA3)."""
    frozen = [n for n, s in status.items() if s is Status.FROZEN]
    if not frozen:
        return None
    rows = group_by_module(status, lambda n, s: s is Status.FROZEN)
    training = group_by_module(status, lambda n, s: s is not Status.FROZEN)
    more = lambda rs: describe_groups(rs[:4]) + (f" and {len(rs) - 4} more groups" if len(rs) > 4 else "")  # noqa: E731
    adapters = any(k in n.lower() for n in status if status[n] is not Status.FROZEN
                   for k in ("lora_", "adapter", "prompt_encoder", "ia3_"))
    return terminal_safe(f"{more(rows)} frozen; {len(status) - len(frozen)} of {len(status)} trainable"
                         f"{' (adapters are training)' if adapters else ''}: {more(training)}")


def is_problem(_name: str, state: Status) -> bool:
    return state is not Status.OK and state is not Status.FROZEN


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.3g}"


@dataclass
class Report:
    """What one check saw. Dicts are keyed by parameter name (``named_parameters()`` order).

    Attributes:
        step: the check's step (counted by the monitor from 0, or the ``step=`` given to ``check``).
        status: name -> [Status][gradhealth.Status], every parameter.
        grad_norm: name -> L2 norm of its gradient, every parameter that has one (nan/inf when
            non-finite; exact at the under- and overflow edges).
        total_grad_norm: the L2 norm of every gradient together (pre-clip).
        findings: the [Finding][gradhealth.Finding]s of this check (and, once its optimizer step
            has run, of that step).
        update_norm: name -> ||Δθ|| of this step's ``optimizer.step()``, once the step has run (the
            next check's transfer, or ``flush()``), at the checks that measure it: 0, 1, 2, 4, ...
            up to half ``update_every``, then every ``update_every`` (100: 0, 1, 2, 4, 8, 16, 32,
            100, 200, ...); else empty.
        update_ratio: name -> ||Δθ|| / ||θ||, with ``update_norm``.
        module_grad_norm: module -> L2 norm of its own parameters' gradients.
        valid_counts: name -> the count ``track_valid`` recorded for this step.
        loss: the loss given to ``check(loss=...)``, as a float, or None.
        tolerated: the NO_GRAD / ZERO_GRAD names the policy tolerates at this check as transient
            (still in ``problems``, not in ``errors``).
        skipped: "nonfinite" or "spike" when the step guard dropped this check's step, else None.
        clip_coef: after ``monitor.clip_grad_norm_``, the factor it scaled the gradients by.
        backward: False where an adapter saw that no backward ran since the last check (a Lightning
            ``training_step`` that returned None), True where one did, None where nobody looked.

    Methods besides the properties ``problems``, ``errors``, ``ok`` and ``grads_finite``:
    ``findings_of(kind)`` (this check's findings of one kind), ``headline()``, ``summary_line()``,
    ``counts()`` and ``to_frame()``.
    """

    step: int
    status: dict[str, Status]
    grad_norm: dict[str, float]
    total_grad_norm: float
    findings: list[Finding] = field(default_factory=list)
    #: per-parameter update norm ||Δθ|| and ratio ||Δθ||/||θ|| of this step's optimizer.step(),
    #: filled in once the step has run (empty before, or without an optimizer).
    update_norm: dict[str, float] = field(default_factory=dict)
    update_ratio: dict[str, float] = field(default_factory=dict)
    #: L2 norm of each module's own parameters' gradients (the module of ``a.b.weight`` is ``a.b``).
    module_grad_norm: dict[str, float] = field(default_factory=dict)
    #: valid-element counts recorded with ``track_valid`` for this step, by name.
    valid_counts: dict[str, int] = field(default_factory=dict)
    loss: float | None = None
    #: name -> ParamMeta, read live from the parameters (a mapping)
    meta: dict[str, ParamMeta] = field(default_factory=dict, repr=False)
    in_optimizer: dict[str, bool] | None = field(default=None, repr=False)
    #: when the builder knows them (saves scanning every parameter): the names whose state is
    #: neither OK nor FROZEN, and the FROZEN ones
    not_ok: list[str] | None = field(default=None, repr=False, compare=False)
    frozen_names: list[str] | None = field(default=None, repr=False, compare=False)
    #: with several optimizers, the index of the one whose parameters this check judged
    #: (``check(optimizer=...)``); None when the check judged every parameter
    optimizer_index: int | None = None
    #: NO_GRAD / ZERO_GRAD parameters the policy tolerates at this check as transient (the
    #: persistence rule of :mod:`gradhealth.judge.patience`); still in ``problems``
    tolerated: frozenset[str] = field(default_factory=frozenset, repr=False)
    #: for every NO_GRAD / ZERO_GRAD parameter: consecutive checks (this one included) without a
    #: usable gradient
    grad_streak: dict[str, int] = field(default_factory=dict, repr=False)
    #: for NO_GRAD / ZERO_GRAD units that had gradients before: (checks with one, checks without
    #: one) before the current gap, the history the persistence rule judged the gap against
    grad_history: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    #: stacked experts (:mod:`gradhealth.model.experts`): each expert's state and gradient norm, keyed
    #: ``<experts module>[<index>]``, and the experts of each MoE layer in order
    expert_status: dict[str, Status] = field(default_factory=dict, repr=False)
    expert_grad_norm: dict[str, float] = field(default_factory=dict, repr=False)
    expert_layers: dict[str, list[str]] = field(default_factory=dict, repr=False)
    #: tokens the router sent each expert since the last check, when the model returns its router
    #: logits (Hugging Face ``output_router_logits=True``)
    expert_tokens: dict[str, int] = field(default_factory=dict, repr=False)
    #: the step guard dropped this check's gradients ("nonfinite" or "spike"), else None
    skipped: str | None = None
    #: ``monitor.clip_grad_norm_`` after this check: the factor it scaled the gradients by (1.0: the
    #: clip did not bite) and its ``max_norm``; None without one. The step's update norms are then
    #: those of the clipped gradients.
    clip_coef: float | None = None
    clip_max_norm: float | None = None
    published: bool = field(default=False, repr=False, compare=False)  # the sinks have had it
    guarded: bool = field(default=False, repr=False)  # the step guard is on
    #: False where an adapter saw that no backward ran since the last check (Lightning skips it for
    #: a training_step that returns None); None: not observed
    backward: bool | None = field(default=None, repr=False)

    def _odd(self):
        """(name, state) of every parameter that is not OK, the FROZEN ones included."""
        if self.not_ok is not None:
            names = self.not_ok + self.frozen_names if self.frozen_names else self.not_ok
            return zip(names, map(self.status.__getitem__, names))
        return ((n, s) for n, s in self.status.items() if s is not Status.OK)

    @property
    def problems(self) -> dict[str, Status]:
        """Every parameter whose state is neither OK nor FROZEN."""
        if self.not_ok is not None:
            return dict(zip(self.not_ok, map(self.status.__getitem__, self.not_ok)))
        return {n: s for n, s in self.status.items() if s is not Status.OK and s is not Status.FROZEN}

    @property
    def errors(self) -> dict[str, Status]:
        """The problems the policy counts as errors: ``problems`` less the tolerated transients."""
        names, tolerated = self.not_ok, self.tolerated
        if names is None:
            return {n: s for n, s in self.problems.items() if n not in tolerated}
        names = list(filterfalse(tolerated.__contains__, names)) if tolerated else names
        return dict(zip(names, map(self.status.__getitem__, names)))

    @property
    def grads_finite(self) -> bool:
        """No gradient holds a NaN or inf: safe to apply (``if report.grads_finite: opt.step()``)."""
        return Status.NON_FINITE_GRAD not in (self.problems.values() if self.not_ok is None
                                              else map(self.status.__getitem__, self.not_ok))

    @property
    def ok(self) -> bool:
        """Nothing the user must act on: no problem the policy counts as an error (a transient
        NO_GRAD / ZERO_GRAD it tolerates does not count) and no error-level finding."""
        if self.not_ok or self.not_ok is None:  # (the usual report has no problem at all: no dict built)
            if self.errors:
                return False
        return not self.findings or not any(f.level == "error" for f in self.findings)

    def counts(self) -> dict[Status, int]:
        """How many parameters are in each state (every state present, zeros included)."""
        c = Counter(self.status.values())
        return dict(zip(_STATES, map(c.get, _STATES, repeat(0))))

    def findings_of(self, kind) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def to_frame(self, experts: bool = False):
        """A pandas DataFrame, one row per parameter, indexed by name; ``experts=True``: one row
        per stacked expert instead (status, grad_norm, tokens when the router reported them)."""
        import pandas as pd  # only here: the core needs pandas for this alone

        if experts:
            units = list(self.expert_status)
            return pd.DataFrame([{"layer": u[:u.rindex("[")], "expert": int(u[u.rindex("[") + 1:-1]),
                                  "status": self.expert_status[u].name,
                                  "grad_norm": self.expert_grad_norm.get(u, math.nan),
                                  "tokens": self.expert_tokens.get(u)} for u in units],
                                index=pd.Index(units, name="expert_name"),
                                columns=["layer", "expert", "status", "grad_norm", "tokens"])

        names = list(self.status)
        rows = []
        for n in names:
            m = self.meta.get(n)
            s = self.status[n]
            rows.append(
                {
                    "status": s.name,
                    "grad_norm": self.grad_norm.get(n, math.nan),
                    "update_norm": self.update_norm.get(n, math.nan),
                    "update_ratio": self.update_ratio.get(n, math.nan),
                    "numel": m.numel if m else None,
                    "dtype": m.dtype if m else None,
                    "device": m.device if m else None,
                    "requires_grad": s is not Status.FROZEN,
                    "in_optimizer": None if self.in_optimizer is None else self.in_optimizer.get(n),
                }
            )
        frame = pd.DataFrame(rows, index=pd.Index(names, name="name"))
        return frame

    def headline(self) -> str:
        """``2 NOT_IN_OPTIMIZER; STALE_GRAD`` or ``healthy``: what is wrong, in a few words."""
        c = Counter(s for s in self.errors.values())
        parts = [f"{k} {s.value}" for s, k in sorted(c.items(), key=lambda kv: list(Status).index(kv[0]))]
        parts += list(dict.fromkeys(f.kind for f in self.findings if f.level != "info"))
        return "; ".join(parts) if parts else "healthy"

    def summary_line(self) -> str:
        counts = ", ".join(f"{k} {s.value}" for s, k in self.counts().items() if k)
        clip = (f" (clipped to {_fmt(self.clip_max_norm)}: x{_fmt(self.clip_coef)}; the update norms are the clipped step's)"
                if self.clip_coef is not None and self.clip_coef < 1.0 else "")
        return f"{plural(len(self.status), 'parameter')}: {counts}; total grad norm {_fmt(self.total_grad_norm)}{clip}"

    def __str__(self) -> str:
        return terminal_safe(self._text())

    def _text(self) -> str:
        head = f"gradhealth step {self.step}: "
        problems = self.problems
        if not problems and not self.findings:
            return head + "healthy (" + self.summary_line() + ")"
        lines = [head + self.headline(), "  " + self.summary_line()]
        if problems:
            rows = group_by_module(self.status, is_problem)
            width = max(len("where"), *(len(r[0]) for r in rows))
            lines.append(f"  {'where':<{width}}  {'params':>6}  {'state':<16}  grad norm")
            for label, names, state in rows:
                norms = [self.grad_norm[n] for n in names if n in self.grad_norm]
                norm = combine_norms(norms) if norms else None
                lines.append(f"  {label:<{width}}  {len(names):>6}  {state.value:<16}  {_fmt(norm)}")
        if self.findings:
            lines.append("  findings:")
            for f in self.findings:
                lines.append(f"    [{f.level}] {f.kind}: {f.message}")
        return "\n".join(lines)
