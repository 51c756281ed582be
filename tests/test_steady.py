"""The healthy steady-state fast path (``gradhealth/steady.py``, ``gradhealth/quiet.py``) against the
full path: one run, made twice from the same seeds (a monitor with the fast path, one without it:
``GradHealth._steady``), healthy, then planted problems one after the other (a frozen layer, a NaN
batch, a missing ``zero_grad()``, a parameter dropped from the optimizer), healthy again between
and after them. Every report of the two is the same (states, norms, findings and their words,
levels, the update norms written in later), and its states are the naive per-parameter loop's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth import steady
from conftest import naive_classify

pytestmark = pytest.mark.usefixtures("one_thread")

#: step -> what is planted at it (healthy elsewhere); the history judges from its 20th check, so
#: the fast path's history and pile-up stories run before the first problem
PLAN = {26: "freeze", 27: "frozen", 28: "frozen", 29: "thaw", 33: "nan", 38: "no_zero_grad",
        43: "drop", 44: "dropped", 45: "dropped", 46: "restore"}
STEPS = 56


def _run(lag: int, fast: bool, counted: dict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=2e-2, momentum=0.9)
    monitor = gh.GradHealth(model, opt, on_problem="ignore", lag=lag)
    monitor._steady = fast
    g = torch.Generator().manual_seed(1)
    reports, naive, losses = [], {}, []
    bias = model[4].bias
    for step in range(STEPS):
        event = PLAN.get(step)
        x = torch.randn(32, 8, generator=g)
        y = x[:, :1].sin() + 0.5 * x[:, 1:2]
        if event == "nan":
            x[0, 0] = math.nan
        if event == "freeze":
            model[0].weight.requires_grad_(False)
        if event == "thaw":
            model[0].weight.requires_grad_(True)
        if event == "drop":
            opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if p is not bias]
        if event == "restore":
            opt.param_groups[0]["params"].append(bias)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        naive[step] = naive_classify(model, opt)
        r = monitor.check(loss=loss)
        if r is not None:
            reports.append(r)
        losses.append(loss.item())
        if event != "nan":  # (the loop skips the poisoned step, as a user's guard does)
            opt.step()
        if event != "no_zero_grad":
            opt.zero_grad()
    monitor.close()
    if monitor.last_report is not reports[-1]:  # (lag=1: the last check's report, delivered at close)
        reports.append(monitor.last_report)
    return reports, naive, losses, counted["finish"]


def _plain(v):
    """``v`` with every NaN as the string "nan" (NaN equals nothing, itself included)."""
    if isinstance(v, float) and v != v:
        return "nan"
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _seen(r) -> list:
    """Everything a report says, as plain values."""
    return _plain((r.step, dict(r.status), dict(r.grad_norm), r.total_grad_norm, dict(r.module_grad_norm),
            None if r.in_optimizer is None else dict(r.in_optimizer), r.not_ok, r.frozen_names, sorted(r.tolerated),
            dict(r.grad_streak), r.loss, dict(r.valid_counts), r.optimizer_index, dict(r.update_norm),
            dict(r.update_ratio), [(f.kind, f.level, f.message, f.params, f.step) for f in r.findings], r.ok))


@pytest.mark.parametrize("lag", [0, 1])
def test_the_fast_path_reports_what_the_full_path_reports(monkeypatch, lag):
    counted = {"finish": 0}
    finish = steady.finish

    def counting(*args, **kwargs):
        counted["finish"] += 1
        return finish(*args, **kwargs)

    monkeypatch.setattr(steady, "finish", counting)
    fast, naive, losses, used = _run(lag, True, counted)
    counted["finish"] = 0
    full, naive_full, losses_full, unused = _run(lag, False, counted)
    # the premises: the two runs are the same run; it trains while healthy; each problem is there
    assert _plain(losses) == _plain(losses_full) and naive == naive_full
    assert losses[25] < losses[0] and losses[-1] < losses[0]
    assert naive[27]["0.weight"] is gh.Status.FROZEN
    assert all(s is gh.Status.NON_FINITE_GRAD for s in naive[33].values())
    assert naive[44]["4.bias"] is gh.Status.NOT_IN_OPTIMIZER
    assert all(s is gh.Status.OK for s in naive[50].values())
    # the fast path ran on the healthy checks (not on the planted ones), the full path never
    assert used >= STEPS - 3 * len(PLAN) - 2 and unused == 0
    assert len(fast) == len(full) == STEPS
    for a, b in zip(fast, full):
        assert _seen(a) == _seen(b), a.step
        assert a.status == naive[a.step], a.step  # (the oracle: the naive per-parameter loop)
    # what the problems were called, the same on both paths
    said = {r.step: {f.kind for f in r.findings} for r in fast}
    assert not fast[33].ok and fast[33].status["0.weight"] is gh.Status.NON_FINITE_GRAD
    assert fast[27].status["0.weight"] is gh.Status.FROZEN
    assert fast[44].status["4.bias"] is gh.Status.NOT_IN_OPTIMIZER and not fast[44].ok
    assert said[20] == set() and said[STEPS - 1] == set()  # (healthy before and after)
