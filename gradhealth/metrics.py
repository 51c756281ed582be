"""Flat ``{tag: value}`` dicts of a report: the public metric-key scheme every logger adapter uses.

========================================  ==========================================================
key                                       value
========================================  ==========================================================
``gradhealth/<norm>/total``               L2 norm of every gradient checked (``<norm>`` is
                                          ``grad_norm``, or ``grad_norm_preclip`` from Lightning)
``gradhealth/<norm>/<name>``              L2 norm of one parameter's gradient, or of a module's own
                                          parameters' gradients (``granularity``)
``gradhealth/status/<STATE>``             how many parameters are in each state (all six)
``gradhealth/params_in_trouble``          how many judged parameters are in trouble: not OK, not
                                          FROZEN (but named by UNEXPECTED_FROZEN) and not tolerated
                                          (0 when healthy)
``gradhealth/tolerated``                  how many of the problems the policy tolerated (transient)
``gradhealth/loss``                       the loss given to ``check(loss=...)``
``gradhealth/valid/<name>``               the valid count recorded with ``track_valid``
``gradhealth/findings/<KIND>``            1.0 at a step with that finding (warning or error level)
``gradhealth/experts/utilization/<m>``    stacked experts of MoE layer ``<m>``: the share of its
                                          experts that got a gradient this step (0: collapse)
``gradhealth/experts/grad_norm_min/<m>``  the smallest and largest expert gradient norm of it
``gradhealth/experts/grad_norm_max/<m>``
``gradhealth/experts/dead/<m>[<i>]``      1.0 at a step where expert ``<i>`` is DEAD_EXPERT
``gradhealth/skipped``                    1.0 at a step the step guard dropped (skip_nonfinite,
                                          skip_spikes), else 0.0 (only with the guard on)
``gradhealth/clip_coef``                  after ``monitor.clip_grad_norm_``: the factor the gradients
                                          were scaled by (1.0: below ``max_norm``; from
                                          :func:`clip_metrics`, once the clip ran)
``gradhealth/update_norm/total``          ||Δθ|| of every parameter the step updated
``gradhealth/update_norm/<name>``         ||Δθ|| of a parameter or a module
``gradhealth/update_ratio/<name>``        ||Δθ|| / ||θ|| of a parameter or a module (``total``: all)
========================================  ==========================================================

Update keys come from :func:`update_metrics`, once the step has run; they carry the step they
describe. ``suffix`` (``"_opt1"``) tells several optimizers' totals and counts apart.
"""

from __future__ import annotations

import math

from .findings import FindingKind
from .naming import module_of
from .report import Report
from .combine import combine_norms  # (torch-free: the report command reads a log without torch)

__all__ = ["report_metrics", "update_metrics", "clip_metrics", "expert_metrics", "suffix", "PREFIX", "TROUBLE", "group_name", "in_trouble"]

PREFIX = "gradhealth"
TROUBLE = "params_in_trouble"

#: findings that name parameters in trouble outside the six states' error rules
_NAMING = (FindingKind.UNEXPECTED_FROZEN, FindingKind.UNEXPECTED_TRAINABLE)


def in_trouble(report: Report) -> int:
    """How many parameters the user must act on at this check: the policy's errors (not OK, not
    FROZEN, not tolerated) and those an expect_frozen finding of this check names."""
    names = set(report.errors)
    for f in report.findings:
        if f.kind in _NAMING and f.step == report.step:
            names.update(f.params)
    return len(names)


def group_name(name: str, granularity: str) -> str:
    return name if granularity == "param" else module_of(name)


def suffix(report: Report, n_optimizers: int) -> str:
    """``"_opt1"`` for a check of optimizer 1 when there are several, else ``""``."""
    if n_optimizers <= 1 or report.optimizer_index is None:
        return ""
    return f"_opt{report.optimizer_index}"


_TAGS: dict[str, tuple[list[str], list[str]]] = {}  # tag head -> (the names, their tags) last asked for


def _tags(names, head: str) -> list[str]:
    """``head + name`` for each of ``names``, made again only when the names change (a run's
    modules are the same at every check: no string built per module and write)."""
    keys = list(names)
    memo = _TAGS.get(head)
    if memo is None or memo[0] != keys:
        memo = _TAGS[head] = (keys, [head + n for n in keys])
    return memo[1]


