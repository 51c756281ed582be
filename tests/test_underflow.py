"""Exactly zero gradients that are underflow (gradhealth/judge/underflow.py): a deep tanh stack whose
gradient shrinks through the layers until, in the first ones, every element is below float32's
range. Its first layers read ZERO_GRAD; the layers at the edge come and go (zero at one check, 1e-38
at the next), which must not pass for skipping (LayerDrop, an expert without tokens) and make the
never-used ones tolerated; the cause is said, with what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.judge import underflow
from gradhealth.publish import policy

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


def textbook_mlp(act, depth: int) -> nn.Sequential:
    """A deep plain MLP as textbooks write it to show vanishing gradients: Linear(64, 30), then
    Linear(30, 30) layers, each followed by ``act``, and a Linear(30, 10) head; PyTorch's default init."""
    layers = [nn.Linear(64, 30), act()]
    for _ in range(depth - 2):
        layers += [nn.Linear(30, 30), act()]
    return nn.Sequential(*layers, nn.Linear(30, 10))


def last_report(model, steps: int = 5):
    """``steps`` SGD steps on random batches (loss: the output's mean square); the last report."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = gh.GradHealth(model, opt, on_problem="ignore")
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        report = monitor.check(loss)
        opt.step()
    monitor.close()
    return report


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
    (the gradient is there, below float32's range); the first layer after them with a gradient has
    a subnormal one (a norm below float32's smallest normal number: the edge)."""
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
    assert 0.0 < edge < torch.finfo(torch.float32).tiny and norms.index(edge) >= 20, (edge, norms.index(edge))


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
        assert all(0.0 < v < underflow.FAINT for v in found[0].data["faint"].values())
        assert "underflows float32 (below 1.2e-38" in found[0].message
        assert not any("layers.0." in f.message for f in r.findings_of("TRANSIENT_GRAD")), r.step
    words = str(gh.brief(reports[-1]))
    assert "underflows to exact zeros" in words and "do: keep the gradient's scale through the layers" in words
    explained = policy.explain(reports[-1])
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


class Dropped(nn.Module):
    """Stochastic depth as its users write it: residual blocks dropped at random (their gradients
    zeroed by ``zero_grad(set_to_none=False)``: exactly zero when dropped), the last one dropped at
    every check so far (never used yet)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
        self.head = nn.Linear(8, 1)

    def forward(self, x, keep):
        for k, block in zip(keep, self.blocks):
            if k:
                x = x + torch.tanh(block(x))
        return self.head(x)


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 1e-31), (torch.float64, 1e-34)])
def test_skipping_with_tiny_gradients_is_still_skipping(dtype, scale):
    """Blocks skipped at random, a loss scaled to gradients of 1e-31 (float32) or 1e-34 (float64):
    small, but not subnormal: the skipping blocks stay proxies, the never-used block is tolerated
    as before, nothing is called underflow."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = Dropped().to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = gh.GradHealth(model, opt, on_problem="ignore")
    small = []
    for _ in range(10):
        keep = (torch.rand(5, generator=g) > 0.5).tolist()
        keep[4] = False
        opt.zero_grad(set_to_none=False)
        loss = model(torch.randn(16, 8, dtype=dtype), keep).pow(2).mean() * scale
        loss.backward()
        report = monitor.check(loss)
        small += [v for v in report.grad_norm.values() if v > 0]
        opt.step()
    monitor.close()
    assert max(small) < 1e-28 and min(small) > torch.finfo(dtype).tiny  # premise: tiny, not subnormal
    assert report.status["blocks.4.weight"] is gh.Status.NO_GRAD and report.errors == {}
    assert not report.findings_of("VANISHING_GRAD")


def test_a_zero_layer_beside_an_unrelated_tiny_gradient_keeps_its_own_words():
    """A layer multiplied by 0 (ZERO_GRAD, a real bug) in a model with a saturated sigmoid gate
    (a gradient of ~1e-35): not underflow; the words are ZERO_GRAD's own."""
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.masked, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
            self.gate = nn.Parameter(torch.tensor(-80.0))

        def forward(self, x):
            h = torch.relu(self.enc(x)) + 0 * self.masked(x)
            return self.head(h * (1 + torch.sigmoid(self.gate)))

    torch.manual_seed(0)
    report = last_report(Gated())
    assert 0.0 < report.grad_norm["gate"] < 1e-30  # premise
    assert set(report.errors) == {"masked.weight", "masked.bias"}
    assert not report.findings_of("VANISHING_GRAD")
    assert "dead ReLUs, a mask that selected nothing" in policy.explain(report)


