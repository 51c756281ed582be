"""The monitor's guards: GRAD_MODE from the forward watch, EMPTY_VALID_SET, and the tracer armed
automatically after NaN/inf gradients."""

import math

import pytest
import torch
from torch import nn

import gradhealth as gh
from test_monitor import hook_state


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)
        self.mask_after_divide = False

    def forward(self, x):
        h = self.body(x)
        if self.mask_after_divide:
            d = torch.ones_like(h)
            d[0] = 0.0
            q = h / d
            h = torch.where(d != 0, q, torch.zeros_like(q))
        return self.head(h)


def setup(**kw):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, gh.GradHealth(model, opt, **kw)


def train_step(model, opt, mon, x=None, loss_fn=None):
    opt.zero_grad()
    x = torch.randn(4, 8) if x is None else x
    out = model(x)
    loss = out.square().mean() if loss_fn is None else loss_fn(out)
    loss.backward()
    r = mon.check(loss=loss)
    if r is None or r.grads_finite:
        opt.step()
    return r


def validate(model, no_grad=True):
    model.eval()
    if no_grad:
        with torch.no_grad():
            model(torch.randn(4, 8))
    else:
        model(torch.randn(4, 8))  # eval forward with grad on, no backward: still not a training step


def test_eval_mode_training_step_flagged():
    model, opt, mon = setup(on_problem="ignore")
    train_step(model, opt, mon)
    validate(model)  # ... and model.train() forgotten
    r = train_step(model, opt, mon)
    f = r.findings_of("GRAD_MODE")
    assert f and "model.train()" in f[0].message and "eval() mode" in f[0].message
    model.train()
    assert not train_step(model, opt, mon).findings


def test_submodule_left_in_eval_flagged_by_name():
    model, opt, mon = setup(on_problem="ignore")
    model.body[2].eval()
    r = train_step(model, opt, mon)
    f = r.findings_of("GRAD_MODE")
    assert f and f[0].params == ("body.2",) and "body.2" in f[0].message


@pytest.mark.parametrize("no_grad", [True, False])
def test_validation_passes_never_flagged(no_grad):
    model, opt, mon = setup()
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        for _ in range(3):
            model.train()
            r = train_step(model, opt, mon)
            assert not r.findings
            validate(model, no_grad=no_grad)


def test_precise_cause_from_the_forward_record():
    model, opt, mon = setup(on_problem="ignore")
    with torch.no_grad():
        loss = model(torch.randn(4, 8)).sum()
    assert "forward ran with grad mode disabled" in mon.diagnose_loss(loss)
    with torch.inference_mode():
        loss = model(torch.randn(4, 8)).sum()
    assert "forward ran under torch.inference_mode()" in mon.diagnose_loss(loss)
    loss = model(torch.randn(4, 8)).detach().sum()
    assert mon.diagnose_loss(loss).startswith("the loss does not require grad although the forward ran with grad enabled")
    # the monitor's own check names it the same way
    r = mon.check(loss=loss)
    assert "although the forward ran with grad enabled" in r.findings_of("GRAD_MODE")[0].message


def test_track_valid_counts_and_empty_set():
    model, opt, mon = setup(on_problem="ignore")
    mask = torch.tensor([True, False, True, True])
    mon.track_valid(mask, name="tokens")
    mon.track_valid(torch.tensor([1.0, 0.0]), name="tokens")  # micro-batches add up
    r = train_step(model, opt, mon)
    assert r.valid_counts == {"tokens": 4} and not r.findings
    mon.track_valid(torch.zeros(4, dtype=torch.bool), name="tokens")
    r = train_step(model, opt, mon)
    assert r.valid_counts == {"tokens": 0}
    f = r.findings_of("EMPTY_VALID_SET")
    assert f and "'tokens' selected nothing" in f[0].message


