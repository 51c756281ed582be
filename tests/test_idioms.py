"""The idioms people copy, in plain loops: disabled grad scalers, zero medians, the step guard with a
module outside the optimizer, two optimizers, accumulation windows, warnings from any caller's
frame, and the report's dating and texts."""

import json
import math
import os
import sys
import textwrap
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradhealth as gh
from gradhealth.origin.snapshot import rng_state
import procs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scalers():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.cuda.amp's is deprecated; a CUDA scaler without CUDA disables itself)
        return {
            "torch.amp disabled": torch.amp.GradScaler(enabled=False),
            "torch.amp cuda disabled": torch.amp.GradScaler("cuda", enabled=False),
            "torch.cuda.amp disabled": torch.cuda.amp.GradScaler(enabled=False),
            "torch.cuda.amp default, no CUDA": torch.cuda.amp.GradScaler(),
            "sharded disabled": ShardedGradScaler(enabled=False),
            "torch.amp cpu enabled": torch.amp.GradScaler("cpu"),
        }


@pytest.mark.parametrize("kind", list(_scalers()))
def test_every_grad_scaler_torch_hands_out_is_accepted(kind):
    scaler = _scalers()[kind]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, scaler=scaler, on_problem="raise")
    assert (mon.scaler is scaler) == scaler.is_enabled()  # a disabled scaler is no scaler
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    losses = []
    for _ in range(10):
        loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        r = mon.check(loss)
        ref = math.sqrt(sum(p.grad.double().norm().item() ** 2 for p in model.parameters())) / scaler.get_scale()
        assert r.ok and r.total_grad_norm == pytest.approx(ref, rel=1e-5)  # unscaled when it scales
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    mon.close()


def test_a_scaler_of_another_kind_is_still_refused_by_name():
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler.*got object"):
        gh.GradHealth(nn.Linear(2, 2), scaler=object())


_special = st.sampled_from([0.0, 5e-324, 1e-310, math.inf, -math.inf, math.nan, 1e308, 1.0, 2.5, 1e-30])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_special, _special, _special), min_size=1, max_size=60), st.integers(3, 10))
def test_no_arithmetic_on_the_history_raises(rows, window):
    h = gh.NormHistory(window=window, warmup=min(2, window), refresh=2)
    for k, (total, a, b) in enumerate(rows):
        for f in h.update(k, total, {"a": a, "b": b}):
            assert f.kind in ("EXPLODING_GRAD", "VANISHING_GRAD") and isinstance(f.message, str)
    h.load_state_dict(h.state_dict())


def test_a_loss_term_switched_on_after_25_zero_steps_never_breaks_the_check():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    reports = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gh.GradHealth(model, opt, on_problem="warn") as mon:
            for step in range(40):
                weight = 0.0 if step < 25 else 1.0  # the term's weight: 0, then switched on
                loss = weight * nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                reports.append(mon.check(loss))
                opt.step()
    assert all(r.total_grad_norm == 0.0 for r in reports[:25])  # the premise: a zero median for 25 checks
    assert not [w for w in caught if issubclass(w.category, gh.GradHealthInternalWarning)]
    assert all(r is not None and r.ok for r in reports[26:])


def test_an_internal_error_is_a_warning_under_every_on_problem():
    class Broken(gh.NormHistory):
        def update(self, *a, **k):
            raise ZeroDivisionError("planted")

    for on_problem in ("raise", "warn", "ignore"):
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = gh.GradHealth(model, opt, on_problem=on_problem, history=Broken())
        model(torch.randn(2, 4)).sum().backward()
        with pytest.warns(gh.GradHealthInternalWarning, match="failed internally.*ZeroDivisionError: planted"):
            assert mon.check() is None
        opt.step()  # and training goes on
        mon.close()


def test_the_step_guard_clears_a_module_outside_every_optimizer():
    torch.manual_seed(0)
    body, head = nn.Linear(4, 8), nn.Linear(8, 1)
    model = nn.Sequential(body, nn.ReLU(), head)
    opt = torch.optim.SGD(body.parameters(), lr=0.05)  # the head is in no optimizer (a mistake named apart)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    reports, losses = [], []
    with gh.GradHealth(model, opt, on_problem="ignore", skip_nonfinite=True) as mon:
        for step in range(12):
            opt.zero_grad()  # clears the body's gradients only
            out = model(x)
            loss = nn.functional.mse_loss(out, y) if step != 3 else (out * torch.tensor(math.nan)).mean()
            loss.backward()
            r = mon.check(loss)
            reports.append(r)
            if step == 3:
                assert head.weight.grad is None and body.weight.grad is None  # every judged gradient dropped
            opt.step()
            losses.append(loss.item())
    skipped = [r.step for r in reports if r.skipped]
    assert skipped == [3]  # only the poisoned step, never the ones after
    [f] = reports[3].findings_of("STEP_SKIPPED")
    assert "2 of them in no optimizer" in f.message and f.level == "warning"
    assert all(math.isfinite(p.detach().sum().item()) for p in model.parameters())
    assert losses[-1] < losses[0] and all(math.isfinite(v) for v in losses[4:])


