"""Leave it on: healthy runs stay silent under on_problem="raise", real non-updates are still
caught, update norms are exact to the rounding of θ, and caches follow the model."""

import gc
import math
import resource
import tracemalloc
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh


pytestmark = pytest.mark.usefixtures("one_thread")


def run(model, opt, batches, loss_fn, sched=None, **kw):
    mon = gh.GradHealth(model, opt, on_problem="raise", **kw)
    reports = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        reports.append(mon.check(loss=loss))
        opt.step()
        if sched is not None:
            sched.step()
    mon.close()  # the last step's findings too (a raise here would fail the test)
    return reports


# ------------------------------------------------------------------------ healthy, silent
def test_lightning_demo_transformer_embedding_with_plain_sgd():
    """Few tokens per batch: the embedding's update touches a few rows; none of them may be
    reported NOT_UPDATED (the old sampled test missed them)."""
    from lightning.pytorch.demos import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab_size=500, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 500, (2, 6), generator=g), torch.randint(0, 500, (2, 6), generator=g)) for _ in range(30)]

    def loss_fn(m, b):
        out = m(b[0], b[1])
        return nn.functional.nll_loss(out, b[1].reshape(-1))

    reports = run(model, opt, batches, loss_fn, update_every=5)
    assert all(r.ok for r in reports)
    assert reports[-1].status["embedding.weight"] is gh.Status.OK
    measured = [r for r in reports if "embedding.weight" in r.update_norm]
    assert measured and all(r.update_norm["embedding.weight"] > 0 for r in measured)


def tanh_stack():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(20) for m in (nn.Linear(32, 32), nn.Tanh())])


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=1e-2),
                                      lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)])
@pytest.mark.slow  # (2000 checks: 53-68 s on busy cores)
def test_deep_tanh_stack_for_2000_steps(make_opt):
    model = tanh_stack()
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    reports = run(model, opt, [(x, y)] * 2000, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    assert len(reports) == 2000 and all(r.ok for r in reports)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "lambda"])
def test_warmup_schedules_that_start_at_lr_zero(schedule):
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = {"linear": lambda: get_linear_schedule_with_warmup(opt, 5, 40),
             "cosine": lambda: get_cosine_schedule_with_warmup(opt, 5, 40),
             "lambda": lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 5))}[schedule]()
    assert opt.param_groups[0]["lr"] == 0.0
    batches = [(torch.randn(8, 8), torch.randn(8, 2)) for _ in range(20)]
    reports = run(model, opt, batches, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), sched)
    [note] = reports[0].findings_of("NOT_UPDATED")
    assert note.level == "info" and "warmup" in note.message
    assert all(r.ok for r in reports)


def test_warmup_from_zero_in_lightning_under_raise():
    import lightning.pytorch as pl

    from gradhealth.integrations.lightning import GradHealthCallback
    from gradhealth.demos.lightning_parts import DemoModule, SyntheticData

    class Warm(DemoModule):
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    cb = GradHealthCallback(on_problem="raise")
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(Warm(), SyntheticData(n_batches=8))
    assert trainer.global_step == 12 and cb.last_report is not None and cb.last_report.ok


@pytest.mark.parametrize("convert", ["half", "double", "one_layer_double", "bfloat16"])
def test_caches_follow_dtype_conversions_mid_run(convert):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="raise", update_every=1)
    dtype = torch.float32

    def step():
        nonlocal dtype
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        x = torch.randn(16, 8, dtype=model[0].weight.dtype)
        out = model(x)
        nn.functional.mse_loss(out.float(), torch.ones(16, 2)).backward()
        r = mon.check()
        opt.step()
        mon.flush()
        return r, before

    for _ in range(3):
        step()
    if convert == "one_layer_double":
        model[2].double()
        model[2].register_forward_pre_hook(lambda m, a: (a[0].double(),))
        model[4].register_forward_pre_hook(lambda m, a: (a[0].float(),))
    else:
        getattr(model, convert)()
    for _ in range(4):
        r, before = step()
        assert r.ok, str(r)
        for n, p in model.named_parameters():
            exact = torch.linalg.vector_norm((p.detach() - before[n]).double()).item()
            # the rule's update against what the (rounded) weights really moved: within half an
            # ulp of θ per element (the documented bound), and 1e-5 for float32 accumulation
            bits = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}[p.dtype]
            theta = p.detach().double().abs().clamp_min(1e-300)
            half_ulp = torch.linalg.vector_norm(torch.exp2(torch.floor(torch.log2(theta)) - bits) / 2).item()
            assert abs(r.update_norm[n] - exact) <= half_ulp + 1e-5 * exact, (convert, n, p.dtype)
    assert model[2].weight.dtype == (torch.float64 if convert in ("double", "one_layer_double") else model[2].weight.dtype)


