"""``GradHealth``: the plain-loop monitor. One ``check()`` after ``loss.backward()``."""

from __future__ import annotations

import fnmatch
import logging
import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .classify import as_optimizers, decide, named_parameters, optimizer_param_ids
from . import stats
from .errors import GradHealthError, GradHealthInternalWarning, GradHealthWarning
from .guards import diagnose_loss
from .report import Finding, ParamMeta, Report, describe_groups, group_by_module, is_problem
from .sinks import check_sinks
from .status import HINTS, Status

__all__ = ["GradHealth", "ON_PROBLEM"]

ON_PROBLEM = ("warn", "raise", "ignore")
log = logging.getLogger("gradhealth")


def _check_choice(name: str, value, allowed: Sequence[str]) -> str:
    if value not in allowed:
        opts = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name} must be one of {opts}; got {value!r}")
    return value


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


def _check_patterns(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"expect_frozen must be a name pattern or a list of them (e.g. ['encoder.*']); got {value!r}")
    return value


class GradHealth:
    """Classify every parameter after each backward pass and report what is wrong.

    Args:
        model: the module being trained (DDP / torch.compile wrappers are unwrapped for names).
        optimizer: one optimizer, a list of them, or None (then NOT_IN_OPTIMIZER is never reported).
        on_problem: "warn" (one :class:`GradHealthWarning` per check with problems), "raise"
            (:class:`GradHealthError` after every sink got the report), or "ignore".
        every_n_steps: check only every n-th call of :meth:`check` (others return None at once).
        sinks: objects with ``write(report)`` (e.g. :class:`LoggingSink`, ``TensorBoardSink``).
        expect_frozen: name patterns (``fnmatch``, e.g. ``"encoder.*"``) of the parameters meant
            to be frozen. With it, a frozen parameter outside them, or a trainable one inside them,
            is an error finding (UNEXPECTED_FROZEN / UNEXPECTED_TRAINABLE).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer=None,
        *,
        on_problem: str = "warn",
        every_n_steps: int = 1,
        sinks=(),
        expect_frozen=None,
    ):
        self.model = model
        self._entries = named_parameters(model)
        self.optimizers = as_optimizers(optimizer)
        self.on_problem = _check_choice("on_problem", on_problem, ON_PROBLEM)
        self.every_n_steps = _check_positive_int("every_n_steps", every_n_steps)
        self.sinks = check_sinks(sinks)
        self.expect_frozen = _check_patterns(expect_frozen)
        self._meta = {
            n: ParamMeta(p.numel(), str(p.dtype).replace("torch.", ""), str(p.device)) for n, p in self._entries
        }
        self._calls = 0
        self._checks = 0
        self._closed = False
        self._broken_sinks: set[int] = set()
        self.last_report: Report | None = None

    # ------------------------------------------------------------------ public
    def check(self, loss: Tensor | None = None, *, step: int | None = None) -> Report | None:
        """Classify every parameter now (call after ``loss.backward()``).

        Returns the :class:`Report`, or None on a call that ``every_n_steps`` skips. ``loss``, when
        given, is judged too (can it produce gradients? is it finite?) in the same transfer.
        ``step`` overrides the monitor's own count of calls (e.g. a trainer's global step).
        """
        if self._closed:
            warnings.warn("gradhealth: check() on a closed monitor does nothing", GradHealthInternalWarning, stacklevel=2)
            return None
        s = self._calls if step is None else int(step)
        self._calls += 1
        if s % self.every_n_steps:
            return None
        try:
            report = self._build(s, loss)
        except Exception as exc:  # the monitor never breaks a training run unless asked to raise
            if self.on_problem == "raise":
                raise
            warnings.warn(
                f"gradhealth: check at step {s} failed internally and was skipped ({type(exc).__name__}: {exc}); "
                "training continues",
                GradHealthInternalWarning,
                stacklevel=2,
            )
            return None
        self._checks += 1
        self.last_report = report
        self._emit(report, stacklevel=3)
        return report

    def close(self) -> None:
        """Remove every hook this monitor installed; flush and close every sink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            for method in ("flush", "close"):
                fn = getattr(sink, method, None)
                if callable(fn):
                    try:
                        fn()
                    except Exception as exc:
                        warnings.warn(f"gradhealth: {type(sink).__name__}.{method}() failed: {exc}", GradHealthInternalWarning, stacklevel=2)

    def __enter__(self) -> GradHealth:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        return {"calls": self._calls, "checks": self._checks}

    def load_state_dict(self, state: dict) -> None:
        self._calls = int(state.get("calls", 0))
        self._checks = int(state.get("checks", 0))

    @property
    def parameter_names(self) -> list[str]:
        return [n for n, _ in self._entries]

    # ---------------------------------------------------------------- internal
    def _build(self, step: int, loss) -> Report:
        entries = self._entries
        ids = optimizer_param_ids(self.optimizers) if self.optimizers else None
        grads: list[Tensor] = []
        with_grad: list[int] = []
        for i, (_, p) in enumerate(entries):
            g = p.grad
            if g is not None:
                grads.append(g)
                with_grad.append(i)
        loss_t = loss.detach().reshape(1) if isinstance(loss, Tensor) and loss.numel() == 1 else None
        norms, extra = stats.grad_norms(grads, (loss_t,) if loss_t is not None else ())

        norm_of: list[float | None] = [None] * len(entries)
        for i, v in zip(with_grad, norms):
            norm_of[i] = v
        status: dict[str, Status] = {}
        in_opt: dict[str, bool] = {}
        for i, (name, p) in enumerate(entries):
            inside = ids is None or id(p) in ids
            in_opt[name] = inside
            status[name] = decide(p.requires_grad, norm_of[i], inside)
        grad_norm = {entries[i][0]: v for i, v in zip(with_grad, norms)}
        if any(math.isnan(v) for v in norms):
            total = math.nan
        else:
            total = math.hypot(*norms) if norms else 0.0

        report = Report(
            step=step,
            status=status,
            grad_norm=grad_norm,
            total_grad_norm=total,
            meta=self._meta,
            in_optimizer=in_opt if ids is not None else None,
            loss=extra[0] if extra else None,
        )
        if loss is not None:
            self._judge_loss(report, loss)
        self._judge_frozen(report)
        return report

    def _judge_loss(self, report: Report, loss) -> None:
        cause = diagnose_loss(loss, self.model)
        if cause is not None:
            report.findings.append(Finding("GRAD_MODE", f"loss cannot produce gradients: {cause}", step=report.step))
        elif report.loss is not None and not math.isfinite(report.loss):
            report.findings.append(
                Finding(
                    "NON_FINITE_LOSS",
                    f"the loss is {report.loss}: check the inputs and targets of this batch, a log/division "
                    "inside the loss, or a mean over an empty mask (gh.masked_mean makes the empty case explicit)",
                    step=report.step,
                )
            )

    def _judge_frozen(self, report: Report) -> None:
        frozen = [n for n, s in report.status.items() if s is Status.FROZEN]
        if self._checks == 0 and frozen:
            rows = group_by_module(report.status, lambda n, s: s is Status.FROZEN)
            trainable = len(report.status) - len(frozen)
            log.info("%s frozen; %d of %d trainable", describe_groups(rows), trainable, len(report.status))
        if self.expect_frozen is None:
            return
        pats = self.expect_frozen

        def expected(name: str) -> bool:
            return any(fnmatch.fnmatchcase(name, p) for p in pats)

        wrong_frozen = tuple(n for n in frozen if not expected(n))
        wrong_trainable = tuple(n for n, s in report.status.items() if s is not Status.FROZEN and expected(n))
        if wrong_frozen:
            chosen = set(wrong_frozen)
            report.findings.append(
                Finding(
                    "UNEXPECTED_FROZEN",
                    f"{describe_groups(group_by_module(report.status, lambda n, s: n in chosen))} frozen but not matched by "
                    f"expect_frozen={list(pats)}: unfreeze them (requires_grad_(True)) or add them to expect_frozen",
                    params=wrong_frozen,
                    step=report.step,
                )
            )
        if wrong_trainable:
            chosen = set(wrong_trainable)
            report.findings.append(
                Finding(
                    "UNEXPECTED_TRAINABLE",
                    f"{describe_groups(group_by_module(report.status, lambda n, s: n in chosen))} match expect_frozen={list(pats)} "
                    "but are trainable: freeze them (requires_grad_(False)) or change expect_frozen",
                    params=wrong_trainable,
                    step=report.step,
                )
            )

    def _emit(self, report: Report, stacklevel: int) -> None:
        for i, sink in enumerate(self.sinks):
            try:
                sink.write(report)
            except Exception as exc:
                if self.on_problem == "raise":
                    raise
                if i not in self._broken_sinks:
                    self._broken_sinks.add(i)
                    warnings.warn(
                        f"gradhealth: sink {type(sink).__name__} failed ({type(exc).__name__}: {exc}); "
                        "its reports are lost, training continues",
                        GradHealthInternalWarning,
                        stacklevel=stacklevel + 1,
                    )
        loud = [f for f in report.findings if f.level in ("warning", "error")]
        if report.ok and not loud:
            return
        if self.on_problem == "ignore":
            return
        message = self.explain(report)
        if self.on_problem == "raise" and not report.ok:
            raise GradHealthError(message, report)
        warnings.warn(message, GradHealthWarning, stacklevel=stacklevel + 1)

    @staticmethod
    def explain(report: Report) -> str:
        """The warning text: problems grouped by module, each with its usual causes and fix."""
        lines = [f"gradhealth step {report.step}: {report.headline()}"]
        by_state: dict[Status, list] = {}
        for row in group_by_module(report.status, is_problem):
            by_state.setdefault(row[2], []).append(row)
        for state, rows in by_state.items():
            lines.append(f"  {state.value}: {describe_groups(rows)} {HINTS[state]}")
        for f in report.findings:
            if f.level != "info":
                lines.append(f"  {f.kind}: {f.message}")
        return "\n".join(lines)
