"""trace_nonfinite on the three planted origins and a healthy model; hooks gone after the block."""

import torch
from torch import nn

import gradhealth as gh
from test_monitor import hook_state


class Softplus(nn.Module):
    """The seed's log(1 + exp(x)) with torch.where over the overflowing branch."""

    def forward(self, x):
        e = x.exp()
        return torch.where(torch.isinf(e), x, e.log1p())


class MaskAfterDivide(nn.Module):
    def forward(self, x):
        d = torch.ones_like(x)
        d[:, 0] = 0.0
        q = x / d
        return torch.where(d != 0, q, torch.zeros_like(q))


class DivideByZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) / torch.zeros(4)


def model_with(block):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Identity(), block), nn.Linear(4, 1))


def run(model, x):
    with gh.trace_nonfinite(model) as tracer:
        model(x).sum().backward()
    return tracer


def test_where_over_overflow():
    m = model_with(Softplus())
    t = run(m, torch.randn(3, 4) * 1000)
    assert t.forward_origin is None  # the forward is clean
    assert t.backward_origin == "1.1"  # the child, not its Sequential parent
    assert t.backward_op == "ExpBackward0"
    assert t.op_source.endswith("in forward: e = x.exp()") and "test_trace.py:" in t.op_source
    assert "double where" in t.explain()
    assert not torch.isfinite(m[0].weight.grad).all()


def test_mask_after_divide():
    t = run(model_with(MaskAfterDivide()), torch.randn(3, 4))
    assert t.forward_origin is None
    assert t.backward_origin == "1.1"
    assert t.backward_op == "DivBackward0"
    assert t.op_source.endswith("q = x / d")


def test_divide_by_zero_in_forward():
    t = run(model_with(DivideByZero()), torch.randn(3, 4))
    assert t.forward_origin == "1.1"
    assert t.backward_origin == "1.1"  # downstream consumers of the inf are consequences, not origins
    assert t.backward_op == "DivBackward0"


def test_inf_counts_not_only_nan():
    class LogZero(nn.Module):
        def forward(self, x):
            return torch.log(x - x)  # -inf forward, inf gradient

    t = run(model_with(LogZero()), torch.randn(3, 4))
    assert t.forward_origin == "1.1"


def test_healthy_model_has_no_origin():
    t = run(model_with(nn.ReLU()), torch.randn(3, 4))
    assert t.forward_origin is None and t.backward_origin is None
    assert "no module produced" in t.explain()


def test_hooks_exist_only_inside_the_block():
    m = model_with(Softplus())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = hook_state(m, opt)
    with gh.trace_nonfinite(m):
        assert hook_state(m, opt) != before
        m(torch.randn(3, 4)).sum().backward()
    assert hook_state(m, opt) == before


def test_a_nan_in_the_input_batch_names_the_data():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("stem", nn.Linear(4, 8))
    model.add_module("act", nn.ReLU())
    model.add_module("head", nn.Linear(8, 1))
    x = torch.randn(8, 4)
    x[3, 2] = float("nan")  # one bad sample
    with gh.trace_nonfinite(model) as t:
        model(x).square().mean().backward()
    assert t.forward_origin == "stem" and t.input_nonfinite
    text = t.explain()
    assert "the batch itself holds NaN/inf" in text and "isfinite" in text and "dangerous" not in text
    y = torch.randn(8, 4)
    with gh.trace_nonfinite(model) as t2:  # a clean batch through a module that makes inf itself
        (model(y) * torch.tensor(float("inf"))).sum().backward()
    assert not t2.input_nonfinite


def test_the_op_watch_reads_no_view_of_a_buffer_in_backward_and_still_names_the_op_that_made_the_inf():
    """DeepSpeed narrows its reduce buffer (2 GB by default) at every gradient inside backward; the
    armed watch used to read that whole buffer at each narrow. A view (narrow, expand, view...) reads
    values its input holds: it never turns finite inputs into NaN/inf, so it is not recorded, and the
    op that did make the inf is still the one named."""
    import warnings

    from gradhealth.origin.opwatch import OpWatch

    buf = torch.zeros(1 << 16)
    w = nn.Parameter(torch.ones(4))

    def hook(g):  # (a backward hook that writes the gradient into a view of a flat buffer, as ZeRO does)
        buf.narrow(0, 0, 4).copy_(g)

    w.register_hook(hook)
    watch = OpWatch().start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (anomaly mode's own report of the inf)
            torch.sqrt(w - 1).sum().backward()  # sqrt'(0) = 1 / (2 * 0): an inf born in backward
    finally:
        watch.stop()
    assert torch.isinf(buf[:4]).all()  # the premise: the hook ran on the inf gradient, through a view
    ops = [op for _, phase, op, _ in watch.records if phase == "backward"]
    assert "aten.copy_.default" in ops and not any("narrow" in op or "expand" in op for op in ops), ops
    assert watch.resolve()[:2] == ("backward", "aten.div.Tensor")


def test_the_line_named_is_the_users_never_a_frame_of_the_monitors_own():
    """``source_of`` names the innermost frame of a recorded stack that is not torch's, the standard
    library's or the monitor's own (the tracer, the op watch, the replay, the facade ``GradHealth``), wherever
    the grouping of ``gradhealth/`` put those files: a replay run from inside ``check()`` names the model's
    line, and a stack whose innermost frame is the facade's names the user's call below it."""
    import os
    import types

    import gradhealth.monitor
    import gradhealth.origin.replay
    from gradhealth.origin.opwatch import source_of

    user = os.path.abspath(__file__)

    def named(frames):
        tb = "".join(f'  File "{p}", line {n}, in {f}\n    {c}\n' for p, n, f, c in frames)
        return source_of(types.SimpleNamespace(metadata={"traceback_": tb}))

    train = (user, 10, "train", "monitor.check()")
    facade = (os.path.abspath(gradhealth.monitor.__file__), 300, "check", "report = self._build(step, loss, optimizer)")
    replay = (os.path.abspath(gradhealth.origin.replay.__file__), 50, "replay", "model(*args)")
    forward = (user, 20, "forward", "y = x / n")
    assert named([train, facade, replay, forward]) == f"{user}:20 in forward: y = x / n"
    assert named([train, facade]) == f"{user}:10 in train: monitor.check()"
    assert named([train, replay]) == f"{user}:10 in train: monitor.check()"