def _gan():
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return gen, disc, nn.ModuleDict({"gen": gen, "disc": disc})


def _gan_loop(bug, per_optimizer=True, iters=10):
    gen, disc, model = _gan()
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), 1e-3), torch.optim.Adam(disc.parameters(), 1e-3)
    reports = []
    with gh.GradHealth(model, [opt_g, opt_d], on_problem="ignore") as mon:
        for _ in range(iters):
            x, z = torch.randn(16, 4) + 2, torch.randn(16, 4)
            if bug != "missing_zero_grad":  # (then the discriminator's step applies the sum of all past gradients)
                opt_d.zero_grad()
            (nn.functional.softplus(-disc(x)).mean() + nn.functional.softplus(disc(gen(z).detach())).mean()).backward()
            if per_optimizer:
                reports.append(mon.check(optimizer=opt_d))
            opt_d.step()
            opt_g.zero_grad()
            nn.functional.softplus(-disc(gen(z))).mean().backward()
            reports.append(mon.check(optimizer=opt_g if per_optimizer else None))
            if bug in ("none", "missing_zero_grad"):
                opt_g.step()
            elif bug == "wrong_optimizer":
                opt_d.step()
    return reports


@pytest.mark.parametrize("per_optimizer", [True, False])
def test_two_optimizers_healthy_is_silent(per_optimizer):
    assert all(r.ok and not r.findings_of("NOT_STEPPED") for r in _gan_loop("none", per_optimizer))


@pytest.mark.parametrize("bug", ["forgot_step", "wrong_optimizer"])
@pytest.mark.parametrize("per_optimizer", [True, False])
def test_two_optimizers_one_never_stepping_is_named_within_patience(bug, per_optimizer):
    reports = _gan_loop(bug, per_optimizer)
    g_checks = [r for r in reports if r.optimizer_index in (0, None) and "gen.0.weight" in r.status]
    assert not any(r.findings_of("NOT_STEPPED") for r in g_checks[:3])
    for r in g_checks[3:]:
        [f] = r.findings_of("NOT_STEPPED")
        assert f.data["optimizer"] == 0 and f.level == "error" and not r.ok
        assert set(f.params) == {"gen.0.weight", "gen.0.bias", "gen.2.weight", "gen.2.bias"}
    assert g_checks[-1].findings_of("NOT_STEPPED")[0].data["checks"] == len(g_checks) - 1


@pytest.mark.parametrize("per_optimizer", [True, False])
def test_two_optimizers_a_missing_zero_grad_is_still_stale(per_optimizer):
    reports = _gan_loop("missing_zero_grad", per_optimizer, iters=5)
    stale = [k for k, r in enumerate(reports) if r.findings_of("STALE_GRAD")]
    # checked before the discriminator's step: at its second check, the first one with a stale
    # gradient; one check for both: at the check after that step has applied one
    assert stale == ([2, 4, 6, 8] if per_optimizer else [2, 3, 4])
    assert all({"disc.0.weight", "disc.2.bias"} <= set(reports[k].findings_of("STALE_GRAD")[0].params) for k in stale)


def test_accumulation_without_steps_between_checks_is_not_a_missed_step():
    gen, disc, model = _gan()
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), 1e-3), torch.optim.Adam(disc.parameters(), 1e-3)
    with gh.GradHealth(model, [opt_g, opt_d], on_problem="raise") as mon:
        for _ in range(6):
            for _ in range(4):  # four micro-batches, a check after each
                x = torch.randn(8, 4)
                (disc(gen(x)).mean() / 4).backward()
                assert mon.check().ok
            opt_d.step()
            opt_g.step()
            opt_d.zero_grad()
            opt_g.zero_grad()


def test_replay_over_an_accumulation_window_names_the_micro_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    batches[2][0][0, 0] = math.inf  # micro-batch 2's data holds an inf

    def loss_of(x, y):
        return nn.functional.mse_loss(model(x), y)

    with gh.GradHealth(model, opt, on_problem="ignore") as mon:
        window = []
        for x, y in batches:
            window.append(((x, y), rng_state()))
            (loss_of(x, y) / len(batches)).backward()
        report = mon.check()
        assert not report.grads_finite
        grads = [p.grad.clone() for p in model.parameters()]
        finding = gh.replay_nonfinite(model, [lambda b=b: loss_of(*b).backward() for b, _ in window],
                                      rng=[r for _, r in window], labels=[f"batch {k}" for k in range(4)],
                                      step=report.step)
    assert finding.data["reproduced"] is True and finding.data["micro_batch"] == 2
    assert "batch 2, micro-batch 3 of the 4 accumulated into step 0" in finding.message
    assert finding.data["forward_origin"] == "0" and finding.data["input_nonfinite"] is True  # the data's inf
    assert all(torch.equal(g.nan_to_num(), p.grad.nan_to_num()) for g, p in zip(grads, model.parameters()))


