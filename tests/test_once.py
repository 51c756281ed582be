"""Said once (gradhealth/publish/once.py): a persistent problem warns when it starts, as a reminder at
growing intervals, again when it changes, and once when it is resolved."""

import logging
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh

pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        out = self.head(self.body(x))
        extra = getattr(self, "extra", None)
        return out + extra(x) if extra is not None else out


def long_run(steps=300, second_at=150, resolve_at=None, caplog=None):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.body.parameters(), lr=1e-2)  # the head left out of the optimizer
    mon = gh.GradHealth(model, opt, sinks=[gh.LoggingSink("gh-once")])
    reports = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if step == second_at:  # a second problem: a new layer, also in no optimizer
                model.extra = nn.Linear(4, 1)
            if step == resolve_at:  # both put in the optimizer: resolved
                opt.add_param_group({"params": [p for n, p in model.named_parameters() if not n.startswith("body")]})
            x = torch.randn(8, 4)
            opt.zero_grad()
            model(x).square().mean().backward()
            reports.append(mon.check())
            opt.step()
    said = [(str(w.message)) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    return reports, said


def test_a_persistent_problem_warns_a_handful_of_times_in_300_steps(caplog):
    with caplog.at_level(logging.INFO, logger="gh-once"):
        reports, said = long_run(second_at=None)
    assert all(r.problems for r in reports)  # the premise: the problem is there at every step
    assert len(said) == 3  # when it starts, at its 10th and its 100th check
    assert said[0].startswith("gradhealth step 0:") and "head.* (2 params)" in said[0] and "NOT_IN_OPTIMIZER" in said[0]
    assert said[1].startswith("gradhealth step 9: still, 10 checks in a row since step 0")
    assert said[2].startswith("gradhealth step 99: still, 100 checks in a row since step 0")
    logged = [r for r in caplog.records if r.name == "gh-once" and r.levelno >= logging.WARNING]
    assert len(logged) == 3  # the logging sink says it the same way
    assert all(r.problems for r in reports[-5:])  # every report still carries it


def test_a_second_problem_is_said_at_its_step_and_a_cleared_one_once_as_resolved():
    reports, said = long_run(steps=220, second_at=150, resolve_at=200)
    at = {s.split(":")[0]: s for s in said}
    assert "gradhealth step 150" in at and "extra" in at["gradhealth step 150"]
    assert not reports[200].problems
    resolved = [s for s in said if "resolved" in s]
    assert len(resolved) == 1 and resolved[0].startswith("gradhealth step 200: resolved: NOT_IN_OPTIMIZER")
    assert len(said) <= 6


def test_raise_is_unchanged():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.body.parameters(), lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        with pytest.raises(gh.GradHealthError, match="NOT_IN_OPTIMIZER"):
            mon.check()
