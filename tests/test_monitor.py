"""GradHealth: policy, every_n_steps, sinks, expect_frozen, close(), option validation."""

import logging
import math
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh
from conftest import naive_classify


class ListSink:
    def __init__(self):
        self.reports = []
        self.closed = False
        self.flushed = False

    def write(self, report):
        self.reports.append(report)

    def flush(self):
        self.flushed = True

    def close(self):
        self.closed = True


def train_step(model, opt, monitor, x=None, **kw):
    opt.zero_grad()
    x = torch.randn(4, 8) if x is None else x
    loss = model(x).square().mean()
    loss.backward()
    report = monitor.check(loss=loss, **kw)
    opt.step()
    return report


def test_healthy_run_emits_nothing(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gh.GradHealth(mlp, opt) as mon:
            for _ in range(5):
                r = train_step(mlp, opt, mon)
                assert r.ok and not r.problems and not r.findings
    assert r.step == 4


def test_warn_names_params_grouped_by_module_step_and_fix(mlp):
    opt = torch.optim.SGD(mlp.encoder.parameters(), lr=0.01)
    mon = gh.GradHealth(mlp, opt)
    with pytest.warns(gh.GradHealthWarning) as rec:
        train_step(mlp, opt, mon)
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "step 0" in msg
    assert "head.* (2 params)" in msg and "NOT_IN_OPTIMIZER" in msg
    assert "add_param_group" in msg  # what to do


def test_raise_after_every_sink_got_the_report(mlp):
    opt = torch.optim.SGD(mlp.encoder.parameters(), lr=0.01)
    sinks = [ListSink(), ListSink()]
    mon = gh.GradHealth(mlp, opt, on_problem="raise", sinks=sinks)
    with pytest.raises(gh.GradHealthError, match="NOT_IN_OPTIMIZER") as err:
        train_step(mlp, opt, mon)
    assert all(len(s.reports) == 1 for s in sinks)
    assert err.value.report is sinks[0].reports[0]
    assert err.value.report.problems == {"head.weight": gh.Status.NOT_IN_OPTIMIZER, "head.bias": gh.Status.NOT_IN_OPTIMIZER}


def test_ignore_is_silent_but_reports(mlp):
    opt = torch.optim.SGD(mlp.encoder.parameters(), lr=0.01)
    mon = gh.GradHealth(mlp, opt, on_problem="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = train_step(mlp, opt, mon)
    assert not r.ok and set(r.problems) == {"head.weight", "head.bias"}


def test_every_n_steps(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    sink = ListSink()
    mon = gh.GradHealth(mlp, opt, every_n_steps=3, sinks=[sink])
    results = [train_step(mlp, opt, mon) for _ in range(7)]
    assert [r is not None for r in results] == [True, False, False, True, False, False, True]
    assert [r.step for r in sink.reports] == [0, 3, 6]


def test_explicit_step(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    mon = gh.GradHealth(mlp, opt, every_n_steps=10)
    assert train_step(mlp, opt, mon, step=20).step == 20
    assert train_step(mlp, opt, mon, step=21) is None


def test_status_matches_oracle_through_training(mlp):
    opt = torch.optim.SGD(list(mlp.encoder.parameters()), lr=0.01)
    mlp.encoder[0].bias.requires_grad_(False)
    mon = gh.GradHealth(mlp, opt, on_problem="ignore")
    for _ in range(3):
        r = train_step(mlp, opt, mon)
        assert r.status == naive_classify(mlp, opt)


def test_frozen_summary_logged_once(caplog, mlp):
    mlp.encoder[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in mlp.parameters() if p.requires_grad], lr=0.01)
    mon = gh.GradHealth(mlp, opt)
    with caplog.at_level(logging.INFO, logger="gradhealth"):
        train_step(mlp, opt, mon)
        train_step(mlp, opt, mon)
    lines = [r.getMessage() for r in caplog.records if "frozen" in r.getMessage()]
    assert lines == ["encoder.0.* (2 params) frozen; 4 of 6 trainable: encoder.2.* (2 params), head.* (2 params)"]


def test_expect_frozen(mlp):
    mlp.encoder[0].requires_grad_(False)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    ok = gh.GradHealth(mlp, opt, expect_frozen=["encoder.0.*"], on_problem="ignore")
    r = train_step(mlp, opt, ok)
    assert r.ok and not r.findings

    wrong = gh.GradHealth(mlp, opt, expect_frozen="head.*", on_problem="ignore")
    r = train_step(mlp, opt, wrong)
    assert not r.ok
    unexpected_frozen = r.findings_of("UNEXPECTED_FROZEN")[0]
    assert unexpected_frozen.params == ("encoder.0.weight", "encoder.0.bias")
    assert "encoder.0.* (2 params)" in unexpected_frozen.message
    assert r.findings_of("UNEXPECTED_TRAINABLE")[0].params == ("head.weight", "head.bias")


def test_loss_judged_in_same_check(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    mon = gh.GradHealth(mlp, opt, on_problem="ignore")
    loss = mlp(torch.randn(2, 8)).sum()
    loss.backward()
    r = mon.check(loss=loss)
    assert r.loss == pytest.approx(loss.item())
    r = mon.check(loss=torch.tensor(float("nan")))
    assert [f.kind for f in r.findings] == ["GRAD_MODE", "NON_FINITE_LOSS"]  # a detached nan loss: both said
    nan_loss = mlp(torch.full((2, 8), float("nan"))).sum()
    r = mon.check(loss=nan_loss)
    assert [f.kind for f in r.findings] == ["NON_FINITE_LOSS"] and math.isnan(r.loss)


def test_broken_sink_never_crashes_training(mlp):
    class Broken:
        def write(self, report):
            raise OSError("disk full")

    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    good = ListSink()
    mon = gh.GradHealth(mlp, opt, sinks=[Broken(), good])
    with pytest.warns(gh.GradHealthInternalWarning, match="disk full"):
        train_step(mlp, opt, mon)
    train_step(mlp, opt, mon)  # warned once only
    assert len(good.reports) == 2


def test_internal_failure_is_a_warning_even_under_raise(mlp, monkeypatch):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    for on_problem in ("warn", "raise"):  # raise is for the model's problems, never the monitor's own
        mon = gh.GradHealth(mlp, opt, on_problem=on_problem)
        monkeypatch.setattr(mon, "_build", lambda *a: 1 / 0)
        with pytest.warns(gh.GradHealthInternalWarning, match="ZeroDivisionError"):
            assert train_step(mlp, opt, mon) is None
        mon.close()
    strict = gh.GradHealth(mlp, opt, on_problem="raise")

    def verdict(*a):
        raise gh.GradHealthError("a verdict")

    monkeypatch.setattr(strict, "_build", verdict)
    with pytest.raises(gh.GradHealthError, match="a verdict"):  # gradhealth's own errors still propagate
        train_step(mlp, opt, strict)


def hook_state(model, opt):
    mods = [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._backward_pre_hooks),
         len(getattr(m, "_state_dict_hooks", {})), len(getattr(m, "_load_state_dict_pre_hooks", {})))
        for m in model.modules()
    ]
    params = [len(getattr(p, "_backward_hooks", None) or {}) for p in model.parameters()]
    post_acc = [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()]
    optim = (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks),
             len(getattr(opt, "_optimizer_state_dict_pre_hooks", {})), len(getattr(opt, "_optimizer_state_dict_post_hooks", {})),
             len(getattr(opt, "_optimizer_load_state_dict_pre_hooks", {})), len(getattr(opt, "_optimizer_load_state_dict_post_hooks", {})))
    import torch.optim.optimizer as optim_mod

    globals_ = (len(optim_mod._global_optimizer_pre_hooks), len(optim_mod._global_optimizer_post_hooks),
                len(torch.nn.modules.module._global_forward_pre_hooks), len(torch.nn.modules.module._global_forward_hooks))
    return mods, params, post_acc, optim, globals_


def test_close_leaves_every_hook_dict_as_found(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    before = hook_state(mlp, opt)
    sink = ListSink()
    with gh.GradHealth(mlp, opt, sinks=[sink]) as mon:
        for _ in range(3):
            train_step(mlp, opt, mon)
    assert hook_state(mlp, opt) == before
    assert sink.flushed and sink.closed
    mon.close()  # idempotent


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        ({"on_problem": "wran"}, ValueError, "on_problem must be one of 'warn', 'raise', 'ignore'; got 'wran'"),
        ({"every_n_steps": 0}, ValueError, "every_n_steps must be a positive int; got 0"),
        ({"every_n_steps": 2.5}, ValueError, "every_n_steps must be a positive int; got 2.5"),
        ({"sinks": [object()]}, TypeError, r"sinks\[0\] must have a write\(report\) method"),
        ({"expect_frozen": [3]}, TypeError, "expect_frozen must be a name pattern"),
    ],
)
def test_options_validated_where_given(mlp, kw, exc, words):
    with pytest.raises(exc, match=words):
        gh.GradHealth(mlp, **kw)


