"""masked_mean and the safe_* guards: values against independent computations, gradcheck in
float64 on valid regions, and no NaN in any gradient at invalid positions."""

import math

import pytest
import torch
from torch.autograd import gradcheck

import gradhealth as gh

D = torch.float64


def test_seed_safe_div():
    x = torch.tensor([1.0, 3.0], requires_grad=True)
    d = torch.tensor([0.0, 2.0])
    y = gh.safe_div(x, d)
    assert y.tolist() == [0.0, 1.5]
    y.sum().backward()
    assert x.grad.tolist() == [0.0, 0.5]


def test_naive_mask_after_divide_gives_nan_but_safe_div_does_not():
    x = torch.tensor([1.0, 3.0], requires_grad=True)
    d = torch.tensor([0.0, 2.0], requires_grad=True)
    torch.where(d != 0, x / d, torch.zeros(())).sum().backward()
    assert math.isnan(d.grad[0].item())  # the bug this helper exists for
    x.grad = d.grad = None
    gh.safe_div(x, d).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(d.grad).all()
    assert d.grad.tolist() == [0.0, -3.0 / 4.0]


def test_seed_softplus_with_safe_where():
    x = torch.tensor([0.0, 1.0, 100.0], requires_grad=True)
    y = gh.safe_where(x < 20, lambda t: t.exp().log1p(), x, x)
    y.sum().backward()
    assert y[2].item() == 100.0
    assert x.grad.tolist() == pytest.approx([0.5, 1 / (1 + math.exp(-1)), 1.0])


def test_safe_div_default_validity():
    num = torch.tensor([1.0, math.nan, 2.0, 4.0, math.inf, 6.0], dtype=D, requires_grad=True)
    den = torch.tensor([2.0, 1.0, math.nan, 0.0, 1.0, -3.0], dtype=D, requires_grad=True)
    y = gh.safe_div(num, den)
    assert y.tolist() == [0.5, 0.0, 0.0, 0.0, 0.0, -2.0]
    y.sum().backward()
    assert torch.isfinite(num.grad).all() and torch.isfinite(den.grad).all()
    assert num.grad.tolist() == [0.5, 0, 0, 0, 0, -1 / 3]
    assert den.grad.tolist() == pytest.approx([-0.25, 0, 0, 0, 0, -6 / 9])


def test_safe_div_explicit_valid_and_broadcast():
    num = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    den = torch.tensor([2.0, 4.0])
    valid = torch.tensor([True, False])
    assert gh.safe_div(num, den, valid).tolist() == [[0.5, 0.0], [1.5, 0.0]]
    with pytest.raises(ValueError, match="does not broadcast"):
        gh.safe_div(num, den, torch.tensor([True, False, True]))


@pytest.mark.parametrize("fn, ref, domain", [
    (gh.safe_log, torch.log, lambda x: x > 0),
    (gh.safe_sqrt, torch.sqrt, lambda x: x > 0),
])
def test_log_sqrt_values_and_gradients(fn, ref, domain):
    x = torch.tensor([-1.0, 0.0, 0.25, 4.0, math.inf, math.nan], dtype=D, requires_grad=True)
    y = fn(x)
    ok = domain(x.detach()) & torch.isfinite(x.detach())
    assert torch.equal(y[ok], ref(x.detach()[ok]))
    assert (y[~ok] == 0).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~ok] == 0).all()
    xs = torch.tensor([0.3, 1.7, 5.0], dtype=D, requires_grad=True)
    assert gradcheck(fn, (xs,))


def test_safe_log_fill():
    assert gh.safe_log(torch.tensor([0.0, 1.0]), fill=-30.0).tolist() == [-30.0, 0.0]


def test_gradcheck_safe_div_and_where():
    num = torch.tensor([1.0, -2.0, 3.5], dtype=D, requires_grad=True)
    den = torch.tensor([0.5, 4.0, -1.5], dtype=D, requires_grad=True)
    assert gradcheck(gh.safe_div, (num, den))
    x = torch.tensor([-3.0, 0.5, 2.0], dtype=D, requires_grad=True)
    assert gradcheck(lambda t: gh.safe_where(t > 0, torch.log, t, t * 2, safe_value=1.0), (x,))


def test_masked_mean_against_naive():
    torch.manual_seed(0)
    v = torch.randn(4, 5, dtype=D)
    m = torch.rand(4, 5) > 0.4
    assert gh.masked_mean(v, m).item() == pytest.approx(v[m].mean().item())
    per_row = gh.masked_mean(v, m, dim=1)
    for i in range(4):
        expected = v[i][m[i]].mean().item() if m[i].any() else 0.0
        assert per_row[i].item() == pytest.approx(expected)


def test_masked_mean_nan_at_masked_positions_does_not_leak():
    v = torch.tensor([1.0, math.nan, 3.0, math.inf], requires_grad=True)
    m = torch.tensor([True, False, True, False])
    r = gh.masked_mean(v, m)
    r.backward()
    assert r.item() == 2.0
    assert v.grad.tolist() == [0.5, 0.0, 0.5, 0.0]
    vd = torch.tensor([1.0, 2.0, 3.0], dtype=D, requires_grad=True)
    assert gradcheck(lambda t: gh.masked_mean(t, torch.tensor([True, False, True])), (vd,))


@pytest.mark.parametrize("empty, expect", [("zero", 0.0), ("nan", math.nan)])
def test_masked_mean_empty_policies(empty, expect):
    v = torch.tensor([1.0, 2.0], requires_grad=True)
    r = gh.masked_mean(v, torch.zeros(2, dtype=torch.bool), empty=empty)
    assert (math.isnan(r.item()) and math.isnan(expect)) or r.item() == expect
    r.backward()
    assert v.grad.tolist() == [0.0, 0.0]


def test_masked_mean_raise():
    with pytest.raises(gh.EmptyValidSetError, match="selected nothing"):
        gh.masked_mean(torch.ones(3), torch.zeros(3, dtype=torch.bool), empty="raise")
    with pytest.raises(gh.EmptyValidSetError, match=r"along dim=1 \(1 of 2 slices\)"):
        gh.masked_mean(torch.ones(2, 3), torch.tensor([[True, False, False], [False] * 3]), dim=1, empty="raise")
    assert issubclass(gh.EmptyValidSetError, ValueError)


def test_masked_mean_bad_policy():
    with pytest.raises(ValueError, match="empty must be one of 'zero', 'nan', 'raise'; got 'skip'"):
        gh.masked_mean(torch.ones(2), torch.ones(2, dtype=torch.bool), empty="skip")
