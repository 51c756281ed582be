"""No exception from a hook the monitor owns reaches the user's loop: each hook's failure is said
once (GradHealthInternalWarning) and the run goes on. A failure is injected into the internal
function each hook calls; the loop (a real training loop of a small model) must finish and train."""

import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.check import deferred
from gradhealth.measure import deltas, stale
from gradhealth.judge import guards
from gradhealth.model import params
from gradhealth.origin import trace

torch.set_num_threads(1)


class Injected(RuntimeError):
    pass


def _boom(*args, **kwargs):
    raise Injected("injected failure")


def _model(eval_dropout=False, wide=False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 300 if wide else 3))
    if eval_dropout:
        m[1].eval()  # a module in eval mode during training: the eval-mode hooks run
    return m


# (where, name, what the hook is given, how the loop must run for the hook to fire)
CASES = [
    (deltas.UpdateTracker, "_post", "method", {}),
    (deltas.UpdateTracker, "_pre", "method", {}),
    (guards.ForwardWatch, "_on_model", "method", {}),
    (guards.ForwardWatch, "_before", "method", {}),
    (guards.ForwardWatch, "_on_module", "method", {"eval_dropout": True}),
    (guards.ForwardWatch, "_backward_through", "method", {"eval_dropout": True}),
    (guards.ForwardWatch, "_output_grad", "method", {"batch": 300, "wide": True}),  # an output too large to keep
    (stale.StaleWatch, "_fired", "method", {}),
    (trace.NonFiniteTracer, "_post", "factory", {"nan_at": 1}),
    (trace.NonFiniteTracer, "_grad_hook", "factory", {"nan_at": 1}),
    (params, "_mark_all", "function", {"register_at": 2}),
    (deferred, "_forget_found_inf", "function", {"lag": 1, "fused": True, "skip_nonfinite": True}),
]


@pytest.mark.parametrize("where,name,kind,how", CASES, ids=[f"{getattr(c[0], '__name__', c[0])}.{c[1]}" for c in CASES])
def test_a_failing_hook_never_breaks_the_run(monkeypatch, where, name, kind, how):
    if kind == "factory":  # the method builds the hook: the hook it builds fails
        monkeypatch.setattr(where, name, lambda self, *a, **k: _boom)
    else:
        monkeypatch.setattr(where, name, _boom)
    if name == "_mark_all":  # the process-wide registration hooks: installed afresh by this monitor
        for h in params._HOOKS:
            h.remove()
        monkeypatch.setattr(params, "_HOOKS", [])
    model = _model(how.get("eval_dropout", False), how.get("wide", False))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=how.get("fused", None))
    x, y = torch.randn(how.get("batch", 64), 6), torch.randn(how.get("batch", 64), 300 if how.get("wide") else 3)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a healthy loop stays silent under "raise" whatever hook failed (nothing concluded from what was
        # not measured); the planted NaN, eval-mode module and unused new parameter are real findings
        planted = how.get("nan_at") is not None or how.get("eval_dropout") or how.get("register_at") is not None
        mon = gh.GradHealth(model, opt, on_problem="ignore" if planted else "raise", lag=how.get("lag", 0), change_every=1,
                            skip_nonfinite=how.get("skip_nonfinite", False))
        for i in range(6):
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            if i == how.get("nan_at"):
                loss = loss * torch.tensor(float("nan"))  # NaN gradients: the next step is traced
            if i == how.get("register_at"):
                model[3].register_parameter("scale", nn.Parameter(torch.ones(1)))  # a registration: the global hook runs
            loss.backward()
            mon.check(loss=loss)
            if i != how.get("nan_at"):
                opt.step()
            losses.append(loss.item())
        mon.close()
    said = [w for w in caught if issubclass(w.category, gh.GradHealthInternalWarning) and "injected" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]  # said once, however many times it failed
    assert "training continues" in str(said[0].message)
    finite = [v for v in losses if v == v]
    assert finite[-1] < finite[0]  # the run went on and trained


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_failing_ddp_hooks_never_break_a_two_rank_run(tmp_path):
    import json
    import os

    import procs
    import robust_workers
    from conftest import free_port
    from test_distributed import _fork_server

    _fork_server()  # (the ranks forked from the distributed tests' fork server: torch, gradhealth imported once)
    ctx = procs.spawn(robust_workers.run, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="forkserver")
    if not procs.join(ctx, 180):  # (killed on a hang, a failure, a timeout or Ctrl-C)
        pytest.fail("the ranks did not finish in 180s (a hang)")
    for r in range(2):
        data = json.load(open(os.path.join(str(tmp_path), f"{r}.json")))
        assert "error" not in data, data.get("error")
        assert data["losses"][-1] < data["losses"][0] and all(data["oks"])  # trained, and silent under "raise"
        # each failing hook said once: the comm hook, the DDP module's forward hook, the monitor's forward pre-hook
        assert len(data["said"]) == 3, data["said"]
        assert sorted(s.split(" failed")[0] for s in data["said"]) == [
            "gradhealth: its DDP communication hook", "gradhealth: its DDP forward hook", "gradhealth: its DDP forward pre-hook"]