def report_metrics(report: Report, granularity: str = "module", norm: str = "grad_norm", suffix: str = "") -> dict[str, float]:
    out: dict[str, float] = {f"{PREFIX}/{norm}/total{suffix}": report.total_grad_norm}
    if granularity == "module" and report.module_grad_norm:  # the monitor computed them already
        out.update(zip(_tags(report.module_grad_norm, f"{PREFIX}/{norm}/"), report.module_grad_norm.values()))
    else:
        groups: dict[str, list[float]] = {}
        for name, v in report.grad_norm.items():
            groups.setdefault(group_name(name, granularity), []).append(v)
        for g, vs in groups.items():
            out[f"{PREFIX}/{norm}/{g}"] = combine_norms(vs)
    for state, n in report.counts().items():
        out[f"{PREFIX}/status/{state.value}{suffix}"] = float(n)
    out[f"{PREFIX}/{TROUBLE}{suffix}"] = float(in_trouble(report))
    out[f"{PREFIX}/tolerated{suffix}"] = float(len(report.tolerated))
    if report.loss is not None:
        out[f"{PREFIX}/loss{suffix}"] = report.loss
    for name, n in report.valid_counts.items():
        out[f"{PREFIX}/valid/{name}"] = float(n)
    for f in report.findings:
        if f.step == report.step and f.level != "info":
            out[f"{PREFIX}/findings/{f.kind}"] = 1.0
    out.update(expert_metrics(report))
    out.update(clip_metrics(report, suffix))
    if report.skipped is not None or report.guarded:
        out[f"{PREFIX}/skipped{suffix}"] = 1.0 if report.skipped is not None else 0.0
    return out


def expert_metrics(report: Report) -> dict[str, float]:
    """Per MoE layer of stacked experts: utilization and the min / max expert gradient norm; a
    ``dead`` flag per dead expert."""
    out: dict[str, float] = {}
    for layer, units in report.expert_layers.items():
        states = [report.expert_status.get(u) for u in units]
        norms = [report.expert_grad_norm[u] for u in units if u in report.expert_grad_norm]
        judged = [s for s in states if s is not None and s.value != "FROZEN"]
        if judged:
            out[f"{PREFIX}/experts/utilization/{layer}"] = sum(s.value == "OK" for s in judged) / len(judged)
        if norms:
            out[f"{PREFIX}/experts/grad_norm_min/{layer}"] = min(norms)
            out[f"{PREFIX}/experts/grad_norm_max/{layer}"] = max(norms)
    for f in report.findings:
        if f.kind == FindingKind.DEAD_EXPERT and f.step == report.step:
            for u in f.params:
                out[f"{PREFIX}/experts/dead/{u}"] = 1.0
    return out


def clip_metrics(report: Report, suffix: str = "") -> dict[str, float]:
    """The clip's factor, once ``monitor.clip_grad_norm_`` ran after the report's check."""
    return {} if report.clip_coef is None else {f"{PREFIX}/clip_coef{suffix}": report.clip_coef}


def update_metrics(report: Report, granularity: str = "module", suffix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for f in report.findings:  # known once the step ran, with or without measured norms
        if f.kind in (FindingKind.NOT_UPDATED, FindingKind.FROZEN_BUT_CHANGED) and f.step == report.step \
                and f.level != "info":  # a warmup's lr 0 at its first step is not a finding to chart
            out[f"{PREFIX}/findings/{f.kind}"] = 1.0
    if not report.update_norm:
        return out
    upd: dict[str, list[float]] = {}
    par: dict[str, list[float]] = {}
    for name, u in report.update_norm.items():
        r = report.update_ratio.get(name, math.nan)
        g = group_name(name, granularity)
        upd.setdefault(g, []).append(u)
        par.setdefault(g, []).append(u / r if r and math.isfinite(r) and r > 0 else 0.0)
    out[f"{PREFIX}/update_norm/total{suffix}"] = total = combine_norms([u for us in upd.values() for u in us])
    theta_total = combine_norms([t for ts in par.values() for t in ts])
    out[f"{PREFIX}/update_ratio/total{suffix}"] = total / theta_total if theta_total > 0 else 0.0
    for g, us in upd.items():
        theta = combine_norms(par[g])
        out[f"{PREFIX}/update_norm/{g}"] = combine_norms(us)
        out[f"{PREFIX}/update_ratio/{g}"] = combine_norms(us) / theta if theta > 0 else 0.0
    return out
