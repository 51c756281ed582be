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
