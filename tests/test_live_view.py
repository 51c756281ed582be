"""A live view of the model: parameters added, replaced, re-assigned or converted after the
monitor was created are judged at the next check; lazy and complex parameters never crash."""

import math

import pytest
import torch
from torch import nn

import gradhealth as gh

S = gh.Status


def step(model, opt, mon, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    r = mon.check()
    opt.step()
    return r


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = None

    def forward(self, x):
        h = self.body(x)
        return self.head(h) if self.head is not None else h


def test_head_attached_after_the_monitor_is_judged():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    step(model, opt, mon, torch.randn(2, 4))
    model.head = nn.Linear(8, 2)  # attached after the monitor and the optimizer
    r = step(model, opt, mon, torch.randn(2, 4))
    assert r.status["head.weight"] is S.NOT_IN_OPTIMIZER and r.status["head.bias"] is S.NOT_IN_OPTIMIZER
    assert not r.ok
    opt.add_param_group({"params": model.head.parameters()})  # the repair
    r = step(model, opt, mon, torch.randn(2, 4))
    assert r.status["head.weight"] is S.OK and r.ok


def test_replaced_submodule_and_assign_load():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    step(model, opt, mon, torch.randn(2, 4))
    model[2] = nn.Linear(8, 2)  # replaced: the optimizer still holds the old one
    r = step(model, opt, mon, torch.randn(2, 4))
    assert set(r.status) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert r.problems == {"2.weight": S.NOT_IN_OPTIMIZER, "2.bias": S.NOT_IN_OPTIMIZER}
    assert r.grad_norm["2.weight"] == pytest.approx(model[2].weight.grad.double().norm().item(), rel=1e-6)
    # load_state_dict(assign=True) puts new tensors in: the optimizer holds none of them
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    r = step(model, opt, mon, torch.randn(2, 4))
    assert set(r.problems.values()) == {S.NOT_IN_OPTIMIZER} and len(r.problems) == 4


def test_param_group_edited_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD([model[0].weight, model[0].bias, model[1].weight], lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    assert step(model, opt, mon, torch.randn(2, 4)).status["1.bias"] is S.NOT_IN_OPTIMIZER
    opt.param_groups[0]["params"][2] = model[1].bias  # same length, another tensor
    r = step(model, opt, mon, torch.randn(2, 4))
    assert r.status["1.bias"] is S.OK and r.status["1.weight"] is S.NOT_IN_OPTIMIZER


def test_one_middle_layer_to_float64():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    step(model, opt, mon, torch.randn(2, 4))
    model[2].double()
    model[2].register_forward_pre_hook(lambda m, a: (a[0].double(),))
    model[4].register_forward_pre_hook(lambda m, a: (a[0].float(),))
    for _ in range(3):
        r = step(model, opt, mon, torch.randn(2, 4))
        assert r.ok
        assert r.grad_norm["2.weight"] == pytest.approx(model[2].weight.grad.norm().item(), rel=1e-12)


def test_lazy_parameters_are_left_out_until_materialised(caplog):
    import logging

    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    with caplog.at_level(logging.INFO, logger="gradhealth"):
        mon = gh.GradHealth(model, on_problem="ignore")  # before the first forward: no crash
    assert any("left out until their first forward: 0.weight, 0.bias" in r.getMessage() for r in caplog.records)
    model(torch.randn(2, 4)).sum().backward()
    r = mon.check()
    assert set(r.status) == {"0.weight", "0.bias", "2.weight", "2.bias"} and r.ok
    assert r.grad_norm["0.weight"] == pytest.approx(model[0].weight.grad.double().norm().item(), rel=1e-6)
    assert gh.classify(nn.Sequential(nn.LazyLinear(3))) == {}


def test_complex_parameters():
    torch.manual_seed(0)

    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))
            self.v = nn.Parameter(torch.randn(4, dtype=torch.complex128))

        def forward(self, x):
            return (x * self.w).abs().sum() + (x.to(torch.complex128) * self.v).real.sum()

    model = Spectral()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="raise", update_every=1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4)).backward()
        r = mon.check()
        opt.step()
    mon.flush()
    for name, p in model.named_parameters():
        assert r.grad_norm[name] == pytest.approx(torch.linalg.vector_norm(p.grad).item(), rel=1e-6)
    model.w.grad = torch.tensor([1, complex(0, math.inf), 0, 0], dtype=torch.complex64)
    assert gh.classify(model)["w"] is S.NON_FINITE_GRAD
    model.w.grad = torch.zeros(4, dtype=torch.complex64)
    assert gh.classify(model)["w"] is S.ZERO_GRAD
