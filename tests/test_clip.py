"""monitor.clip_grad_norm_: torch's clip with the check's norms, so the gradients are read once.
Every case against torch.nn.utils.clip_grad_norm_ on a twin model (the oracle)."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradhealth as gh
from test_distributed import spawn


OPEN = []


def monitor(*args, first_clip_shared=True, **kw):
    OPEN.append(gh.GradHealth(*args, **kw))
    if first_clip_shared:  # (as the adapters do; else the monitor's first clip is torch's, the next ones shared)
        from gradhealth.check.clip import arm

        arm(OPEN[-1])
    return OPEN[-1]


@pytest.fixture(autouse=True)
def _close_monitors():
    yield
    while OPEN:  # (a monitor that saw a NaN arms its tracer for the next step: closed, it lets go)
        OPEN.pop().close()


def twins(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    act = nn.Tanh() if dtype.is_complex else nn.ReLU()  # (no ReLU of complex numbers)
    a = nn.Sequential(nn.Linear(6, 8), act, nn.Linear(8, 3)).to(dtype)
    b = nn.Sequential(nn.Linear(6, 8), act, nn.Linear(8, 3)).to(dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def backward(nets, x, scale=50.0):
    for net in nets:
        out = net(x)
        (out.abs().square() if out.is_complex() else out.square()).mean().mul(scale).backward()


def gap(a, b):
    return max(float(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)))
               for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.complex64])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # biting, and not
def test_the_clip_equals_torchs(dtype, max_norm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (complex modules are "a new feature")
        a, b = twins(dtype)
    mon = monitor(a, torch.optim.SGD(a.parameters(), lr=0.1), on_problem="raise")
    backward((a, b), torch.randn(16, 6).to(dtype))
    report = mon.check()
    ours, theirs = mon.clip_grad_norm_(max_norm), torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm)
    assert ours.dtype == theirs.dtype and float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert gap(a, b) <= 1e-6
    assert float(ours) == pytest.approx(report.total_grad_norm, rel=1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6)
    assert (report.clip_coef < 1.0) == (max_norm == 0.5)
    assert ("clipped to 0.5" in report.summary_line()) == (max_norm == 0.5)


def test_mixed_dtypes_and_a_subset_of_parameters():
    a, b = twins()
    a[2].to(torch.bfloat16)
    b[2].to(torch.bfloat16)
    a.forward = b.forward = None  # (the twins run their layers by hand, in two dtypes)
    opt = torch.optim.SGD(a[0].parameters(), lr=0.1)  # the last layer is left out of the optimizer
    mon = monitor(a, opt, on_problem="ignore")
    x = torch.randn(16, 6)
    for net in (a, b):
        net[2](net[1](net[0](x)).to(torch.bfloat16)).float().square().mean().mul(50).backward()
    mon.check()
    # Lightning clips the optimizer's parameters only: the same subset on both sides
    ours = mon.clip_grad_norm_(0.3, parameters=list(a[0].parameters()))
    theirs = torch.nn.utils.clip_grad_norm_(list(b[0].parameters()), 0.3)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6) and gap(a, b) <= 1e-6


def test_sparse_gradients_are_clipped_by_their_norm():
    torch.manual_seed(0)
    emb = nn.Embedding(20, 4, sparse=True)
    ref = nn.Embedding(20, 4)
    ref.load_state_dict(emb.state_dict())
    mon = monitor(emb, torch.optim.SGD(emb.parameters(), lr=0.1), on_problem="raise")
    idx = torch.tensor([1, 3, 3, 7])
    for e in (emb, ref):
        e(idx).square().sum().mul(10).backward()
    assert emb.weight.grad.is_sparse  # the premise; torch's clip refuses sparse gradients
    with pytest.raises(NotImplementedError):
        torch.nn.utils.clip_grad_norm_([emb.weight], 0.5)
    mon.check()
    ours = mon.clip_grad_norm_(0.5)
    theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)  # the dense twin
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert torch.allclose(emb.weight.grad.to_dense(), ref.weight.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_totals_do_what_torch_does(bad):
    a, b = twins()
    mon = monitor(a, torch.optim.SGD(a.parameters(), lr=0.1), on_problem="ignore")
    backward((a, b), torch.randn(4, 6))
    for net in (a, b):
        net[0].weight.grad[0, 0] = bad
    mon.check()
    with pytest.raises(RuntimeError, match="non-finite") as ours_err:
        mon.clip_grad_norm_(1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as torch_err:
        torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0, error_if_nonfinite=True)
    assert str(ours_err.value) == str(torch_err.value)
    mon.check()  # again, without the error: the gradients scaled by the non-finite total, as torch does
    ours, theirs = mon.clip_grad_norm_(1.0), torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
    assert str(float(ours)) == str(float(theirs))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad.isnan(), q.grad.isnan()) and torch.equal(p.grad.nan_to_num(), q.grad.nan_to_num())


def test_with_the_step_guard_a_nan_step_is_skipped_and_the_clip_says_its_total():
    a, _ = twins()
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    mon = monitor(a, opt, on_problem="ignore", skip_nonfinite=True)
    before = [p.detach().clone() for p in a.parameters()]
    backward((a,), torch.randn(4, 6))
    a[0].weight.grad[0, 0] = math.nan
    report = mon.check()
    assert report.skipped == "nonfinite"
    total = mon.clip_grad_norm_(1.0, error_if_nonfinite=True)  # (no raise: the user asked to skip such steps)
    assert math.isnan(float(total))
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))


def test_under_a_grad_scaler_the_clip_unscales_first_as_the_amp_recipe_does():
    a, b = twins()
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in (a, b)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    mon = monitor(a, opts[0], scaler=scalers[0], on_problem="raise")
    x = torch.randn(16, 6)
    for net, s in zip((a, b), scalers):
        s.scale(net(x).square().mean() * 50).backward()
    mon.check()  # before unscale_: the check's norms are unscaled already
    ours = mon.clip_grad_norm_(0.5)
    scalers[1].unscale_(opts[1])
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6) and gap(a, b) <= 1e-6
    for s, o in zip(scalers, opts):
        s.step(o)
        s.update()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_without_a_fresh_check_it_is_torchs_clip():
    a, b = twins()
    mon = monitor(a, torch.optim.SGD(a.parameters(), lr=0.1), on_problem="ignore")
    backward((a, b), torch.randn(4, 6))
    mon.check()
    mon.clip_grad_norm_(0.5)
    torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    # a second clip of the same gradients reads them (the check's norms are the unclipped ones)
    ours, theirs = mon.clip_grad_norm_(0.1), torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6) and gap(a, b) <= 1e-6
    ours, theirs = mon.clip_grad_norm_(0.1, norm_type=math.inf), torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1, math.inf)
    assert float(ours) == float(theirs)


class Reads(TorchDispatchMode):
    """Which operators touch the gradients' storage (a norm is a read of every element)."""

    def __init__(self, grads):
        super().__init__()
        self.ptrs = {g.untyped_storage().data_ptr() for g in grads}
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [t for a in list(args) + list((kwargs or {}).values()) for t in (a if isinstance(a, (list, tuple)) else [a])]
        if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.ptrs for t in flat):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_shared_clip_reads_the_gradients_once_torchs_twice():
    a, b = twins()
    mon = monitor(a, torch.optim.SGD(a.parameters(), lr=0.1), on_problem="raise")
    backward((a, b), torch.randn(16, 6))
    mon.check()
    with Reads([p.grad for p in a.parameters()]) as ours:
        mon.clip_grad_norm_(0.5)
    with Reads([p.grad for p in b.parameters()]) as theirs:
        torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
    assert ours.ops == ["_foreach_mul_"]  # the multiply alone: no norm, no other read
    assert theirs.ops == ["_foreach_norm", "_foreach_mul_"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_on_two_gloo_ranks_the_clip_equals_torchs(tmp_path, layout):
    ranks = spawn(f"clip_{layout}", tmp_path, limit=240)
    for r in ranks:
        assert r["totals"] == pytest.approx(r["twin_totals"], rel=1e-6)  # the global total, on every rank
        assert max(r["grad_gap"]) <= 1e-6 and r["param_gap"] <= 1e-6
        assert all(c < 1.0 for c in r["coef"])  # the clip bit at every step
    assert ranks[0]["totals"] == ranks[1]["totals"]
    assert all(r["losses"][-1] < r["losses"][0] for r in ranks)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_check_of_earlier_gradients_is_never_used(set_to_none):
    """every_n_steps=2 checks every other step; a check after the first of two micro-batches: the
    clip of gradients the check did not see is torch's (the gradients are read), never stale norms."""
    a, b = twins()
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in (a, b)]
    mon = monitor(a, opts[0], on_problem="ignore", every_n_steps=2)
    for step in range(4):
        for o in opts:
            o.zero_grad(set_to_none=set_to_none)
        x = torch.randn(8, 6)
        backward((a, b), x[:4])
        mon.check()  # (every other step: the first micro-batch's gradients)
        backward((a, b), x[4:])
        ours, theirs = mon.clip_grad_norm_(0.2), torch.nn.utils.clip_grad_norm_(b.parameters(), 0.2)
        assert float(ours) == pytest.approx(float(theirs), rel=1e-6) and gap(a, b) <= 1e-6, step
        for o in opts:
            o.step()