def test_logging_sink(caplog, mlp):
    opt = torch.optim.SGD(mlp.encoder.parameters(), lr=0.01)
    mon = gh.GradHealth(mlp, opt, sinks=[gh.LoggingSink()], on_problem="ignore")
    with caplog.at_level(logging.INFO, logger="gradhealth"):
        train_step(mlp, opt, mon)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "NOT_IN_OPTIMIZER" in warned[0].getMessage()


def test_state_dict_round_trip(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    mon = gh.GradHealth(mlp, opt, every_n_steps=2)
    for _ in range(3):
        train_step(mlp, opt, mon)
    state = mon.state_dict()
    fresh = gh.GradHealth(mlp, opt, every_n_steps=2)
    fresh.load_state_dict(torch.load(_save(state), weights_only=True))
    assert fresh.state_dict() == state
    assert train_step(mlp, opt, fresh) is None  # the 4th call (step 3) is skipped, as it would have been
    assert train_step(mlp, opt, fresh).step == 4


def _save(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_the_usual_check_launches_three_torch_ops(one_thread):
    """The check between change tests: one fused norm, the loss detached, one stack of the norms with
    the loss, read back at once (the one number a user logs instead launches nine)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[str(func)] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(8, 32), torch.randn(8, 1)
    counts = []
    with gh.GradHealth(model, opt, on_problem="raise") as mon:
        for k in range(68):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            with Ops() as ops:
                mon.check(loss=loss)
            counts.append(dict(ops.seen))
            opt.step()
    # checks 66 and 67: past the first checks' dense update norms (0, 1, 2, 4, ... 32), the step before
    # was a light one (nothing to read), the step after is light too; a measured one reads its updates too
    assert counts[4] != counts[3] and "aten._foreach_norm.Scalar" in counts[4]
    for seen in counts[66:]:
        assert seen == {"aten._foreach_norm.Scalar": 1, "aten.detach.default": 1, "aten.stack.default": 1}