# ------------------------------------------------------------------------ still caught
class Idle(torch.optim.Optimizer):  # touches every parameter, changes none
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p.mul_(1.0)


def test_a_step_that_changes_nothing_although_versions_move():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = Idle(model.parameters())
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    seen = []
    for _ in range(4):
        opt.zero_grad()
        v0 = model[0].weight._version
        model(torch.randn(8, 64)).square().mean().backward()
        seen.append(mon.check())
        opt.step()
        assert model[0].weight._version > v0
    mon.flush()
    errors = [f for r in seen for f in r.findings_of("NOT_UPDATED") if f.level == "error"]
    assert errors and errors[0].step <= 3 and set(errors[0].params) == {n for n, _ in model.named_parameters()}
    assert "changed no parameter for 3 steps in a row" in errors[0].message


def test_a_deep_model_whose_step_changes_nothing_is_caught_once_every_window_was_decided():
    """400 tensors: the change test decides one window of 64 of them at a time, in turns. An update
    rule that changes nothing is an error once the streak of unchanged steps has decided them all."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)])
    opt = Idle(model.parameters())
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    seen = []
    for _ in range(12):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        seen.append(mon.check())
        opt.step()
    mon.flush()
    errors = [f for r in seen for f in r.findings_of("NOT_UPDATED") if f.level == "error"]
    assert errors and errors[0].step <= 8, [(f.step, f.level) for r in seen for f in r.findings_of("NOT_UPDATED")]
    assert "changed no parameter for" in errors[0].message


def test_a_deep_tanh_stack_whose_first_windows_vanish_is_not_a_stopped_update_rule():
    """200 tanh layers and SGD: the first layers' updates fall below the precision of their weights
    (unchanged), the last ones move at every step. Tests in turns decide the vanishing windows
    three steps in a row: info (their updates are below the weights' precision), never the error
    "changed no parameter" (before: an error at step 19)."""
    from test_underflow import textbook_mlp

    torch.manual_seed(0)
    net = textbook_mlp(nn.Tanh, 200)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    mon = gh.GradHealth(net, opt, on_problem="ignore")
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g)
    findings = []
    for _ in range(30):
        idx = torch.randint(0, 512, (64,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        findings += mon.check().findings_of("NOT_UPDATED")
        before = [p.detach().clone() for p in net.parameters()]
        opt.step()
        assert sum(not torch.equal(a, p) for a, p in zip(before, net.parameters())) >= 20  # premise: it moves
    mon.close()
    assert any(f.level == "info" for f in findings)  # (premise: whole windows were unchanged at tests)
    assert not [f for f in findings if f.level == "error"], [(f.step, f.message[-120:]) for f in findings if f.level == "error"]


@pytest.mark.parametrize("change_every", [1, 4])
def test_updates_below_the_precision_of_bf16_weights(change_every):
    """The change test runs every ``change_every`` steps, then at every step after one that changed
    nothing: the error comes within ``change_every - 1`` steps plus the 3 in a row."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16).bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    mon = gh.GradHealth(model, opt, on_problem="ignore", change_every=change_every)
    reports = []
    for _ in range(change_every + 4):
        opt.zero_grad()
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean().backward()
        reports.append(mon.check())
        opt.step()
    mon.flush()
    found = [f for r in reports for f in r.findings_of("NOT_UPDATED") if f.level == "error"]
    assert found and found[0].step <= change_every + 3 and "precision of the weights" in found[0].message


def test_fused_optimizers_move_no_version_counter_and_are_still_judged_exactly():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    v0 = model.weight._version
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert model.weight._version == v0  # the reason versions are not trusted for fused kernels
    mon = gh.GradHealth(model, opt, on_problem="raise")
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        assert mon.check().ok
        opt.step()
    mon.close()


# ------------------------------------------------- the change test runs every few steps
def _switch_run(breaks_at: int, steps: int, make_broken):
    """SGD that changes nothing from step ``breaks_at`` on; the steps at which NOT_UPDATED is an error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    reports, x, y = [], torch.randn(16, 32), torch.randn(16, 4)
    for s in range(steps):
        if s == breaks_at:
            make_broken(opt)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        reports.append(mon.check())
        opt.step()
    mon.close()
    errors = sorted({f.step for r in reports for f in r.findings_of("NOT_UPDATED") if f.level == "error"})
    return errors, mon.options.change_every


def test_an_update_rule_that_stops_working_between_change_tests_is_an_error_within_a_few_steps():
    """The change test runs at every 8th step, then at every step after one that changed nothing:
    a rule broken at step 9 (between tests) is an error within change_every + 2 steps."""
    def idle(opt):  # every step still touches every parameter (versions move), changing none
        def step(closure=None):
            with torch.no_grad():
                for p in opt.param_groups[0]["params"]:
                    p.mul_(1.0)
        opt.step = step

    errors, every = _switch_run(9, 24, idle)
    assert every == 8 and errors and errors[0] >= 9 and errors[0] <= 9 + every + 2, errors


def test_a_learning_rate_set_to_zero_between_change_tests_is_an_error_at_the_next_step():
    """lr 0 is read at every step, not only at change tests: 0 at step 6 (info) and 7 (error)."""
    def zero(opt):
        opt.param_groups[0]["lr"] = 0.0

    errors, every = _switch_run(6, 9, zero)
    assert 6 % every and 7 % every and errors[0] == 7, errors


# ------------------------------------------------------------ update norms, every tensor
@pytest.mark.parametrize("blocks, width", [(100, 64), (4, 512), (2, 2048)])  # the bench's tensor shapes
@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_update_norm_error_on_the_bench_shapes(blocks, width, name):
    from gradhealth.benchmarks.core import OPTIMIZERS, build_model

    torch.manual_seed(0)
    model = build_model(blocks, width)
    opt = OPTIMIZERS[name](model.parameters())
    mon = gh.GradHealth(model, opt, on_problem="ignore", update_every=1, history=False)
    x = torch.randn(8, width)
    worst = 0.0
    for _ in range(2):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), torch.randn_like(x)).backward()
        r = mon.check()
        opt.step()
        mon.flush()
        for (n, p), b in zip(model.named_parameters(), before):
            exact = torch.linalg.vector_norm((p.detach() - b).double()).item()
            if exact > 0:
                worst = max(worst, abs(r.update_norm[n] - exact) / exact)
    assert worst < 0.01, worst  # the bound is 5% on every tensor; the rule is far inside it


# ------------------------------------------------------------------------------ memory
@pytest.mark.slow
def test_thousands_of_checks_leave_memory_flat():
    """Memory per check, as a slope: after 1,000 checks (every window and table filled) and 200 more
    traced (tracemalloc's own start-up), 2,500 more checks may hold on to less than 22 bytes a check
    (the sensitivity 6,000 checks against a flat 128 KiB had, at less than half the traced checks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    mon = gh.GradHealth(model, opt, on_problem="warn", update_every=10)
    g = torch.Generator().manual_seed(0)

    def steps(n):
        with warnings.catch_warnings():
            warnings.simplefilter("error", gh.GradHealthWarning)  # a healthy run says nothing
            for _ in range(n):
                x = torch.randn(32, 8, generator=g)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), x[:, :2].sin()).backward()
                mon.check()
                opt.step()

    steps(1000)
    gc.collect()
    tracemalloc.start()
    steps(200)
    gc.collect()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    snap0 = tracemalloc.take_snapshot()
    steps(2500)
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap0, "filename"))
    tracemalloc.stop()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert grown < 2500 * 22, grown  # bytes still held after 2,500 more checks (a leak of 22 bytes a check shows)
    assert (rss1 - rss0) < 32 * 1024, (rss0, rss1)  # KiB of peak RSS
    assert math.isfinite(mon.last_report.total_grad_norm)
