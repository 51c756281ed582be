"""STALE_GRAD only where it belongs: the four loop variants."""

import torch

import gradhealth as gh
from conftest import MLP


def run(variant, steps=4):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    reports = []
    for _ in range(steps):
        if variant == "set_to_none":
            opt.zero_grad(set_to_none=True)
        elif variant == "zero_fill":
            opt.zero_grad(set_to_none=False)
        elif variant == "model_zero_grad":
            model.zero_grad()
        if variant == "accumulate":
            opt.zero_grad()
            for _ in range(4):
                model(torch.randn(4, 8)).square().mean().backward()
                reports.append(mon.check())
        else:
            model(torch.randn(4, 8)).square().mean().backward()
            reports.append(mon.check())
        opt.step()
    return reports


def kinds(reports):
    return [[f.kind for f in r.findings] for r in reports]


def test_zero_grad_set_to_none_is_clean():
    assert all(k == [] for k in kinds(run("set_to_none")))


def test_zero_grad_zero_fill_is_clean():
    assert all(k == [] for k in kinds(run("zero_fill")))


def test_model_zero_grad_is_clean():
    assert all(k == [] for k in kinds(run("model_zero_grad")))


def test_accumulation_is_clean():
    assert all(k == [] for k in kinds(run("accumulate")))


def test_missing_zero_grad_is_stale():
    reports = run("missing")
    assert kinds(reports)[0] == []  # the first backward has nothing stale to add onto
    for r in reports[1:]:
        f = r.findings_of("STALE_GRAD")
        assert f, kinds(reports)
        assert set(f[0].params) == {n for n, _ in MLP().named_parameters()}
        assert f[0].message.startswith("all 6 parameters") and "zero_grad" in f[0].message
