"""Hooks owned by the monitor (gradhealth/base/hooks.py): gone when it is closed or collected; sinks
closed under interrupts; check() inside grad-free contexts; meta parameters named."""

import gc
import warnings

import pytest
import torch
import torch.nn.modules.module as module_hooks
from torch import nn

import gradhealth as gh
from gradhealth.judge import guards


def model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def hook_count(model, opt):
    """Every hook registered on the model, its parameters and the optimizer, through torch's handles."""
    n = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    n += sum(len(p._backward_hooks or {}) for p in model.parameters())
    n += len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    return n


def step(model, opt, mon=None):
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    if mon is not None:
        mon.check()
    opt.step()


def globals_count():
    return len(module_hooks._global_module_registration_hooks) + len(module_hooks._global_parameter_registration_hooks)


def test_dropped_monitors_leave_no_hook_behind():
    model, opt = model_and_opt()
    base, base_globals = hook_count(model, opt), globals_count()

    def cell():  # a notebook cell run again: a monitor made and dropped, never closed
        mon = gh.GradHealth(model, opt, on_problem="ignore")
        for _ in range(2):
            step(model, opt, mon)
        assert hook_count(model, opt) > base  # the premise: it did hook in

    for _ in range(3):
        cell()
    gc.collect()
    assert hook_count(model, opt) == base
    assert globals_count() == base_globals
    calls = []  # and by counting calls: nothing of gradhealth runs any more
    original = guards.ForwardWatch._on_model
    guards.ForwardWatch._on_model = lambda self, *a: calls.append(1)
    try:
        step(model, opt)
    finally:
        guards.ForwardWatch._on_model = original
    assert calls == []


def test_the_global_hooks_go_with_the_last_live_monitor():
    from gradhealth.model import params

    gc.collect()  # monitors other tests dropped
    model, opt = model_and_opt()
    base, others = globals_count(), len(params._LIVE)
    a, b = gh.GradHealth(model, opt), gh.GradHealth(model, opt)
    with_two = globals_count()
    assert with_two == (base + 2 if not others else base)  # one module and one parameter hook, shared
    a.close()
    assert globals_count() == with_two
    b.close()
    assert globals_count() == base  # gone with the last live monitor (kept while others live)
    for _ in range(50):
        gh.GradHealth(model, opt).close()
    assert globals_count() == base


class Sink:
    def __init__(self, fail=None):
        self.fail, self.closed = fail, 0

    def write(self, report):
        pass

    def close(self):
        if self.fail is not None:
            fail, self.fail = self.fail, None
            raise fail
        self.closed += 1


def test_close_closes_every_sink_even_under_keyboard_interrupt_and_can_be_retried():
    model, opt = model_and_opt()
    first, stuck, last = Sink(), Sink(KeyboardInterrupt()), Sink()
    mon = gh.GradHealth(model, opt, sinks=[first, stuck, last])
    step(model, opt, mon)
    with pytest.raises(KeyboardInterrupt):
        mon.close()
    assert first.closed == 1 and last.closed == 1 and stuck.closed == 0  # the others were closed anyway
    assert hook_count(model, opt) == 0
    mon.close()  # retried: the sink that did not close now closes, the others not twice
    assert (first.closed, stuck.closed, last.closed) == (1, 1, 1)


def test_check_inside_inference_mode_keeps_measuring_updates():
    torch.manual_seed(0)
    model = nn.Linear(4, 4).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-8)  # bf16 weights: a step that changes nothing
    mon = gh.GradHealth(model, opt, on_problem="ignore", change_every=1)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not one "check failed internally"
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
            with torch.inference_mode():  # the trainer evaluates around the whole loop body
                reports.append(mon.check())
            opt.step()
        mon.flush()
    found = [f for r in reports for f in r.findings_of("NOT_UPDATED") if f.level == "error"]
    assert found  # the updates below bf16 precision are still found
    with torch.no_grad():
        assert mon.check() is not None


def test_a_meta_parameter_attached_mid_run_is_named_at_every_check():
    model, opt = model_and_opt()
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    step(model, opt, mon)
    with torch.device("meta"):
        model.add_module("late", nn.Linear(4, 4))
    reports = []
    for _ in range(3):
        opt.zero_grad()
        model[:4](torch.randn(3, 4)).sum().backward()
        reports.append(mon.check())
        opt.step()
    for r in reports:
        [f] = r.findings_of("META_PARAM")
        assert f.level == "error" and f.params == ("late.weight", "late.bias") and not r.ok
    with pytest.raises(ValueError, match="meta device"):  # at setup it is a clear error
        gh.GradHealth(model, opt)