def test_track_valid_does_not_sync(monkeypatch):
    model, opt, mon = setup()

    def boom(*a, **k):
        raise AssertionError("host sync in track_valid")

    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    monkeypatch.setattr(torch.Tensor, "__bool__", boom)
    monkeypatch.setattr(torch.Tensor, "__int__", boom)
    mon.track_valid(torch.tensor([True, False]))
    mon.track_valid(torch.tensor([True, True]))


def test_empty_mask_signature_without_track_valid():
    model, opt, mon = setup(on_problem="ignore")

    def masked_loss(out):
        mask = torch.zeros(out.shape[0], dtype=torch.bool)
        return out[mask].square().mean()  # mean over nothing: NaN loss, zero gradients

    r = train_step(model, opt, mon, loss_fn=masked_loss)
    assert math.isnan(r.loss)
    assert set(r.status.values()) == {gh.Status.ZERO_GRAD}
    f = r.findings_of("EMPTY_VALID_SET")
    assert f and "every gradient is exactly zero" in f[0].message and not r.findings_of("NON_FINITE_LOSS")


def test_cross_entropy_all_ignored():
    model, opt, mon = setup(on_problem="ignore")
    r = train_step(model, opt, mon, loss_fn=lambda out: nn.functional.cross_entropy(out, torch.full((4,), -100)))
    assert r.findings_of("EMPTY_VALID_SET")


def test_healthy_loss_has_no_empty_finding():
    model, opt, mon = setup(on_problem="ignore")
    r = train_step(model, opt, mon, loss_fn=lambda out: nn.functional.cross_entropy(out, torch.tensor([0, 1, -100, 2])))
    assert not r.findings


def test_nan_named_at_its_own_check_and_no_hook_left_after():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    untouched = hook_state(model, opt)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    baseline = hook_state(model, opt)
    model.mask_after_divide = True
    for _ in range(2):  # named at the failing check itself, by a replay of the model's calls: no hook left after it
        r0 = train_step(model, opt, mon)
        assert not r0.grads_finite
        f = r0.findings_of("NONFINITE_ORIGIN")
        assert f, [x.kind for x in r0.findings]
        assert f[0].data["backward_origin"] == "(root)" and f[0].data["op"] == "DivBackward0"
        assert "q = h / d" in f[0].data["source"]
        assert "mask or clamp *before*" in f[0].message
        assert hook_state(model, opt) == baseline
    model.mask_after_divide = False
    r2 = train_step(model, opt, mon)
    assert r2.ok
    assert hook_state(model, opt)[0] == baseline[0]  # the tracer's module hooks are gone
    mon.close()
    assert hook_state(model, opt) == untouched


def test_tracer_option_off_installs_nothing():
    model, opt, mon = setup(on_problem="ignore", trace_on_nonfinite=False)
    baseline = hook_state(model, opt)
    model.mask_after_divide = True
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    mon.check()
    assert hook_state(model, opt) == baseline


def test_an_empty_batch_made_harmless_is_a_warning_that_says_what_still_moves():
    """The count is known to be 0 and the loss was guarded (0, no NaN: gh.masked_mean(empty="zero"),
    TRL's clamped token count): every gradient is exactly zero, yet AdamW's step still moves the
    weights. A warning, not an error (nothing is poisoned), not silence."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    before = [p.detach().clone() for p in model.parameters()]
    mask = torch.zeros(4, dtype=torch.bool)
    mon.track_valid(mask, name="tokens")
    out = model(torch.randn(4, 8))
    loss = gh.masked_mean(out.square().mean(1), mask, empty="zero")
    loss.backward()
    r = mon.check(loss=loss)
    opt.step()
    assert loss.item() == 0.0 and all(not p.grad.any() for p in model.parameters())  # the premise: harmless so far
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # ... yet the step moved them
    [f] = r.findings_of("EMPTY_VALID_SET")
    assert f.level == "warning" and r.ok
    assert "still moves the weights" in f.message and "weight decay" in f.message and "skip" in f.message
