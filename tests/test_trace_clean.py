"""The NaN tracer speaks only of NaN it saw reach a gradient: a traced step that is clean says
"did not recur" (info); a replay neither arms nor feeds the next step's trace; a NaN/inf written on
purpose (an inf sentinel masked by torch.where, a -inf fill) or a fresh allocation's contents is
never named as the origin."""

import math
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.origin.snapshot import rng_state

torch.set_num_threads(1)


def _origin_errors(report):
    return [f for f in report.findings if f.kind == "NONFINITE_ORIGIN" and f.level == "error"]


def test_skorch_replay_recipe_then_a_clean_batch_blames_nothing():
    skorch = pytest.importorskip("skorch")

    class Check(skorch.callbacks.Callback):  # the README's replay recipe, as a skorch callback
        def __init__(self):
            self.monitor, self.reports, self.replays, self.rng = None, [], [], None

        def on_train_begin(self, net, X=None, y=None, **kwargs):
            self.monitor = gh.GradHealth(net.module_, net.optimizer_, skip_nonfinite=True, on_problem="ignore")

        def on_batch_begin(self, net, batch=None, training=None, **kwargs):
            if training:
                self.rng = rng_state()

        def on_grad_computed(self, net, named_parameters, batch=None, training=None, **kwargs):
            report = self.monitor.check()
            self.reports.append(report)
            if not report.grads_finite:
                xb, yb = batch
                self.replays.append(gh.replay_nonfinite(
                    net.module_, lambda: net.get_loss(net.infer(xb), yb, X=xb, training=True).backward(), rng=self.rng,
                    step=report.step))

    class Module(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense0, self.out = nn.Linear(4, 16), nn.Linear(16, 1)

        def forward(self, X):
            return self.out(torch.relu(self.dense0(X)))

    torch.manual_seed(0)
    X, y = torch.randn(64, 4), torch.randn(64, 1)
    X[20, 1] = float("nan")  # batch 1 (of 16 rows each) holds a NaN
    check = Check()
    net = skorch.NeuralNetRegressor(Module, max_epochs=1, batch_size=16, lr=0.05, train_split=None, callbacks=[check],
                                    optimizer=torch.optim.SGD, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthInternalWarning)
        net.fit(X, y)
    r = check.reports
    assert not r[1].grads_finite and r[2].grads_finite and r[3].grads_finite  # the premise
    [replay] = check.replays
    assert replay.data["input_nonfinite"] and replay.data["reproduced"]  # the replay names the batch
    assert all(torch.isfinite(p).all() for p in net.module_.parameters())  # the step guard kept the NaN out
    assert not _origin_errors(r[2]) and not _origin_errors(r[3])  # no clean step is blamed
    [said] = r[1].findings_of("NONFINITE_ORIGIN")  # the monitor named the batch at its own check (a dropped step: a warning)
    assert said.data["input_nonfinite"] and said.level == "warning" and "the batch itself holds NaN/inf" in said.message
    assert not r[2].findings_of("NONFINITE_ORIGIN")  # (named: no tracer armed for the clean step after it)


class _Sentinel(nn.Module):
    """DeepSpeed's pattern: an inf sentinel inside torch.where, reduced away (finite output)."""

    def forward(self, x):
        masked = torch.where(x > 0, x, torch.full_like(x, math.inf))
        return masked


class _Min(nn.Module):
    def forward(self, x):
        return torch.nan_to_num(x, posinf=0.0) + x.clamp(max=1e30).amin(dim=1, keepdim=True) * 0


def test_a_clean_step_with_a_masked_inf_inside_says_did_not_recur():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), _Sentinel(), _Min(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 5), torch.randn(32, 1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    reports = []
    for i in range(3):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        if i == 0:
            loss = loss * torch.tensor(math.nan)  # NaN gradients: the next step is traced
        loss.backward()
        reports.append(mon.check(loss=loss))
        if reports[-1].grads_finite:
            opt.step()
    assert not reports[0].grads_finite and reports[1].grads_finite and math.isfinite(reports[1].loss)
    assert torch.isinf(model[1](model[0](x))).any()  # the premise: the sentinel's inf is in a module's output
    assert not _origin_errors(reports[1])
    [said] = reports[1].findings_of("NONFINITE_ORIGIN")
    assert said.level == "info" and "did not recur" in said.message


def test_the_op_watch_names_the_division_not_the_sentinel_or_the_fill():
    torch.manual_seed(0)
    lin = nn.Linear(5, 8)
    x = torch.randn(16, 5)
    with gh.trace_nonfinite(lin) as t:
        h = lin(x)
        scores = h.masked_fill(h < -0.5, -math.inf).softmax(dim=1)  # a -inf mask: finite probabilities
        floor = torch.where(h > 0, h, torch.full_like(h, math.inf)).amin(dim=1)  # an inf sentinel, reduced away
        count = (h > 100).sum()  # 0: the bug, a mean over an empty selection
        loss = (scores.sum() + floor.clamp(max=1e30).sum() * 0) / count
        loss.backward()
    assert t.outside is not None
    phase, op, _ = t.outside
    assert "div" in op.lower(), t.outside


def test_a_fresh_allocations_contents_are_never_the_origin():
    torch.manual_seed(0)
    lin = nn.Linear(5, 4096)
    x = torch.randn(1, 5)
    with gh.trace_nonfinite(lin) as t:
        h = lin(x)
        poison = torch.full((4096,), math.nan)
        del poison
        buf = torch.empty(4096)  # (the allocator may hand back the NaN just freed)
        buf.copy_(h.detach()[0])
        loss = (h * buf).sum() / (h > 1e9).sum()  # 0/0: the one real birth of a NaN
        loss.backward()
    assert t.outside is not None and "div" in t.outside[1].lower(), t.outside


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16"])
def test_after_deepspeed_skips_a_step_on_inf_the_next_clean_check_blames_nothing(tmp_path, precision):
    pytest.importorskip("deepspeed")
    import json
    import os
    import procs
    import sys
    from pathlib import Path

    from conftest import free_port

    here = Path(__file__).parent
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
    out = tmp_path / "out.json"
    proc = procs.run([sys.executable, str(here / "deepspeed_nan_once.py"), str(out), "1", precision], env=env,
                     capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    case = json.loads(out.read_text())
    # the premise: a finite loss, two steps with inf gradients, and DeepSpeed skipped those two steps
    assert case["finite_loss"] and case["finite"] == [True, True, False, False, True, True, True]
    assert case["skipped_steps"] == 2
    for step in (4, 5, 6):  # clean checks after the skipped steps (the first traced op by op): no origin blamed
        assert not [f for f in case["findings"][step] if f[0] == "NONFINITE_ORIGIN" and f[1] == "error"], case["findings"][step]
    assert [f[1] for f in case["findings"][4] if f[0] == "NONFINITE_ORIGIN"] == ["info"]
