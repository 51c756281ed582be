"""The launch budget: the torch ops a check dispatches (on a GPU each is a kernel launch, and a
launch costs host time) are a constant per (device, dtype) group, whatever the tensor count: from
10 to 1000 tensors, on a healthy model, a vanishing one (fp32 squares that underflow: every norm
re-checked exactly, and from then on normed exactly), a mixed-dtype one and a frozen base model with
four trainable tensors (a LoRA fine-tune's shape), synchronous and deferred. Counted with
``TorchDispatchMode`` over the check and the optimizer step's hooks (the ops gradhealth's own code
dispatches), averaged over the 8 steps after the first (so the periodic change test and update
norms, every 8 checks here, are amortised as they are in a run); the first check, which builds the plans,
is counted apart."""

from __future__ import annotations

import gc
import sys
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradhealth as gh

pytestmark = pytest.mark.usefixtures("one_thread")


class Ops(TorchDispatchMode):
    """Counts the ops dispatched by gradhealth's own code (not the optimizer's, not the user's)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f = sys._getframe(1)
        while f is not None:
            name = f.f_code.co_filename.replace("\\", "/")
            if "/gradhealth/" in name and "/tests/" not in name:
                self.n += 1
                break
            if "/torch/optim/" in name:  # (the optimizer's own op, reached before any hook of ours)
                break
            f = f.f_back
        return func(*args, **(kwargs or {}))


class Heads(nn.Module):
    """``n`` tensors side by side (each Linear's output summed): every one gets a usable gradient."""

    def __init__(self, n: int, dtypes=(torch.float32,)):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(8, 8).to(dtypes[k % len(dtypes)]) for k in range(n // 2))

    def forward(self, x):
        return sum(h(x.to(h.weight.dtype)).float() for h in self.heads)


class Tiny(Heads):
    """``n`` tensors whose gradients all vanish below 1e-23, where fp32 squares underflow: every
    fused norm reads 0, every gradient is non-zero (each needs the exact re-check)."""

    def forward(self, x):
        return super().forward(x) * 1e-13  # (a loss of ~1e-26, gradients of ~1e-26)


class Zeros(Heads):
    """Every other head's output multiplied by 0: half the tensors get gradients that are exactly
    zero (ZERO_GRAD, an error once it persists), the other half train."""

    def forward(self, x):
        return sum(h(x) * (0.0 if k % 2 else 1.0) for k, h in enumerate(self.heads))


def frozen_base(n: int) -> nn.Module:
    """``n`` tensors, all but the last four frozen (outside the optimizer, as PEFT leaves them)."""
    model = Heads(n)
    for p in list(model.parameters())[:-4]:
        p.requires_grad_(False)
    return model


def model_of(shape: str, n: int) -> nn.Module:
    torch.manual_seed(0)
    return {"healthy": lambda: Heads(n), "vanishing": lambda: Tiny(n),
            "mixed": lambda: Heads(n, (torch.float32, torch.bfloat16)), "frozen": lambda: frozen_base(n)}[shape]()


def trainable(model: nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


@contextmanager
def hooks_counted(opt, ops: Ops):
    """The optimizer's step pre- and post-hooks (gradhealth's) each run under ``ops``, the step's own
    update outside it: the counter counts no op of the optimizer's own code either way (its frame,
    under torch/optim/, comes first), but under the mode each of the single-tensor Adam's ~10 ops a
    tensor would cost a Python dispatch (seconds at 1000 tensors, for nothing counted). A hook
    registered or removed during the step is left as the step left it."""
    hooks = (opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks)
    saved = [dict(d) for d in hooks]

    def under(hook):
        def run(*args):
            with ops:
                return hook(*args)
        return run

    for d in hooks:
        for key, hook in list(d.items()):
            d[key] = under(hook)
    try:
        yield
    finally:
        for d, old in zip(hooks, saved):
            for key in list(d):
                if key in old:
                    d[key] = old[key]


def ops_per_step(shape: str, n: int, lag: int, steps: int = 9, warm: int = 0):
    """(ops at the first check, the mean per step over the next ``steps - 1`` through the check and
    the optimizer step's hooks, the mean of the check alone), counted after ``warm`` checks (9: past the
    first checks' dense update norms, at checks 0, 1, 2, 4 and 8 here, into the run's usual cadence)."""
    model = model_of(shape, n)
    # (an eps below the vanishing gradients: their steps still move the parameters, so the change test
    # runs every 8 checks on every shape, and NOT_UPDATED stays silent. The single-tensor Adam: under a
    # dispatch mode the foreach one's in-place updates leave the version counters, which the change
    # test reads, as they were)
    opt = torch.optim.Adam(trainable(model), lr=1e-3, eps=1e-30, foreach=False)  # (foreach: see below)
    monitor = gh.GradHealth(model, opt, lag=lag, on_problem="raise", change_every=8, update_every=8)
    whole, checks = [], []
    g = torch.Generator().manual_seed(1)
    for k in range(warm + steps):
        x = torch.randn(4, 8, generator=g)
        model(x).pow(2).mean().backward()
        if k < warm:
            monitor.check()
            opt.step()
            opt.zero_grad()
            continue
        ops = Ops()
        with ops:
            monitor.check()
        checked = ops.n
        with hooks_counted(opt, ops):
            opt.step()
        opt.zero_grad()  # (set_to_none: no op; no hook of ours)
        whole.append(ops.n)
        checks.append(checked)
    monitor.close()
    return whole[0], sum(whole[1:]) / (steps - 1), sum(checks[1:]) / (steps - 1)


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("shape", ["healthy", "vanishing", "mixed", "frozen"])
def test_ops_per_check_do_not_grow_with_the_tensor_count(shape, lag):
    per = {n: ops_per_step(shape, n, lag, warm=9)[1] for n in (10, 1000)}
    # a constant per group: 1000 tensors cost what 10 do, up to a few ops for the CPU's stacked kernels
    # (one per shape and chunk, see stats._batches: 10 more at every check for the mixed model's two
    # dtypes) and the same chunks in the change test's and the update norms' window (about 45 ops once
    # in 8 checks here): per chunk, not per tensor
    assert per[1000] <= per[10] + 16, per
    assert per[1000] <= 40, per


def test_a_vanishing_model_costs_at_most_twice_a_healthy_one():
    """Its check (the norms exact, after the first re-check): at most twice the healthy check's ops."""
    for lag in (0, 1):
        healthy, vanishing = ops_per_step("healthy", 200, lag)[2], ops_per_step("vanishing", 200, lag)[2]
        assert vanishing <= 2 * healthy, (lag, vanishing, healthy)  # the check: its norms, exact


@pytest.mark.parametrize("shape", ["healthy", "vanishing"])
def test_the_premise(shape):
    """The vanishing shape really underflows: every fused fp32 norm reads 0 while the
    gradients are not zero (each is re-checked exactly); the healthy one has none."""
    model = model_of(shape, 400)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    fused = torch.stack(torch._foreach_norm(grads, 2)).tolist()
    exact = [float(torch.linalg.vector_norm(g.double())) for g in grads]
    under = [k for k, (f, e) in enumerate(zip(fused, exact)) if f == 0.0 and e > 0.0]
    if shape == "vanishing":
        assert len(under) == len(grads), (len(under), len(grads))
    else:
        assert under == [] and all(e > 0.0 for e in exact)


def test_the_frozen_base_is_judged_as_each_parameter_alone_would_be():
    """The frozen shape's premise and verdict: 996 frozen tensors outside the optimizer, four that
    train (their loss falls); every state and optimizer membership as the naive per-parameter loop
    decides it, at every check, and nothing said about a run that is healthy."""
    model = model_of("frozen", 1000)
    params = dict(model.named_parameters())
    opt = torch.optim.Adam(trainable(model), lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 4 and len(params) == 1000
    losses = []
    with gh.GradHealth(model, opt, on_problem="raise") as monitor:
        for step in range(12):
            loss = model(torch.ones(4, 8)).pow(2).mean()
            loss.backward()
            report = monitor.check()
            want = {n: gh.Status.FROZEN if not p.requires_grad else gh.Status.OK for n, p in params.items()}
            assert report.status == want and report.ok and not report.findings, step
            assert report.in_optimizer == {n: p.requires_grad for n, p in params.items()}
            assert set(report.grad_norm) == {n for n, p in params.items() if p.requires_grad}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_sick_model_pays_for_its_problems_a_bounded_python_work_each():
    """What grows is the report of the parameters that are not OK: a model with half its tensors
    ZERO_GRAD (said, named, judged, their streaks kept at every check) costs at most 200 Python
    instructions a problem over a healthy check of its size, at 100 and at 1000 tensors, the
    periodic check included (before: ~430 a problem)."""
    from gradhealth.benchmarks.counts import _instructions

    def per_check(cls, n):
        torch.manual_seed(0)
        model = cls(n)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        monitor = gh.GradHealth(model, opt, on_problem="ignore", change_every=8, update_every=8)
        g, out = torch.Generator().manual_seed(1), []
        for k in range(20):
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            if k < 2:  # (the first two, which build the plans, untraced: not among those compared)
                monitor.check()
            else:
                out.append(_counted(_instructions, monitor.check))
            report = monitor.last_report
            opt.step()
            opt.zero_grad()
        monitor.close()
        return sorted(out), report

    for n in (100, 1000):
        (healthy, fine), (sick, report) = per_check(Heads, n), per_check(Zeros, n)
        zero = [k for k, s in report.status.items() if s is gh.Status.ZERO_GRAD]
        assert fine.ok and len(zero) == n // 2 and not report.ok  # (the premise: half of them, an error)
        for q in (len(sick) // 2, -1):  # the median check, and the dearest
            assert sick[q] - healthy[q] <= 200 * len(zero), (n, q, sick[q], healthy[q])


def test_the_first_check_builds_its_plans_in_ops_that_do_not_read_back():
    """The first check (plans included) is the dearest; it is counted, not hidden: at most a few
    ops per tensor (views, built once), and the second check is back to the constant."""
    first, mean, _ = ops_per_step("healthy", 100, 0, steps=3)
    assert first <= 12 * 100 and mean <= 40, (first, mean)


def instructions_per_check(shape: str, n: int, lag: int, steps: int = 19) -> list[int]:
    """Python bytecode instructions executed by each check after the first report (``sys.settrace``
    opcode events, every frame the check enters: the host work a check costs besides its launches),
    the periodic change test and update norms (every 8 checks here) among them. (The first report
    builds what every later one reuses; a deferred monitor completes it at its second check.) Two
    runs, check by check the fewer: a module imported for the first time inside one check of one run
    is not the check's own work (nor a garbage collection: paused while a check is counted, as
    ``count_model`` pauses it; when it ran depended on what the worker ran before)."""
    # (past the first report and the first checks' dense update norms, at 0, 1, 2, 4 and 8 here: those
    # checks run untraced, the trace costing ten times the check)
    runs = [_instructions_once(shape, n, lag, steps, traced_from=10 + lag) for _ in range(2)]
    return list(map(min, *runs))


def _counted(count, fn) -> int:
    """``count(fn)`` with the garbage collector paused (a collection's finalizers are not the check's work)."""
    was = gc.isenabled()
    gc.disable()
    try:
        return count(fn)
    finally:
        if was:
            gc.enable()


def _instructions_once(shape: str, n: int, lag: int, steps: int, traced_from: int) -> list[int]:
    from gradhealth.benchmarks.counts import _instructions

    model = model_of(shape, n)
    opt = torch.optim.Adam(trainable(model), lr=1e-3, eps=1e-30, foreach=False)
    monitor = gh.GradHealth(model, opt, lag=lag, on_problem="raise", change_every=8, update_every=8)
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(steps):
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        if k < traced_from:
            monitor.check()
        else:
            out.append(_counted(_instructions, monitor.check))
        opt.step()
        opt.zero_grad()
    monitor.close()
    return out


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("shape", ["healthy", "vanishing", "mixed", "frozen"])
def test_python_work_per_check_does_not_grow_with_the_tensor_count(shape, lag):
    """Host work is launches and Python: 1000 tensors cost the Python of 10, at the usual check and
    at the periodic one (no per-parameter loop in Python while every parameter is OK or FROZEN; the
    per-parameter numbers are picked and written with ``map``/``zip`` in C): a frozen base model of
    996 tensors costs what one of 6 does."""
    small, large = instructions_per_check(shape, 10, lag), instructions_per_check(shape, 1000, lag)
    assert sorted(large)[len(large) // 2] <= 1.2 * sorted(small)[len(small) // 2], (small, large)
    assert max(large) <= 1.3 * max(small), (small, large)
