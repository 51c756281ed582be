"""The words of three verdicts, on the exact text: a parameter frozen before it went without a
gradient had no gradient while frozen; a reminder's header counts what its body counts; a zero
gradient beside a frozen zero partner says so instead of the generic causes."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        return self.a(x) + (self.b(x) if use_b else 0)


def test_checks_spent_frozen_are_not_checks_with_a_gradient(one_thread):
    torch.manual_seed(0)
    m = Branches()
    m.b.requires_grad_(False)  # frozen at checks 0-3, then unfrozen: no gradient at check 4 (its branch is off)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    mon = gh.GradHealth(m, opt, on_problem="ignore")
    x = torch.randn(8, 4)
    for i in range(5):
        if i == 4:
            m.b.requires_grad_(True)
        opt.zero_grad()
        m(x, use_b=i < 4).square().mean().backward()
        r = mon.check()
        opt.step()
        if i < 4:
            assert r.status["b.weight"] is gh.Status.FROZEN  # the premise
    assert r.status["b.weight"] is gh.Status.NO_GRAD
    [f] = [f for f in r.findings if f.kind == "TRANSIENT_GRAD"]
    assert "earlier checks" not in f.message, f.message  # it never had one: it was frozen
    assert "got no usable gradient at step 4 (1 of the 3 consecutive checks tolerated" in f.message, f.message


def test_a_reminder_header_counts_the_checks_its_body_counts(one_thread):
    torch.manual_seed(0)
    m = Branches()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    mon = gh.GradHealth(m, opt, on_problem="warn")
    x = torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(14):
            opt.zero_grad()
            m(x, use_b=False).square().mean().backward()
            mon.check()
            opt.step()
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    [reminder] = [s for s in said if "still," in s]
    header = re.search(r"still, (\d+) checks in a row since step (\d+)", reminder)
    body = re.search(r"for (\d+) checks in a row", reminder)
    assert header and body, reminder
    assert header.group(1) == body.group(1) == "10", reminder
    assert header.group(2) == "0", reminder  # b has had no gradient since the first check
    assert reminder.startswith("gradhealth step 9: still, 10 checks in a row since step 0"), reminder


def _peft_model(swap: bool):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["0"], lora_alpha=8))
    a, b = model.base_model.model[0].lora_A["default"], model.base_model.model[0].lora_B["default"]
    if swap:  # LoRA-FA with A and B swapped: B frozen at its zero init, A trains
        b.weight.requires_grad_(False)
    else:  # LoRA-FA as written: A frozen at its random init, B (zero-init) trains
        a.weight.requires_grad_(False)
    return model, a, b


def test_a_frozen_zero_partner_is_named_instead_of_the_generic_causes(one_thread):
    model, a, b = _peft_model(swap=True)
    assert torch.count_nonzero(b.weight) == 0 and not b.weight.requires_grad and a.weight.requires_grad  # premise
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="warn")
    x = torch.randn(16, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            opt.zero_grad()
            model(x).square().mean().backward()
            r = mon.check()
            opt.step()
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    assert len(said) == 1, said  # said once, at the first check
    assert "0.lora_A.default.weight got an exactly zero gradient at step 0: its zero-initialised partner is frozen: " \
           "nothing can move it off zero" in said[0], said[0]
    assert "dead ReLU" not in said[0], said[0]
    assert r.problems == {"base_model.model.0.lora_A.default.weight": gh.Status.ZERO_GRAD} and not r.ok


def test_the_rule_is_not_the_name_and_lora_fa_as_written_is_silent(one_thread):
    torch.manual_seed(0)
    down, up = nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)
    nn.init.zeros_(up.weight)
    up.requires_grad_(False)
    model = nn.Sequential(nn.Sequential(down, up), nn.Linear(8, 1))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    x = torch.randn(16, 8)
    opt.zero_grad()
    model(x).square().mean().backward()
    r = mon.check()
    [f] = r.findings_of("FROZEN_PARTNER")
    # the head's weight sees only the frozen zero's output: its zero gradient has the same cause
    assert f.params == ("0.0.weight", "1.weight") and not r.ok
    # the control: LoRA-FA as written (A frozen at random, B zero-init trains) trains, under raise
    model, a, b = _peft_model(swap=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    y = x.sum(1, keepdim=True)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        mon.check(loss=loss)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
