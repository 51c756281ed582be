"""Exactly zero gradients that are underflow (gradhealth/underflow.py): a deep tanh stack whose
gradient shrinks through the layers until, in the first ones, every element is below float32's
range. Its first layers read ZERO_GRAD; the layers at the edge come and go (zero at one check, 1e-38
at the next), which must not pass for skipping (LayerDrop, an expert without tokens) and make the
never-used ones tolerated; the cause is said, with what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradhealth as gh

pytestmark = pytest.mark.usefixtures("one_thread")


class Stack(nn.Module):
    """200 x (Linear(64, 64), Tanh) with PyTorch's default init; ``residual``: x + tanh(W x) / 10
    and a LayerNorm every 20 layers, the same depth with a path for the gradient (the control)."""

    def __init__(self, residual: bool = False, depth: int = 200):
        super().__init__()
        self.residual = residual
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(64) for _ in range(depth // 20)) if residual else None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = x + torch.tanh(layer(x)) / 10 if self.residual else torch.tanh(layer(x))
            if self.residual and i % 20 == 19:
                x = self.norms[i // 20](x)
        return x


def run(residual: bool, steps: int = 8, on_problem: str = "ignore"):
    torch.manual_seed(0)
    model = Stack(residual)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = gh.GradHealth(model, opt, on_problem=on_problem)
    reports, losses = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        reports.append(monitor.check(loss))
        losses.append(loss.item())
        opt.step()
    monitor.close()
    return model, reports, losses


def test_the_premise_the_first_layers_underflow_in_float32_only():
    """In float32 the first layers' gradients are exactly zero; in float64 the same step's are not
    (the gradient is there, below float32's range); the layers after them are between 0 and 1e-30."""
    torch.manual_seed(0)
    model = Stack()
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    (model(x) - y).pow(2).mean().backward()
    first = model.layers[0].weight.grad.abs().max().item()
    norms = [layer.weight.grad.double().norm().item() for layer in model.layers]
    edge = next(v for v in norms if v > 0.0)  # (the first layer whose gradient is not all zeros)
    model.double().zero_grad()
    (model(x.double()) - y.double()).pow(2).mean().backward()
    assert first == 0.0 and model.layers[0].weight.grad.abs().max().item() > 0.0
    assert 0.0 < edge < gh.patience.FAINT and norms.index(edge) >= 20, (edge, norms.index(edge))


def test_underflow_is_named_and_not_taken_for_skipping():
    _, reports, _ = run(residual=False)
    zero = [n for n, s in reports[-1].status.items() if s is gh.Status.ZERO_GRAD]
    assert "layers.0.weight" in zero and len(zero) >= 40
    # never used: errors from the check where their gap reaches grad_patience (3), at every check after
    for r in reports[2:]:
        assert {n for n, s in r.status.items() if s is gh.Status.ZERO_GRAD and n.startswith("layers.0.")} <= set(r.errors), r.step
        assert not r.ok
        found = [f for f in r.findings_of("VANISHING_GRAD") if f.data.get("cause") == "underflow"]
        assert len(found) == 1 and "layers.0.weight" in found[0].params, r.step
        assert all(0.0 < v < gh.patience.FAINT for v in found[0].data["faint"].values())
        assert not any("layers.0." in f.message for f in r.findings_of("TRANSIENT_GRAD")), r.step
    words = str(gh.brief(reports[-1]))
    assert "underflows to exact zeros" in words and "do: keep the gradient's scale through the layers" in words
    explained = gh.policy.explain(reports[-1])
    assert "exactly zero gradients: see VANISHING_GRAD below." in explained


def test_the_same_depth_with_a_path_for_the_gradient_is_silent():
    """The control: residual connections and LayerNorm; the loss falls and nothing is said under raise."""
    _, reports, losses = run(residual=True, steps=10, on_problem="raise")
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(r.ok and not r.findings_of("VANISHING_GRAD") for r in reports)
    assert min(min(r.grad_norm.values()) for r in reports) > 1e-8


def test_a_resumed_run_keeps_the_verdict():
    """What the rule learnt (which units' gradients are faint, which were frozen and when they
    thawed) is in ``state_dict()``: a monitor loaded from it mid-run says what the uninterrupted
    one says, check for check (before, the faint units counted as skipping again after a resume,
    and the zero layers were tolerated for checks)."""
    def loop(resume_at: int | None, steps: int = 9):
        torch.manual_seed(0)
        model = Stack()
        x, y = torch.randn(16, 64), torch.randn(16, 64)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        monitor, out = gh.GradHealth(model, opt, on_problem="ignore"), []
        for step in range(steps):
            if step == resume_at:
                state = monitor.state_dict()
                monitor.close()
                monitor = gh.GradHealth(model, opt, on_problem="ignore")
                monitor.load_state_dict(state)
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            r = monitor.check(loss)
            out.append((sorted(r.errors), sorted((f.kind.value, f.params) for f in r.findings if f.level != "info")))
            opt.step()
        monitor.close()
        return out

    straight, resumed = loop(None), loop(5)
    assert straight[4][0] and straight[5:] == resumed[5:]
