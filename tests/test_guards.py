"""gh.check_loss: each cause named, in the order a person would look."""

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
    # after the block the cause cannot be told from a detach: both candidates are named
    with pytest.raises(gh.GradModeError, match=r"torch\.no_grad\(\).*or the graph was cut"):
        gh.check_loss(loss, m)


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