def test_replay_window_with_none_reproducing_says_so():
    model = nn.Linear(2, 1)
    runs = [lambda: model(torch.ones(1, 2)).sum().backward()] * 3
    f = gh.replay_nonfinite(model, runs, step=7)
    assert f.data["reproduced"] is False and "none made NaN/inf again" in f.message and "3 micro-batches" in f.message
    with pytest.raises(ValueError, match="3 runs, 2 rng states"):
        gh.replay_nonfinite(model, runs, rng=[None, None])


# ------------------------------------------------------------------ warnings from any frame
_SCRIPT = """
import warnings, torch, gradhealth as gh
warnings.simplefilter("always")
m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
opt = torch.optim.SGD(m[0].parameters(), lr=0.1)
mon = gh.GradHealth(m, opt)
m(torch.randn(3, 2)).sum().backward()
mon.check()
print("TRAINING-GOES-ON")
"""


@pytest.mark.parametrize("how", ["file", "-c", "stdin", "exec"])
def test_a_warning_never_raises_whatever_the_callers_frame(how, tmp_path):
    script = textwrap.dedent(_SCRIPT)
    if how == "file":
        path = tmp_path / "train.py"
        path.write_text(script)
        cmd, stdin = [sys.executable, str(path)], None
    elif how == "-c":
        cmd, stdin = [sys.executable, "-c", script], None
    elif how == "stdin":
        cmd, stdin = [sys.executable, "-"], script
    else:
        cmd, stdin = [sys.executable, "-c", f"exec(compile({script!r}, '<string>', 'exec'))"], None
    res = procs.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "TRAINING-GOES-ON" in res.stdout and "GradHealthWarning" in res.stderr and "NOT_IN_OPTIMIZER" in res.stderr


def test_a_warning_never_raises_in_ipython():
    pytest.importorskip("IPython")
    code = textwrap.dedent(_SCRIPT).replace("\n", "\n")
    res = procs.run([sys.executable, "-m", "IPython", "--quick", "--no-banner", "--colors=NoColor",
                     "--HistoryManager.enabled=False"], input=code + "\nexit()\n", capture_output=True, text=True,
                    timeout=180, cwd=ROOT)
    assert "TRAINING-GOES-ON" in res.stdout, res.stdout + res.stderr
    assert "NOT_IN_OPTIMIZER" in res.stdout + res.stderr and "ImportError" not in res.stdout + res.stderr


def test_a_warnings_filter_that_errors_still_raises_the_warning():
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    mon = gh.GradHealth(m, torch.optim.SGD(m[0].parameters(), lr=0.1))
    m(torch.randn(3, 2)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        with pytest.raises(gh.GradHealthWarning, match="NOT_IN_OPTIMIZER"):
            mon.check()


# ---------------------------------------------------------------------------- state
def test_load_state_dict_refuses_none_where_a_mapping_is_due():
    model = nn.Linear(2, 1)
    mon = gh.GradHealth(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = mon.state_dict()
    for key in ("n", "units"):
        bad = json.loads(json.dumps(state))
        bad["streaks"][key] = None
        with pytest.raises(ValueError, match=rf"state\['streaks'\]\['{key}'\] must be a dict; got NoneType"):
            mon.load_state_dict(bad)


# ---------------------------------------------------------------------------- the report
def test_report_dates_the_first_nan_the_guard_tolerated_and_names_the_line(tmp_path):
    from gradhealth.integrations.tensorboard import TensorBoardSink

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gh.GradHealth(model, opt, on_problem="ignore", skip_nonfinite=True,
                           sinks=[TensorBoardSink(str(tmp_path / "run"))]) as mon:
            for step in range(12):
                opt.zero_grad()
                out = model(x)
                d = torch.zeros(()) if step >= 6 else torch.ones(())  # from step 6 on: 0/0 in the loss
                ratio = (out - out.detach()) / d
                loss = nn.functional.mse_loss(out, y) + ratio.mean()
                loss.backward()
                r = mon.check(loss)
                assert (step >= 6) == (not r.grads_finite)  # the premise: NaN gradients from step 6
                opt.step()
    res = procs.run([sys.executable, "-m", "gradhealth", "report", str(tmp_path), "--format", "json"],
                    capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    [row] = [r for r in json.loads(res.stdout) if r["kind"] == "NON_FINITE_GRAD"]
    assert row["step"] == 6, row  # not the first step the guard stopped tolerating
    assert "step guard skipped" in row["detail"] and "test_idioms.py:" in row["detail"], row["detail"]
    assert "ratio = (out - out.detach()) / d" in row["detail"] or "DivBackward0" in row["detail"], row["detail"]