def test_a_float16_stack_underflows_at_float16s_edge():
    """float16's smallest normal number is 6.1e-5: a 60-layer tanh stack in float16 loses its first
    layers' gradients there (in float64 they are not zero); named, with float16's own advice."""
    torch.manual_seed(0)
    model = Stack(depth=60).half()
    x, y = torch.randn(16, 64).half(), torch.randn(16, 64).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = gh.GradHealth(model, opt, on_problem="ignore")
    for _ in range(6):
        opt.zero_grad()
        loss = (model(x) - y).float().pow(2).mean()
        loss.backward()
        report = monitor.check(loss)
        opt.step()
    monitor.close()
    assert model.layers[0].weight.grad.abs().max().item() == 0.0  # premise: zero in float16 ...
    model.double().zero_grad()
    (model(x.double()) - y.double()).pow(2).mean().backward()
    assert model.layers[0].weight.grad.abs().max().item() > 0.0  # ... not in float64
    assert "layers.0.weight" in report.errors
    (found,) = [f for f in report.findings_of("VANISHING_GRAD") if f.data.get("cause") == "underflow"]
    assert "underflows float16 (below 6.1e-05" in found.message and "GradScaler" in found.message


def test_a_deep_sigmoid_stack_whose_first_layers_get_subnormal_gradients_is_named():
    """The textbook demonstration: 50 sigmoid layers, default init, SGD. The first layers' gradients
    are not zero but subnormal (below float32's smallest normal number) at every check: their steps
    barely move them. Named after grad_patience checks as VANISHING_GRAD (cause subnormal)."""
    torch.manual_seed(0)
    net = textbook_mlp(nn.Sigmoid, 50)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = gh.GradHealth(net, opt, on_problem="ignore")
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    reports = []
    for _ in range(6):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x[:64]), y[:64])
        loss.backward()
        assert 0.0 < net[0].weight.grad.double().norm().item() < torch.finfo(torch.float32).tiny  # premise: subnormal, not 0
        reports.append(monitor.check(loss))
        opt.step()
    monitor.close()
    found = [[f for f in r.findings_of("VANISHING_GRAD") if f.data.get("cause") == "subnormal"] for r in reports]
    assert not found[0] and not found[1] and all(len(f) == 1 for f in found[2:])  # (from grad_patience checks on)
    assert found[-1][0].params[:2] == ("0.weight", "0.bias") and found[-1][0].level == "warning"
    assert "below the normal range" in str(gh.brief(reports[-1]))


@pytest.mark.parametrize("first", [False, True], ids=["inside", "first"])
def test_subnormal_gradients_are_vanishing_only_as_the_models_first_parameters(first):
    """Two parameters used at a scale of 1e-42 get subnormal gradients at every check. Inside the
    model (after a healthy layer in its order: a gradient that is small by its nature, like a
    float16 attention key bias) nothing is said; as the model's first parameters, the gradient
    reaching the bottom of the model is subnormal: VANISHING_GRAD (cause subnormal)."""
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.ones(8)), nn.Parameter(torch.ones(8))

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            if first:
                self.pair = Pair()
            self.enc, self.head = nn.Linear(8, 8), nn.Linear(8, 4)
            if not first:
                self.pair = Pair()

        def forward(self, x):
            return self.head(torch.tanh(self.enc(x)) + (self.pair.a + self.pair.b) * 1e-42)

    torch.manual_seed(0)
    report = last_report(Scaled())
    pair = ["pair.a", "pair.b"]
    assert list(report.status)[:2] == (pair if first else ["enc.weight", "enc.bias"])
    assert all(0.0 < report.grad_norm[n] < torch.finfo(torch.float32).tiny for n in pair)  # premise
    found = [f for f in report.findings_of("VANISHING_GRAD") if f.data.get("cause") == "subnormal"]
    assert [f.params for f in found] == ([tuple(pair)] if first else [])
