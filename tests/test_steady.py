"""The healthy steady-state fast path (``gradhealth/check/steady.py``, ``gradhealth/check/quiet.py``) against the
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
from gradhealth.check import steady
from conftest import naive_classify

pytestmark = pytest.mark.usefixtures("one_thread")

#: step -> what is planted at it (healthy elsewhere); the history judges from its 20th check, so
#: the fast path's history and pile-up stories run before the first problem
PLAN = {26: "freeze", 27: "frozen", 28: "frozen", 29: "thaw", 33: "nan", 38: "no_zero_grad",
        43: "drop", 44: "dropped", 45: "dropped", 46: "restore"}
STEPS = 56


def _run(lag: int, fast: bool, counted: dict, guard: bool = False, dtype=torch.float32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=2e-2, momentum=0.9)
    monitor = gh.GradHealth(model, opt, on_problem="ignore", lag=lag, skip_nonfinite=guard)
    monitor._steady = fast
    g = torch.Generator().manual_seed(1)
    reports, naive, losses = [], {}, []
    bias = model[4].bias
    for step in range(STEPS):
        event = PLAN.get(step)
        x = torch.randn(32, 8, generator=g).to(dtype)
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


@pytest.fixture
def counted(monkeypatch) -> dict:
    """How many checks took the fast path (``steady.finish``), and how many of them beside a frozen set."""
    counted = {"finish": 0, "frozen": 0}
    finish = steady.finish

    def counting(m, t, *args, **kwargs):
        counted["finish"] += 1
        counted["frozen"] += bool(t.frozen)
        return finish(m, t, *args, **kwargs)

    monkeypatch.setattr(steady, "finish", counting)
    return counted


# (guard: lag=1's step guard, decided at launch; float64: its gradients' norms come back as one vector, not scalars)
@pytest.mark.parametrize("lag,guard,dtype", [(0, False, torch.float32), (1, False, torch.float32),
                                             (1, True, torch.float32), (0, False, torch.float64), (1, False, torch.float64)],
                         ids=["lag0", "lag1", "lag1-guard", "lag0-float64", "lag1-float64"])
def test_the_fast_path_reports_what_the_full_path_reports(counted, lag, guard, dtype):
    fast, naive, losses, used = _run(lag, True, counted, guard, dtype)
    counted["finish"] = 0
    full, naive_full, losses_full, unused = _run(lag, False, counted, guard, dtype)
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
    assert fast[33].status["0.weight"] is gh.Status.NON_FINITE_GRAD
    # (the guard skipped the poisoned step: said, and the report is handled; without it, a problem)
    assert (fast[33].ok, fast[33].skipped) == ((True, "nonfinite") if guard else (False, None))
    assert fast[27].status["0.weight"] is gh.Status.FROZEN
    assert fast[44].status["4.bias"] is gh.Status.NOT_IN_OPTIMIZER and not fast[44].ok
    assert said[20] == set() and said[STEPS - 1] == set()  # (healthy before and after)


class _QNet(nn.Module):
    """A DQN-style pair: the online network, trained, and its target network, a copy that gets no
    gradient, in no optimizer, loaded from the online one now and then."""

    def __init__(self):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.target = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.target.load_state_dict(self.q.state_dict())


class _Seen:
    """A sink that keeps what each report says at the moment a sink gets it: ``write``, and
    ``write_update`` (a report again, with its step's update norms, delivered while a later check is
    being made)."""

    def __init__(self):
        self.seen = []

    def write(self, report):
        self.seen.append(("write", _seen(report)))

    def write_update(self, report):
        self.seen.append(("write_update", _seen(report)))


def _run_copies(lag: int, fast: bool, counted: dict, after: bool = False, sink=None):
    """(``after``: each check after the optimizer's step, as a loop that checks last does)"""
    torch.manual_seed(0)
    model = _QNet()
    opt = torch.optim.Adam(model.q.parameters(), lr=1e-2)
    monitor = gh.GradHealth(model, opt, on_problem="ignore", lag=lag, sinks=[] if sink is None else [sink])
    monitor._steady = fast
    g = torch.Generator().manual_seed(1)
    reports, naive, losses = [], {}, []
    for step in range(40):
        x = torch.randn(32, 8, generator=g)
        with torch.no_grad():
            bootstrap = 0.1 * model.target(x)
        loss = nn.functional.mse_loss(model.q(x), x[:, :1].sin() + bootstrap)
        loss.backward()
        naive[step] = naive_classify(model, opt)
        if after:
            opt.step()
        r = monitor.check(loss=loss, optimizer=opt)  # (as SB3's DQN adapter checks: its optimizer's step)
        if r is not None:
            reports.append(r)
        losses.append(loss.item())
        if not after:
            opt.step()
        opt.zero_grad()
        if step % 15 == 14:
            model.target.load_state_dict(model.q.state_dict())
    monitor.close()
    if monitor.last_report is not reports[-1]:
        reports.append(monitor.last_report)
    return reports, naive, losses, counted["finish"]


@pytest.mark.parametrize("lag", [0, 1])
def test_target_network_copies_on_the_fast_path_as_on_the_full_path(counted, lag):
    """``check(optimizer=...)`` beside a target network's tolerated copies (NO_GRAD, in no optimizer),
    loaded from the online network twice: the same reports, the naive states, fast path or not."""
    fast, naive, losses, used = _run_copies(lag, True, counted)
    counted["finish"] = 0
    full, naive_full, losses_full, unused = _run_copies(lag, False, counted)
    assert _plain(losses) == _plain(losses_full) and naive == naive_full
    assert losses[-1] < losses[0]  # (the premise: it trains)
    assert all(naive[5][n] is gh.Status.NO_GRAD for n in naive[5] if n.startswith("target."))  # (the copies are there)
    assert used >= 30 and unused == 0
    assert len(fast) == len(full) == 40
    for a, b in zip(fast, full):
        assert _seen(a) == _seen(b), a.step
        assert a.status == naive[a.step], a.step
        assert a.ok and a.optimizer_index == 0, a.step
    kinds = {f.kind for r in fast for f in r.findings}
    assert gh.FindingKind.TARGET_COPY in kinds, kinds  # (said as info, tolerated)


@pytest.mark.parametrize("lag", [0, 1])
def test_a_sink_gets_the_same_reports_on_the_fast_path_as_on_the_full_path(counted, lag):
    """What a sink is handed, at the moment it is handed it: each report (``write``) and each report
    again once its step's update norms are known (``write_update``, delivered while the next check
    is made, before that one is done), beside a target network's copies, each check after the
    optimizer's step: the same on both paths (the tolerated copies, ``ok``, the update norms)."""
    seen = {}
    for fast in (True, False):
        sink = _Seen()
        reports, naive, losses, used = _run_copies(lag, fast, counted, after=True, sink=sink)
        seen[fast] = sink.seen
        assert losses[-1] < losses[0]  # (the premise: it trains)
        assert used >= 30 if fast else used == 0  # (the fast path ran on the steady checks; the full path never)
        counted["finish"] = 0
    assert [w for w, _ in seen[True]].count("write_update") >= 5  # (the premise: update norms delivered)
    assert seen[True] == seen[False]


#: the LoRA-shaped run: step -> what is planted at it (healthy elsewhere)
LORA = {20: "thaw", 30: "refreeze"}


def _run_lora(lag: int, fast: bool, counted: dict):
    """A frozen base (``requires_grad`` False, in no optimizer: a LoRA fine-tune's) under a trainable
    head; one base layer thawed (``requires_grad`` True, added to the optimizer), later frozen again."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    model = nn.Sequential(base, nn.Linear(16, 1))
    base.requires_grad_(False)
    opt = torch.optim.SGD(model[1].parameters(), lr=2e-2, momentum=0.9)
    monitor = gh.GradHealth(model, opt, on_problem="ignore", lag=lag)
    monitor._steady = fast
    g = torch.Generator().manual_seed(1)
    reports, naive, losses = [], {}, []
    for step in range(45):
        event = LORA.get(step)
        if event == "thaw":
            base[2].requires_grad_(True)
            opt.add_param_group({"params": list(base[2].parameters())})
        if event == "refreeze":
            base[2].weight.requires_grad_(False)  # (its bias trains on; the weight stays in the optimizer)
        x = torch.randn(32, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :1].sin() + 0.5 * x[:, 1:2])
        loss.backward()
        naive[step] = naive_classify(model, opt)
        r = monitor.check(loss=loss)
        if r is not None:
            reports.append(r)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    monitor.close()
    if monitor.last_report is not reports[-1]:
        reports.append(monitor.last_report)
    return reports, naive, losses, counted["finish"]


@pytest.mark.parametrize("lag", [0, 1])
def test_a_frozen_base_on_the_fast_path_as_on_the_full_path(counted, lag):
    """A LoRA-shaped model (a frozen base, a trainable head): healthy, a base layer thawed and added to
    the optimizer, its weight frozen again, healthy: the same reports fast path or not, the naive
    states; the fast path runs while the frozen set holds, the full path where it changes."""
    fast, naive, losses, used = _run_lora(lag, True, counted)
    on_frozen, counted["finish"] = counted["frozen"], 0
    full, naive_full, losses_full, unused = _run_lora(lag, False, counted)
    assert _plain(losses) == _plain(losses_full) and naive == naive_full
    assert losses[-1] < losses[0]  # (the premise: it trains)
    # (the premises: the base is frozen, then one layer of it trains, then its weight is frozen again)
    assert naive[10]["0.0.weight"] is gh.Status.FROZEN and naive[10]["0.2.weight"] is gh.Status.FROZEN
    assert naive[10]["1.weight"] is gh.Status.OK
    assert naive[25]["0.2.weight"] is gh.Status.OK and naive[25]["0.0.weight"] is gh.Status.FROZEN
    assert naive[35]["0.2.weight"] is gh.Status.FROZEN and naive[35]["0.2.bias"] is gh.Status.OK
    assert used >= 38 and on_frozen == used and unused == 0  # (every fast check beside a frozen base)
    assert len(fast) == len(full) == 45
    for a, b in zip(fast, full):
        assert _seen(a) == _seen(b), a.step
        assert a.status == naive[a.step], a.step
    assert all(r.ok for r in fast if r.step not in LORA and r.step - 1 not in LORA), [r.step for r in fast if not r.ok]
