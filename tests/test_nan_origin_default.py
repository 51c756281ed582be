"""Where a NaN came from, at the step it arrives, in the README's plain loop as a user copies it,
with the default options: the loop is the README's own block (its model, data and the line that
calls the model swapped for a planted bug), run as written. Each test asserts its premise (the
gradients of that step really are NaN/inf, and nothing before it) against the tensors themselves."""

import math
import os
import re

import torch
from torch import nn

import gradhealth as gh

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD = 4  # the step the planted batch arrives at


def readme_loop() -> str:
    """The python block of the README's "The plain loop" section."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## The plain loop", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class Norm(nn.Module):
    """x / (1 + ||x||): a row of zeros gives a finite forward and NaN in backward (sqrt at 0)."""

    def forward(self, h):
        return h / (1 + torch.sqrt((h * h).sum(-1, keepdim=True)))


class Reciprocal(torch.autograd.Function):
    """The identity forward, a backward that divides by its input: inf where it is 0 (born in backward only)."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        (h,) = ctx.saved_tensors
        return g / (h != 0).to(g.dtype)


class Custom(nn.Module):
    def forward(self, h):
        return Reciprocal.apply(h)


class Policy(nn.Module):
    """SB3's shape: the monitor on the policy, the loop calling ``policy.q_net(obs)``."""

    def __init__(self, q_net):
        super().__init__()
        self.q_net = q_net
        self.value = nn.Linear(8, 1)

    def forward(self, x):
        return self.q_net(x), self.value(x)


def run(middle: nn.Module, plant: str, child: bool = False):
    """The README's loop on Linear(8, 32, bias=False) -> ``middle`` -> Linear(32, 1), 10 batches;
    batch BAD holds a NaN (``plant="nan"``) or a row of zeros (``plant="zeros"``: finite data that
    makes layer 0's output row exactly 0). Returns (reports, per-step finite gradients, losses)."""
    code = readme_loop()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32, bias=False), middle, nn.Linear(32, 1))
    model = Policy(net) if child else net
    loader = [(x, x.sum(1, keepdim=True)) for x in torch.randn(10, 16, 8)]
    x = loader[BAD][0]
    if plant == "nan":
        x[3, 2] = math.nan
    else:
        x[3] = 0.0
    swaps = [
        (r"\nmodel = .*\n", "\n"),  # the planted model and data, given below
        (r"\nloader = .*\n", "\n"),
        (r"torch\.manual_seed\(0\)\n", ""),
        (r"assert report\.ok\n", ""),
        (r"mse_loss\(model\(x\), y\)", "mse_loss(model.q_net(x) if CHILD else model(x), y)"),
        (r"( +)loss\.backward\(\)\n", r"\1loss.backward()\n\1seen(model, loss)\n"),
        (r"( +)report = monitor\.check\(loss=loss\).*\n", r"\g<0>\1reports.append(report)\n"),
    ]
    for pattern, repl in swaps:
        code, n = re.subn(pattern, repl, code)
        assert n == 1, f"the README's plain loop changed: {pattern!r} matched {n} times"
    finite, losses, reports = [], [], []

    def seen(model, loss):  # the premise, read from the tensors themselves
        finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None))
        losses.append(float(loss.detach()))

    scope = {"model": model, "loader": loader, "CHILD": child, "seen": seen, "reports": reports}
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore", gh.GradHealthWarning)
        exec(compile(code, "README.md (the plain loop)", "exec"), scope)
    assert "monitor = gh.GradHealth(model, optimizer)" in code  # the default options, nothing added
    assert not scope["monitor"].options.skip_nonfinite and not scope["monitor"].options.lag
    assert finite[:BAD] == [True] * BAD and not finite[BAD]  # premise: NaN/inf gradients first at step BAD
    return reports, finite, losses


def origins(report):
    return [f for f in report.findings_of("NONFINITE_ORIGIN") if f.level == "error"]


