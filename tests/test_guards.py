"""gh.check_loss: each cause named, in the order a person would look."""

import re

import pytest
import torch
from torch import nn

import gradhealth as gh


def model_and_input():
    torch.manual_seed(0)
    return nn.Linear(3, 1), torch.randn(4, 3)


def test_healthy_loss_returns_none():
    m, x = model_and_input()
    assert gh.check_loss(m(x).mean(), m) is None


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda m, x: m(x).mean().item(), "is a float, not a torch.Tensor.*item"),
        (lambda m, x: [m(x).mean()], "is a list, not a torch.Tensor"),
        (lambda m, x: m(x), r"shape \(4, 1\).*loss.mean\(\)"),
        (lambda m, x: m(x).detach().mean(), r"\.detach\(\)"),
        (lambda m, x: torch.tensor(m(x).mean().item()), r"torch\.tensor\(\.\.\.\)"),
    ],
)
def test_causes(make, words):
    m, x = model_and_input()
    with pytest.raises(gh.GradModeError, match=words):
        gh.check_loss(make(m, x), m)


def test_no_grad_named():
    m, x = model_and_input()
    with torch.no_grad():
        loss = m(x).mean()
        with pytest.raises(gh.GradModeError, match=r"grad mode is disabled.*torch\.no_grad"):
            gh.check_loss(loss, m)
    # after the block the loss alone cannot tell it from a detach: both candidates are named, and
    # how to tell them apart
    with pytest.raises(gh.GradModeError, match=r"torch\.no_grad\(\).*or the graph was cut.*monitor on the model"):
        gh.check_loss(loss, m)


def _forward(m, x, how):
    if how == "no_grad":
        with torch.no_grad():
            return m(x).mean()
    return m(x).detach().mean()


@pytest.mark.parametrize("how", ["no_grad", "detach"])
def test_with_a_monitor_on_the_model_the_cause_is_named_not_both(how):
    """A no_grad forward and a .detach() give the same loss (no grad, no grad_fn); what the
    monitor saw of the forward tells them apart, after the no_grad block too."""
    m, x = model_and_input()
    named = {"no_grad": r"forward ran with grad mode disabled \(torch\.no_grad\(\)",
             "detach": r"although the forward ran with grad enabled: the graph was cut.*\.detach\(\)"}
    loss = _forward(m, x, how)
    assert not loss.requires_grad and loss.grad_fn is None  # the premise: the two look alike
    with pytest.raises(gh.GradModeError, match="Either"):  # (no monitor: both named)
        gh.check_loss(loss, m)
    with gh.GradHealth(m, torch.optim.SGD(m.parameters(), lr=0.1), on_problem="ignore"):
        loss = _forward(m, x, how)
        with pytest.raises(gh.GradModeError) as caught:
            gh.check_loss(loss, m)
        assert "Either" not in str(caught.value) and re.search(named[how], str(caught.value)), str(caught.value)
        other = named["detach" if how == "no_grad" else "no_grad"]
        assert not re.search(other, str(caught.value))
        assert gh.check_loss(m(x).mean(), m) is None  # a healthy loss stays healthy
    with pytest.raises(gh.GradModeError, match="Either"):  # closed: its record no longer stands for the model
        gh.check_loss(_forward(m, x, how), m)


def test_inference_mode_named():
    m, x = model_and_input()
    with torch.inference_mode():
        loss = m(x).mean()
    with pytest.raises(gh.GradModeError, match="inference_mode"):
        gh.check_loss(loss, m)


def test_all_frozen_named():
    m, x = model_and_input()
    m.requires_grad_(False)
    with pytest.raises(gh.GradModeError, match=r"every parameter of the model \(2 tensors\) has requires_grad=False"):
        gh.check_loss(m(x).mean(), m)


def test_grad_mode_error_is_runtime_error():
    assert issubclass(gh.GradModeError, RuntimeError)


def test_no_host_sync_on_healthy_path(monkeypatch):
    m, x = model_and_input()
    loss = m(x).mean()

    def boom(*a, **k):
        raise AssertionError("check_loss synchronised with the device")

    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    monkeypatch.setattr(torch.Tensor, "__bool__", boom)
    assert gh.check_loss(loss, m) is None


def test_a_detached_loss_made_to_require_grad_again_names_detach():
    m, x = model_and_input()
    loss = m(x).mean().detach().requires_grad_()  # the famous wrong "fix"
    assert loss.requires_grad and loss.grad_fn is None  # the premise
    with pytest.raises(gh.GradModeError, match=r"leaf tensor.*\.detach\(\)"):
        gh.check_loss(loss, m)
    with pytest.raises(gh.GradModeError, match="leaf tensor"):
        gh.check_loss(loss)
    assert gh.check_loss(m.weight.sum(), m) is None  # a loss computed from a parameter is fine
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mon = gh.GradHealth(m, opt, on_problem="ignore")
    loss = m(x).mean().detach().requires_grad_()
    loss.backward()
    r = mon.check(loss=loss)
    [f] = r.findings_of("GRAD_MODE")  # at the first check, not after grad_patience
    assert f.level == "error" and ".detach()" in f.message and not r.ok


class Checkpointed(nn.Module):
    """A hand-written reentrant checkpoint after frozen embeddings: its segment gets no gradient."""

    def __init__(self, reentrant=True):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.emb.weight.requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, ids):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, self.emb(ids), use_reentrant=self.reentrant)).mean(1)


@pytest.mark.parametrize("reentrant", [True, False])
def test_hand_written_reentrant_checkpoint_is_named(reentrant):
    import warnings

    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "None of the inputs have requires_grad=True"
        for _ in range(3):
            opt.zero_grad()
            model(torch.randint(0, 10, (4, 5))).square().mean().backward()
            r = mon.check()
            opt.step()
    if reentrant:
        assert {n for n, s in r.errors.items()} == {"block.0.weight", "block.0.bias"}  # the premise: NO_GRAD
        [f] = r.findings_of("CHECKPOINT_NO_GRAD")
        assert "use_reentrant=True" in f.message and "use_reentrant=False" in f.message
    else:
        assert r.ok and not r.findings_of("CHECKPOINT_NO_GRAD")