def test_a_plain_loops_first_clip_is_torchs_and_the_next_ones_shared():
    a, b = twins()
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in (a, b)]
    mon = monitor(a, opts[0], on_problem="raise", first_clip_shared=False)
    read = []
    for step in range(3):
        for o in opts:
            o.zero_grad()
        backward((a, b), torch.randn(8, 6))
        report = mon.check()
        with Reads([p.grad for p in a.parameters()]) as ours:
            total = mon.clip_grad_norm_(0.2)
        read.append(ours.ops)
        assert float(total) == pytest.approx(float(torch.nn.utils.clip_grad_norm_(b.parameters(), 0.2)), rel=1e-6)
        assert gap(a, b) <= 1e-6 and (report.clip_coef is None) == (step == 0)
        for o in opts:
            o.step()
    assert read == [["_foreach_norm", "_foreach_mul_"], ["_foreach_mul_"], ["_foreach_mul_"]]


def test_an_internal_failure_of_the_shared_clip_falls_back_to_torchs(monkeypatch):
    import gradhealth.check.clip as clip

    a, b = twins()
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in (a, b)]
    mon = monitor(a, opts[0], on_problem="raise")
    backward((a, b), torch.randn(8, 6))
    mon.check()

    def broken(*args, **kw):
        raise ValueError("planted")

    monkeypatch.setattr(clip, "_scaling", broken)
    with pytest.warns(gh.GradHealthInternalWarning, match="planted"):
        ours = mon.clip_grad_norm_(0.2)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.2)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6) and gap(a, b) <= 1e-6
    for o in opts:
        o.step()
        o.zero_grad()
    backward((a, b), torch.randn(8, 6))
    mon.check()
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        mon.clip_grad_norm_(0.2)
    assert not [w for w in again if "shared clip" in str(w.message)]  # said once, not at every step
