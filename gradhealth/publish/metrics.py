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
from itertools import chain, starmap
from operator import truediv

from ..base.combine import combine_norms  # (torch-free: the report command reads a log without torch)
from ..base.findings import FindingKind
from ..base.naming import module_of
from ..base.report import Report

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
    names = list(report.update_norm)
    groups, tags, ordered, singles = _grouped(names, granularity)
    us = list(report.update_norm.values())
    ratio = report.update_ratio
    rs = list(ratio.values()) if list(ratio) == names else [ratio.get(n, math.nan) for n in names]
    ths = _divided(us, rs)  # each ||θ|| (0 where the ratio is not a positive finite number)
    total = combine_norms(us if ordered else list(chain.from_iterable(_parts(us, groups))))
    theta_total = combine_norms(ths if ordered else list(chain.from_iterable(_parts(ths, groups))))
    out[f"{PREFIX}/update_norm/total{suffix}"] = total
    out[f"{PREFIX}/update_ratio/total{suffix}"] = total / theta_total if theta_total > 0 else 0.0
    norms, thetas = _each_norm(us, groups, singles), _each_norm(ths, groups, singles)
    out.update(zip(tags, chain.from_iterable(zip(norms, _divided(norms, thetas, finite=False)))))
    return out


_GROUPS: dict[str, tuple] = {}  # granularity -> (names, groups, tags, ordered, singles) last asked for


def _grouped(names: list[str], granularity: str) -> tuple:
    """The groups of ``names`` in order of first appearance (each a slice of ``names``' positions
    when its names are consecutive, else a list of their positions), the tags ``update_norm/<g>``,
    ``update_ratio/<g>`` of each in turn, whether the groups are ``names`` in order, and the groups
    of one name (index of the group, position of the name): worked out again only when the names
    change."""
    memo = _GROUPS.get(granularity)
    if memo is None or memo[0] != names:
        at: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            at.setdefault(group_name(name, granularity), []).append(i)
        groups = [slice(v[0], v[-1] + 1) if v[-1] - v[0] + 1 == len(v) else v for v in at.values()]
        tags = [t for g in at for t in (f"{PREFIX}/update_norm/{g}", f"{PREFIX}/update_ratio/{g}")]
        ordered = [i for v in at.values() for i in v] == list(range(len(names)))
        singles = [(k, v[0]) for k, v in enumerate(at.values()) if len(v) == 1]
        memo = _GROUPS[granularity] = (list(names), groups, tags, ordered, singles)
    return memo[1:]


def _parts(values: list[float], groups: list) -> list[list[float]]:
    return [values[g] if g.__class__ is slice else [values[i] for i in g] for g in groups]


def _divided(a: list[float], b: list[float], finite: bool = True) -> list[float]:
    """``x / y`` where ``y`` is a positive (``finite``: and finite) number, else 0.0 (in C when every
    ``y`` is)."""
    top = math.inf if finite else math.nan  # (no float equals NaN: any positive y passes)
    if b and min(b) > 0 and max(b) != top and not any(map(math.isnan, b)):
        return list(map(truediv, a, b))
    return [x / y if y > 0 and y != top else 0.0 for x, y in zip(a, b)]


def _each_norm(values: list[float], groups: list, singles: list) -> list[float]:
    """:func:`combine_norms` of each group of ``values``: ``hypot`` in C (a group of one: its value),
    the rule for a NaN that meets an inf applied only where one came out inf."""
    if len(singles) == len(groups) and all(g.__class__ is slice for g in groups):
        out = [values[g.start] for g in groups]
    else:
        out = list(starmap(math.hypot, _parts(values, groups)))
        for k, i in singles:
            out[k] = values[i]
    if math.inf in out:
        out = [combine_norms(g) if h == math.inf else h for g, h in zip(_parts(values, groups), out)]
    return out
