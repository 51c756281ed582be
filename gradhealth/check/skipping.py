"""The step guard: make the optimizer step after a poisoned check change nothing, on every rank.

With ``skip_nonfinite=True`` a check whose gradients hold NaN/inf drops them (``p.grad = None`` for
every parameter that check judged) before ``optimizer.step()`` runs. Every
``torch.optim`` optimizer (single-tensor, foreach and fused) skips a parameter without a
gradient: its value, its moments and its step count stay exactly as they were. The decision comes
from the check's own numbers, already reduced across ranks, so every rank drops the same step and
none waits for another; it needs no host read beyond the check's one transfer. With
``skip_spikes=k`` a total gradient norm more than ``k`` robust deviations (1.4826 MAD) above the
median of the run's norm history is dropped the same way and kept out of the baseline
(non-finite norms never enter it). Under a grad scaler the scaler's own skip decides instead.

Each dropped step is a ``STEP_SKIPPED`` finding (a warning: the step, why, which parameters, which
rank produced the NaN/inf); ``skip_alarm`` skips in a row make it an error: the model itself
produces them, skipping will not help. The counts ride in ``state_dict`` and in the metrics
(``gradhealth/skipped``, ``gradhealth/skipped_total``).
"""

from __future__ import annotations

import dataclasses
import statistics

from ..base.findings import Finding, FindingKind
from ..base.report import describe_names
from ..base.status import Status
from ..judge.history import MAD_TO_SIGMA

__all__ = ["guard", "defused"]

#: the findings about a NaN/inf batch that a dropped step defuses (warnings instead of errors)
_DATA = (FindingKind.NON_FINITE_LOSS, FindingKind.NONFINITE_RANK, FindingKind.NONFINITE_EXPERT, FindingKind.NONFINITE_ORIGIN)


def _spike(history, total: float, k: float) -> tuple[float, float] | None:
    """(median, robust sigma) when ``total`` is a spike against the history before it (the check
    has already added its finite total as the newest value)."""
    past = list(history.total)[:-1]
    if len(past) < history.warmup:
        return None
    med = statistics.median(past)
    sigma = MAD_TO_SIGMA * statistics.median(abs(v - med) for v in past)
    return (med, sigma) if total > med + k * sigma and total > med else None


def guard(report, options, carry, history, params, scaler_present: bool, tracker=None, drop: bool = True,
          kept: bool = False) -> None:
    """Decide whether the step after ``report`` is skipped; if so drop the gradients of ``params``,
    leave that step unmeasured and add the STEP_SKIPPED finding to ``report``. ``drop=False``: a
    deferred check's step, already skipped when it was launched (:mod:`.deferred`): only the finding;
    ``kept``: that step was skipped on the device by fused optimizers, which leave the gradients."""
    report.guarded = True
    why, data = None, {}
    if options.skip_nonfinite and not report.grads_finite and not scaler_present:
        why = "nonfinite"
    elif options.skip_spikes is not None and history is not None and report.grads_finite:
        hit = _spike(history, report.total_grad_norm, options.skip_spikes)
        if hit is not None:
            why, data = "spike", {"median": hit[0], "sigma": hit[1]}
            history.forget_last()  # the spike never becomes part of the baseline
    if why is None:
        carry.skips_in_a_row = 0
        return
    dropped = sum(p.grad is not None for p in params) if drop else len(report.grad_norm)
    for p in params if drop else ():
        p.grad = None
    inside = report.in_optimizer
    had = list(report.grad_norm)  # (the parameters with a gradient: what was dropped; the others had none to drop)
    outside = sum(1 for n in had if inside is not None and not inside.get(n, True))
    carry.armed = None  # the step that follows changes nothing, by design: not measured
    if tracker is not None:
        tracker.disarm()
    carry.skips += 1
    carry.skips_in_a_row += 1
    report.skipped = why
    n = carry.skips_in_a_row
    alarm = n >= options.skip_alarm
    if why == "nonfinite":
        bad = [name for name, s in report.problems.items() if s is Status.NON_FINITE_GRAD]
        ranks = next((f.data.get("ranks") for f in report.findings if f.kind == FindingKind.NONFINITE_RANK), None)
        if not alarm:  # dropped: nothing for the policy to stop the run for; said as warnings
            report.tolerated = report.tolerated | set(bad)
            report.findings[:] = [dataclasses.replace(f, level="warning") if f.kind in _DATA and f.level == "error"
                                  else f for f in report.findings]
        where = f" (produced on rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))})" if ranks else ""
        what = f"its gradients were NaN/inf in {describe_names(report.status, bad)}{where}"
        params, data = tuple(bad), {"ranks": ranks, **data}
    else:
        what = (f"its total gradient norm {report.total_grad_norm:.3g} is above the run's median "
                f"{data['median']:.3g} by more than {options.skip_spikes:g} robust deviations ({data['sigma']:.3g} each)")
        params = ()
    tail = (f"; {n} steps in a row: the model itself produces them, skipping will not help (trace the NaN with "
            "gh.trace_nonfinite, lower the learning rate, look at the data)" if alarm else
            f" ({n} in a row; an error at {options.skip_alarm})")
    how = (f"the gradients of {describe_names(report.status, had) if had else f'{dropped} parameters'}"
           f"{f' ({outside} of them in no optimizer)' if outside else ''} were dropped before it on every rank" if not kept else "the fused optimizer skipped it on the device (its "
           "found_inf), leaving the gradients for zero_grad() to clear")
    report.findings.append(Finding(FindingKind.STEP_SKIPPED, f"the optimizer step after step {report.step} changes nothing: {what}; "
                    f"{how}, so the parameters and the optimizer's state stay as they were{tail}", params=params, step=report.step, level="error" if alarm else "warning",
                    data={"why": why, "in_a_row": n, "total": carry.skips, **data}))


def defused(report, finding: Finding) -> Finding:
    """``finding`` (about this step's NaN/inf, added after the check, e.g. a replay's origin) as a
    warning when the guard dropped the step and has not raised its alarm."""
    skipped = report.findings_of(FindingKind.STEP_SKIPPED)
    if finding.kind in _DATA and skipped and skipped[-1].level == "warning" and finding.level == "error":
        return dataclasses.replace(finding, level="warning")
    return finding