def test_a_nan_batch_is_named_at_the_step_it_arrives():
    reports, _, losses = run(nn.ReLU(), "nan")
    assert not math.isfinite(losses[BAD])
    assert not any(origins(r) for r in reports[:BAD])
    [f] = origins(reports[BAD])
    assert f.data["input_nonfinite"] and f.step == BAD
    assert f"at step {BAD}, the batch itself holds NaN/inf: the model's input (argument 0)" in f.message


def test_sqrt_at_zero_is_named_by_module_operation_and_line_at_that_step():
    reports, _, losses = run(Norm(), "zeros")
    assert math.isfinite(losses[BAD])  # premise: a finite forward; the NaN is born in backward
    assert not any(origins(r) for r in reports[:BAD])
    [f] = origins(reports[BAD])
    assert f.data["backward_origin"] == "1" and f.data["op"] == "SqrtBackward0" and not f.data["input_nonfinite"]
    assert "torch.sqrt((h * h).sum(-1, keepdim=True))" in f.data["source"] and "test_nan_origin_default.py" in f.message
    assert f.message.startswith(f"replayed at step {BAD}")


def test_a_nan_born_only_in_a_custom_backward_is_named_at_that_step():
    reports, _, losses = run(Custom(), "zeros")
    assert math.isfinite(losses[BAD])
    [f] = origins(reports[BAD])
    assert f.data["backward_origin"] == "1" and f.data["op"] == "ReciprocalBackward"
    assert "Reciprocal.apply(h)" in f.data["source"]


def test_a_child_the_loop_calls_directly_blames_the_batch_not_its_first_layer():
    reports, _, _ = run(nn.ReLU(), "nan", child=True)
    [f] = origins(reports[BAD])
    assert f.data["input_nonfinite"] and f.data["forward_origin"] == "q_net"
    assert "the input of module 'q_net' (argument 0) was already non-finite" in f.message
    assert "q_net.0" not in f.message  # (not the child's first layer)
    reports, _, _ = run(Norm(), "zeros", child=True)
    [f] = origins(reports[BAD])
    assert f.data["backward_origin"] == "q_net.1" and f.data["op"] == "SqrtBackward0"


def test_the_replay_leaves_gradients_state_and_random_streams_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32, bias=False), Norm(), nn.BatchNorm1d(32), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = gh.GradHealth(model, opt, on_problem="ignore")
    x = torch.randn(16, 8)
    x[3] = 0.0
    model(x).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert not all(bool(torch.isfinite(g).all()) for g in grads)  # premise
    buffers = [b.clone() for b in model.buffers()]
    rng, params = torch.random.get_rng_state(), [p.detach().clone() for p in model.parameters()]
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    [f] = origins(monitor.check())
    assert f.data["backward_origin"] == "1" and f.data["op"] == "SqrtBackward0"
    assert all(torch.equal(g.nan_to_num(), p.grad.nan_to_num()) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    assert torch.equal(rng, torch.random.get_rng_state())
    assert hooks == [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    monitor.close()


def test_a_healthy_check_keeps_nothing_and_an_evaluation_forward_is_not_kept():
    from gradhealth.origin.calls import KEEP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = gh.GradHealth(model, opt, on_problem="raise")
    calls = monitor._watch.calls
    losses, batch = [], torch.randn(16, 8)
    for _ in range(5):
        x = batch.clone()
        with torch.no_grad():
            model(x)  # an evaluation forward: not the step's
        assert calls.kept == []
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        assert len(calls.kept) == 1 and calls.kept[0][2][0] is x  # a reference to the batch, no copy
        assert monitor.check(loss=loss).ok and calls.kept == []  # a healthy check drops it
        opt.step()
        losses.append(loss.item())
    for _ in range(KEEP + 3):  # many forwards between two checks: the latest KEEP
        model(torch.randn(2, 8))
    assert len(calls.kept) == KEEP
    monitor.close()
    assert losses[-1] < losses[0]
