"""The short form (gh.brief) and the loss-side origin of a NaN (the gradient reaching the model's
output already NaN while the output was finite)."""

import pytest
import torch
from torch import nn

import gradhealth as gh


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for negative inputs: born inside the model


def _run(model, loss_fn, steps=1, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reports = []
    with gh.GradHealth(model, opt, on_problem="ignore", trace_on_nonfinite=False, **kw) as mon:
        for _ in range(steps):
            opt.zero_grad()
            out = model(torch.randn(8, 4))
            loss = loss_fn(out)
            loss.backward()
            reports.append(mon.check())
            opt.step()
    return reports, out, loss


def _origins(report):
    return [f for f in report.findings_of("NONFINITE_ORIGIN") if f.data.get("from_loss")]


def test_a_zero_over_zero_in_the_loss_is_said_to_come_from_the_loss(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def empty_mean(out):
        mask = torch.zeros(out.shape[0], dtype=torch.bool)
        return (out.square().sum(1) * mask).sum() / mask.sum()  # 0/0

    [r], out, loss = _run(model, empty_mean)
    assert torch.isfinite(out).all() and torch.isnan(loss)  # the premise: a finite output, a 0/0 loss
    assert not r.grads_finite
    [f] = _origins(r)
    assert f.level == "error" and "made in the loss" in f.message and "0/0" in f.message
    lines = gh.brief(r)
    assert lines[0] == "NON_FINITE_GRAD in all 4 parameters: NaN/inf gradients"
    assert any(line.startswith("origin: in the loss") for line in lines) and lines[-1].startswith("do: gh.masked_mean")


def test_a_nan_born_inside_the_model_is_not_blamed_on_the_loss(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 2))
    [r], out, _ = _run(model, lambda out: out.mean())
    assert not torch.isfinite(out).all() and not r.grads_finite  # the premise: the forward made it
    assert not _origins(r)


def test_poisoned_weights_are_not_blamed_on_the_loss(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    [r], out, _ = _run(model, lambda out: out.square().mean())
    assert not r.grads_finite and not _origins(r)


def test_a_healthy_report_has_no_short_form_and_bad_framework_is_named(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reports, _, _ = _run(model, lambda out: out.square().mean(), steps=3)
    assert all(gh.brief(r) == [] for r in reports)
    with pytest.raises(ValueError, match="plain, lightning, transformers"):
        gh.brief(reports[0], framework="keras")


def test_the_fix_is_worded_for_the_framework(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)  # the head is left out
    with gh.GradHealth(model, opt, on_problem="ignore") as mon:
        model(torch.randn(8, 4)).square().mean().backward()
        r = mon.check()
    assert gh.brief(r)[0] == "NOT_IN_OPTIMIZER in 1.* (2 params): gradients, but in no optimizer param group"
    assert gh.brief(r, "plain")[-1] == "do: build the optimizer from model.parameters()"
    assert "configure_optimizers" in gh.brief(r, "lightning")[-1]
    assert "create_optimizer" in gh.brief(r, "transformers")[-1]


@pytest.mark.parametrize("kept", [True, False], ids=["small output kept", "large output reduced in hooks"])
@pytest.mark.parametrize("micro", [1, 3, 70], ids=["one backward", "3 micro-batches", "70 micro-batches (folded)"])
def test_the_loss_origin_over_micro_batches_both_ways_an_output_is_watched(one_thread, monkeypatch, kept, micro):
    """A small output is kept with its gradient retained (no kernel a step), a large one reduced to
    max |x| in hooks; either way, with micro-batches, the one whose loss made the NaN is found, and a
    NaN born in the model is not blamed on the loss."""
    from gradhealth.judge import guards

    if not kept:
        monkeypatch.setattr(guards, "KEEP_OUTPUT", 0)
    torch.manual_seed(0)
    for poison in ("loss", "model"):
        model = nn.Sequential(nn.Linear(4, 4), Log() if poison == "model" else nn.ReLU(), nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gh.GradHealth(model, opt, on_problem="ignore", trace_on_nonfinite=False) as mon:
            outs = []
            for k in range(micro):
                x = torch.rand(8, 4) + 0.5  # (positive: log is finite) ...
                if poison == "model" and k == micro // 2:
                    x[0, 0] = -1.0  # ... but for one micro-batch's first row
                out = model(x)
                outs.append(out)
                empty = poison == "loss" and k == micro // 2  # (that micro-batch's mask selects nothing: 0/0)
                mask = torch.zeros(8, dtype=torch.bool) if empty else torch.ones(8, dtype=torch.bool)
                ((out.square().sum(1) * mask).sum() / mask.sum()).backward()
            r = mon.check()
        assert outs[0].retains_grad == kept  # (its gradient retained only when kept)
        assert not r.grads_finite  # the premise: one micro-batch poisoned the gradients
        if poison == "loss":
            assert all(torch.isfinite(o).all() for o in outs)  # the premise: every output finite
            [f] = _origins(r)
            assert f.level == "error" and "made in the loss" in f.message
        else:
            assert not all(torch.isfinite(o).all() for o in outs)  # the premise: the model made it
            assert not _origins(r)


def test_a_small_output_is_watched_without_a_kernel_or_a_hook(one_thread):
    """The premise of keeping small outputs: the forward watch adds no kernel to the forward and no
    Python hook to the output (its gradient is retained by autograd), and a check drops it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    with gh.GradHealth(model, torch.optim.SGD(model.parameters(), lr=0.1), on_problem="ignore") as mon:
        with Ops() as ops:
            out = model(x)
        plain = Ops()
        mon._watch.remove()
        with plain:
            model(x)
        assert ops.seen == plain.seen  # the same kernels with the watch as without it
        assert not out._backward_hooks and out.retains_grad
        out.square().mean().backward()
        assert mon.carry.output_grad == [out]
        mon.check()
        assert mon.carry.output_grad is None


def test_a_kept_output_no_backward_reached_is_let_go_at_the_next_forward(one_thread):
    """A training-mode forward whose output never gets a backward (a metric computed under grad) is
    not kept past the next forward: its graph lives no longer than the loop's own variable would
    keep it; and if a backward does reach it later, the loss-side origin still sees it."""
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with gh.GradHealth(model, torch.optim.SGD(model.parameters(), lr=0.1), on_problem="ignore",
                       trace_on_nonfinite=False) as mon:
        out1 = model(torch.randn(8, 4))
        gone = weakref.ref(out1)
        del out1
        assert gone() is not None  # the premise: the monitor keeps it for now
        out2 = model(torch.randn(8, 4))
        assert gone() is None and mon.carry.output_grad == [out2]
        # a backward that reaches an output let go still counts: 0/0 in the loss of the first forward
        a = model(torch.randn(8, 4))
        b = model(torch.randn(8, 4))  # (a is let go here, before its backward)
        mask = torch.zeros(8, dtype=torch.bool)
        ((a.square().sum(1) * mask).sum() / mask.sum() + b.square().mean()).backward()
        r = mon.check()
    assert not r.grads_finite and torch.isfinite(a).all()  # the premise
    [f] = _origins(r)
    assert "made in the loss" in f.message
