"""GradScaler (CPU): unscaled norms, AMP_SKIPPED instead of an alarm, the alarm on repeats."""

import math
import warnings

import pytest
import torch

import gradhealth as gh
from conftest import MLP


def amp_step(model, opt, scaler, mon, x, overflow=False, unscale_first=False):
    opt.zero_grad()
    loss = model(x).square().mean()
    scaler.scale(loss).backward()
    if overflow:  # what an fp16 overflow leaves in the scaled gradients
        model.head.weight.grad[0, 0] = math.inf
    if unscale_first:
        scaler.unscale_(opt)
    r = mon.check()
    scaler.step(opt)
    scaler.update()
    return r


def setup(**kw):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    return model, opt, scaler, gh.GradHealth(model, opt, scaler=scaler, **kw)


def test_norms_are_unscaled():
    model, opt, scaler, mon = setup()
    x = torch.randn(4, 8)
    r = amp_step(model, opt, scaler, mon, x)
    # after scaler.step the grads were unscaled in place: they are the reference now
    for n, p in model.named_parameters():
        assert r.grad_norm[n] == pytest.approx(p.grad.double().norm().item(), rel=1e-5)


def test_norms_after_unscale_are_not_divided_twice():
    model, opt, scaler, mon = setup()
    x = torch.randn(4, 8)
    r = amp_step(model, opt, scaler, mon, x, unscale_first=True)
    for n, p in model.named_parameters():
        assert r.grad_norm[n] == pytest.approx(p.grad.double().norm().item(), rel=1e-5)


def test_one_skip_is_reported_not_alarmed():
    model, opt, scaler, mon = setup()
    x = torch.randn(4, 8)
    amp_step(model, opt, scaler, mon, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r1 = amp_step(model, opt, scaler, mon, x, overflow=True)
        r2 = amp_step(model, opt, scaler, mon, x)
    assert r1.status["head.weight"] is gh.Status.NON_FINITE_GRAD
    f = r1.findings_of("AMP_SKIPPED")
    assert f and f[0].level == "info" and f[0].data["scale"] == 2.0**12
    assert not r2.findings  # no NOT_UPDATED for the skipped step, no repeat
    assert scaler.get_scale() == 2.0**11


def test_repeated_skips_alarm():
    model, opt, scaler, mon = setup(on_problem="raise", amp_skip_alarm=3)
    x = torch.randn(4, 8)
    amp_step(model, opt, scaler, mon, x)
    amp_step(model, opt, scaler, mon, x, overflow=True)
    amp_step(model, opt, scaler, mon, x, overflow=True)
    with pytest.raises(gh.GradHealthError, match="3 steps in a row"):
        amp_step(model, opt, scaler, mon, x, overflow=True)


def test_scale_floor_alarm():
    model, opt, scaler, mon = setup(on_problem="ignore", amp_scale_floor=2.0**13)
    r = amp_step(model, opt, scaler, mon, torch.randn(4, 8))
    f = r.findings_of("AMP_SKIPPED")
    assert f and f[0].level == "error" and "collapsed" in f[0].message


def test_bad_scaler():
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        gh.GradHealth(MLP(), scaler=object())


def test_settling_from_a_large_init_scale_is_silent_under_raise():
    """GPT-2-style fp16 start: GradScaler(init_scale=2**24) halves many times in a row while it
    settles; that is not an alarm. Afterwards three skips in a row are."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    mon = gh.GradHealth(model, opt, scaler=scaler, on_problem="raise")
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        for _ in range(10):  # the first ten steps overflow, as a too-large scale does
            r = amp_step(model, opt, scaler, mon, x, overflow=True)
            assert r.findings_of("AMP_SKIPPED")[0].level == "info"
        for _ in range(3):
            assert amp_step(model, opt, scaler, mon, x).ok
    assert scaler.get_scale() == 2.0**14
    amp_step(model, opt, scaler, mon, x, overflow=True)
    amp_step(model, opt, scaler, mon, x, overflow=True)
    with pytest.raises(gh.GradHealthError, match="3 steps in a row"):
        amp_step(model, opt, scaler, mon, x, overflow=True)


def test_overflow_at_every_scale_is_still_caught_by_the_floor():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    mon = gh.GradHealth(model, opt, scaler=scaler, on_problem="raise")
    x = torch.randn(4, 8)
    with pytest.raises(gh.GradHealthError, match="collapsed"):
        for _ in range(20):
            amp_step(model, opt, scaler, mon, x, overflow=True)
    assert scaler.get_scale() < 1.0


def test_fused_optimizer_skipping_inside_its_kernel_is_an_amp_skip_not_a_step_that_changed_nothing():
    """A fused AdamW under a GradScaler runs step() (and its step hooks) even when the scaler found
    inf, and skips inside the kernel (Hugging Face Trainer's default optimizer under fp16). Only
    one layer overflows: the other's finite gradients must not read as a step that ignored them."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"loud": torch.nn.Linear(8, 4), "quiet": torch.nn.Linear(8, 4)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    mon = gh.GradHealth(model, opt, scaler=scaler, on_problem="raise")
    skipped = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        for step in range(12):
            opt.zero_grad()
            before = [p.detach().clone() for p in model.parameters()]
            x = torch.randn(4, 8)
            loss = model["loud"](x).pow(2).mean() * 1e12 + model["quiet"](x).pow(2).mean()
            scaler.scale(loss).backward()
            report = mon.check(loss)
            assert report.ok, str(report)
            assert torch.isfinite(model["quiet"].weight.grad).all()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:
                skipped += 1
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        report = mon.check()
    mon.close()
    assert skipped >= 4
    assert not report.findings_of("NOT_UPDATED"), str(report)


def test_fused_skips_on_steps_no_check_armed_still_count_as_skips():
    """every_n_steps=2, fused AdamW under a GradScaler settling from a scale far too high: the
    steps between checks skip inside the kernel too. Counted as steps that ran, they ended the
    settling early and made the next checked skip an error (with amp_skip_alarm=1 it raised)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    mon = gh.GradHealth(model, opt, scaler=scaler, on_problem="raise", every_n_steps=2, amp_skip_alarm=1)
    skips, settled_at, levels = 0, None, set()
    for s in range(30):
        opt.zero_grad()
        scaler.scale(1e6 * model(torch.randn(4, 8)).square().mean()).backward()
        r = mon.check()  # raises on an error-level finding
        scaler.step(opt)
        scaler.update()
        if r is not None:
            skips += len(r.findings_of("AMP_SKIPPED"))
            levels |= {f.level for f in r.findings}
            if settled_at is None and mon.carry.amp_settled:
                settled_at = s
    mon.close()
    assert skips >= 5 and levels == {"info"}
    assert settled_at is not None and scaler.get_scale() < 2.0**127 / 2**10  # it settled, after many halvings
