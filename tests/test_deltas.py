"""Parameter updates through the optimizer's step hooks: values, timing, memory, NOT_UPDATED,
FROZEN_BUT_CHANGED and skipped steps."""


import math

import pytest
import torch
from torch import nn

import gradhealth as gh
from conftest import MLP


class UpdateSink:
    def __init__(self):
        self.written, self.updated = [], []

    def write(self, report):
        self.written.append(report)

    def write_update(self, report):
        self.updated.append(report)


def step(model, opt, mon, x, y=None):
    opt.zero_grad()
    loss = (model(x) - (0 if y is None else y)).square().mean()
    loss.backward()
    r = mon.check()
    opt.step()
    return r


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=1e-2),
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
])
def test_exact_mode_matches_a_copy_taken_by_the_test(make_opt):
    torch.manual_seed(0)
    model = MLP()
    opt = make_opt(model.parameters())
    sink = UpdateSink()
    mon = gh.GradHealth(model, opt, deltas="exact", sinks=[sink], on_problem="ignore")
    x = torch.randn(16, 8)
    for k in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        r = step(model, opt, mon, x)
        assert r.update_norm == {}  # not yet: the step had not run when the check returned
        mon.flush()
        for n, p in model.named_parameters():
            ref = torch.linalg.vector_norm((p.detach() - before[n]).double()).item()
            assert r.update_norm[n] == pytest.approx(ref, rel=1e-6)
            assert r.update_ratio[n] == pytest.approx(ref / torch.linalg.vector_norm(before[n].double()).item(), rel=1e-6)
        assert sink.updated[-1] is r and sink.written[-1] is r


def test_updates_arrive_with_the_next_check():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sink = UpdateSink()
    mon = gh.GradHealth(model, opt, deltas="exact", sinks=[sink])
    x = torch.randn(16, 8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    r0 = step(model, opt, mon, x)
    delta = {n: (p.detach() - before[n]).norm().item() for n, p in model.named_parameters()}
    assert sink.updated == []
    r1 = step(model, opt, mon, x)
    assert sink.updated == [r0] and r1.update_norm == {}
    assert r0.update_norm == pytest.approx(delta, rel=1e-5)
    mon.close()  # the last step is fetched at close
    assert sink.updated == [r0, r1] and r1.update_norm


RULES = [
    ("SGD", lambda p: torch.optim.SGD(p, lr=0.05)),
    ("SGD wd", lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=0.1)),
    ("SGD momentum", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)),
    ("SGD nesterov", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD maximize", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.1, maximize=True)),
    ("Adam", lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01)),
    ("Adam amsgrad", lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True)),
    ("AdamW", lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1)),
    ("AdamW foreach", lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=True)),
    ("AdamW fused", lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, fused=True)),
    ("Adam single-tensor", lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False)),
    ("RMSprop (generic)", lambda p: torch.optim.RMSprop(p, lr=1e-3)),
]


@pytest.mark.parametrize("name, make_opt", RULES)
def test_default_update_norms_match_an_exact_copy_on_every_tensor(name, make_opt):
    """deltas="auto": ||Δθ|| from the optimizer's rule (or, for others, exact copies in turns)
    against a copy taken by the test: every tensor, every measured step."""
    _updates_against_copies(name, make_opt)  # (every tensor measured at some step)


def _updates_against_copies(name, make_opt) -> None:
    """Four measured steps of a small model: every reported ||Δθ|| (and ratio) against a copy taken
    here, and every tensor measured at some step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64), nn.Linear(64, 16))
    opt = make_opt(model.parameters())
    mon = gh.GradHealth(model, opt, on_problem="ignore", update_every=1)
    x, y = torch.randn(32, 64), torch.randn(32, 16)
    seen = set()
    for _ in range(4):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        r = step(model, opt, mon, x, y)
        mon.flush()
        assert not r.findings, [str(f) for f in r.findings]
        for n, p in model.named_parameters():
            if n not in r.update_norm:
                continue  # a generic optimizer: this tensor's turn is another step
            seen.add(n)
            ref = torch.linalg.vector_norm((p.detach() - before[n]).double()).item()
            assert r.update_norm[n] == pytest.approx(ref, rel=1e-4), (name, n)
            ratio = ref / torch.linalg.vector_norm(p.detach().double()).item()
            assert r.update_ratio[n] == pytest.approx(ratio, rel=1e-4), (name, n)
    assert seen == {n for n, _ in model.named_parameters()}


def test_update_norms_every_n_checks_and_the_memory_bound():
    model = nn.Sequential(nn.Linear(512, 512), nn.LayerNorm(512), nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gh.GradHealth(model, opt, on_problem="ignore", update_every=3)
    total = sum(p.numel() for p in model.parameters())
    assert mon.tracker.extra_elements() <= max(0.02 * total, (1 << 18) + 0.01 * total)
    x = torch.randn(8, 512)
    reports = [step(model, opt, mon, x) for _ in range(7)]
    mon.flush()
    # checks 0 and 1 (the dense start: 0, 1, 2, 4, ... up to half update_every), then every 3rd
    assert [bool(r.update_norm) for r in reports] == [True, True, False, True, False, False, True]


def test_a_short_run_with_the_default_cadence_has_update_norms_at_its_first_checks():
    """update_every=100 (the default): a 10-step run's update norms at checks 0, 1, 2, 4 and 8, each
    the step's real ||Δθ|| (SGD: lr * ||g||, measured against the parameters before and after)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    reports, moved, losses = [], [], []
    for _ in range(10):
        x = torch.randn(32, 8)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        losses.append(loss.item())
        before = model[0].weight.detach().clone()
        reports.append(mon.check(loss=loss))
        opt.step()
        moved.append((model[0].weight.detach() - before).norm().item())
    mon.close()
    assert losses[-1] < losses[0]  # a healthy control: it trains
    measured = [k for k, r in enumerate(reports) if r.update_norm]
    assert measured == [0, 1, 2, 4, 8] and len(measured) >= 4
    for k in measured:
        assert reports[k].update_norm["0.weight"] == pytest.approx(moved[k], rel=1e-4)


def test_not_updated_with_lr_zero(mlp):
    """lr 0 in every group from the first step: a warm-up from 0 may take two steps (DeepSpeed's
    log warm-up does); at the third nothing has trained: an error."""
    opt = torch.optim.SGD(mlp.parameters(), lr=0.0)
    mon = gh.GradHealth(mlp, opt, on_problem="ignore")
    x = torch.randn(4, 8)
    r0, r1, r2, r3 = (step(mlp, opt, mon, x) for _ in range(4))
    mon.flush()
    everything = {n for n, _ in mlp.named_parameters()}
    [first] = r0.findings_of("NOT_UPDATED")  # lr 0 at the first step: a warmup may start there
    assert first.level == "info" and set(first.params) == everything and "warmup" in first.message
    assert r0.ok and r1.ok
    [again] = [f for f in r2.findings_of("NOT_UPDATED") if f.step == 2]  # still 0 at the third step: an error
    assert again.level == "error" and again.step == 2 and set(again.params) == everything
    assert "0 since the first step, past any warm-up, and nothing else trains" in again.message and not r2.ok
    assert r3.findings_of("NOT_UPDATED")[0].level == "error"


def test_not_updated_with_a_skipped_step(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    mon = gh.GradHealth(mlp, opt, on_problem="ignore")
    x = torch.randn(4, 8)
    step(mlp, opt, mon, x)
    r1 = step(mlp, opt, mon, x)
    assert not r1.findings
    # step 2: backward and check, but optimizer.step() is skipped; the next iteration zeroes
    opt.zero_grad()
    mlp(x).square().mean().backward()
    r2 = mon.check()
    r3 = step(mlp, opt, mon, x)
    f = r3.findings_of("NOT_UPDATED")
    assert f and f[0].step == 2 and "no optimizer.step() ran" in f[0].message
    assert r2.findings_of("NOT_UPDATED") == f  # also written into the step's own report


def test_accumulation_is_not_a_skipped_step(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
    mon = gh.GradHealth(mlp, opt, on_problem="ignore")
    for _ in range(3):
        opt.zero_grad()
        for micro in range(4):
            mlp(torch.randn(4, 8)).square().mean().backward()
            r = mon.check()
            assert not r.findings, [f.kind for f in r.findings]
        opt.step()


def test_frozen_but_changed_with_adamw_weight_decay(mlp):
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-2, weight_decay=0.1)
    mon = gh.GradHealth(mlp, opt, on_problem="ignore", update_every=1)
    x = torch.randn(4, 8)
    step(mlp, opt, mon, x)
    mlp.encoder[0].requires_grad_(False)  # frozen for fine-tuning, but left in the optimizer
    for _ in range(2):
        opt.zero_grad(set_to_none=False)  # its zero-filled grad keeps AdamW stepping it
        mlp(x).square().mean().backward()
        r = mon.check()
        opt.step()
    mon.flush()
    assert r.status["encoder.0.weight"] is gh.Status.FROZEN
    f = r.findings_of("FROZEN_BUT_CHANGED")
    assert f and f[0].params == ("encoder.0.weight", "encoder.0.bias")
    assert "weight decay or momentum" in f[0].message
    assert r.update_norm["encoder.0.weight"] > 0


def test_frozen_in_sgd_with_grad_and_momentum(mlp):
    opt = torch.optim.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    mon = gh.GradHealth(mlp, opt, on_problem="ignore")
    x = torch.randn(4, 8)
    step(mlp, opt, mon, x)
    mlp.head.bias.requires_grad_(False)  # frozen mid-run: momentum keeps moving it
    opt.zero_grad(set_to_none=False)
    mlp(x).square().mean().backward()
    r = mon.check()
    opt.step()
    mon.flush()
    assert r.status["head.bias"] is gh.Status.FROZEN
    assert r.findings_of("FROZEN_BUT_CHANGED")[0].params == ("head.bias",)


def test_memory_budget_on_the_three_bench_shapes():
    """Samples within 1% of the parameters; the rule's temporaries within 1% (at least 1 MiB)."""
    from gradhealth.benchmarks.core import build_model
    from gradhealth.model.params import named_parameters
    from gradhealth.measure.deltas import UpdateTracker

    for blocks, width in [(100, 64), (100, 512), (20, 2048)]:
        entries = named_parameters(build_model(blocks, width))
        total = sum(p.numel() for _, p in entries)
        t = UpdateTracker(entries, [])
        assert sum(min(p.numel(), t.sample) for _, p in entries) <= 0.01 * total
        assert t.budget <= max(0.01 * total, 1 << 18)
        if total > 50 * (1 << 18):
            assert t.extra_elements() <= 0.02 * total


def test_two_optimizers_taking_turns_are_both_measured():
    """check(optimizer=...) before each of two optimizers' steps (a GAN): the cadences count per
    optimizer, so with an even update_every both get update norms and change tests (one shared
    count gave every measured turn to the first)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"g": nn.Linear(4, 4), "d": nn.Linear(4, 1)})
    og = torch.optim.SGD(model["g"].parameters(), lr=0.1)
    od = torch.optim.SGD(model["d"].parameters(), lr=0.1)
    mon = gh.GradHealth(model, [og, od], on_problem="raise", update_every=2)
    reports = {"g": [], "d": []}
    for _ in range(4):
        for name, opt in (("g", og), ("d", od)):
            og.zero_grad()
            od.zero_grad()
            model["d"](model["g"](torch.randn(8, 4))).square().mean().backward()
            reports[name].append(mon.check(optimizer=opt))
            opt.step()
    mon.close()
    for name, opt in (("g", og), ("d", od)):
        measured = [r for r in reports[name] if f"{name}.weight" in r.update_norm]
        assert len(measured) == 3, name  # its turns 0, 1 (the dense start) and 2
        for r in measured:
            assert r.update_norm[f"{name}.weight"] > 0


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_lbfgs_with_check_inside_or_outside_the_closure_is_silent_under_raise(where):
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    mon = gh.GradHealth(model, opt, on_problem="raise", change_every=1)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    reports, losses = [], []

    def closure():
        opt.zero_grad()  # LBFGS's closure zeroes and recomputes the gradients at every evaluation
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if where == "inside":
            reports.append(mon.check(loss=loss))
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        for _ in range(10):
            losses.append(opt.step(closure).item())
            if where == "outside":
                reports.append(mon.check())
        mon.flush()
    assert losses[-1] < losses[0] / 10  # healthy: it fits
    if where == "inside":
        assert len(reports) > 2 * len(losses)  # the premise: several evaluations per step
    assert all(r.ok and not r.findings_of("NOT_UPDATED") and not r.findings_of("STALE_GRAD") for r in reports)
    measured = [r for r in reports if r.update_norm]
    assert measured and all(v > 0 for r in measured for v in r.update_norm.values())  # the steps are measured


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_zero_grad_between_backward_and_step_is_named(opt_cls):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = opt_cls(model.parameters(), lr=1e-3)
    mon = gh.GradHealth(model, opt, on_problem="ignore", change_every=1)
    reports = []
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        reports.append(mon.check(loss=loss))
        opt.zero_grad()  # the bug: the gradients are gone before the step
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # premise: nothing moved
    [f] = reports[0].findings_of("NOT_UPDATED")  # step 0's, written into its report at check 1
    assert [g.step for g in reports[1].findings_of("NOT_UPDATED")] == [0, 1]  # and carried by check 1's
    assert f.level == "error" and f.step == 0 and "zero_grad() is called between backward() and step()" in f.message
    assert "precision of the weights" not in f.message


def test_the_fused_change_test_equals_an_exact_comparison_of_every_sample(one_thread):
    """The change test's two fused kernels (max |now - then| per tensor) decide exactly what ``!=``
    on every sampled element decides for finite tensors: sub-ulp steps that change nothing, a change
    in one element (smallest possible: one ulp), a tensor left alone; a tensor holding inf or NaN is
    undecided (NaN), never "changed" (a constant -inf mask: FROZEN_BUT_CHANGED would be a false alarm);
    the general path (an empty sample) counts ``!=``."""
    from gradhealth.measure.compare import Packed

    torch.manual_seed(0)
    ts = [torch.randn(50), torch.randn(7, 3), torch.full((4,), float("nan")), torch.randn(300), torch.randn(5),
          torch.tensor([float("-inf"), 0.0, float("inf")])]
    for empty in (False, True):
        views = [t.view(-1) for t in ts] + ([torch.zeros(0)] if empty else [])
        packed = Packed(views, reuse=True)
        assert packed._fused is not empty
        before = packed.snapshot()
        ref = [v.clone() for v in views]
        ts[0].add_(1e-12)  # below the ulp of every element: nothing changes
        ts[1].view(-1)[5] = torch.nextafter(ts[1].view(-1)[5], torch.tensor(math.inf))  # one ulp, one element
        ts[3].add_(1.0)
        counts = torch.cat([c.reshape(-1) for c in packed.changed(before)]).tolist()
        exact = [bool((v != r).any()) for v, r in zip(views, ref)]
        assert exact[:6] == [False, True, True, True, False, False]  # the premise (NaN != NaN; inf == inf)
        if empty:  # the general path: the count of elements that differ
            assert [c > 0 for c in counts] == exact
        else:
            finite = [0, 1, 3, 4]
            assert [counts[k] > 0 for k in finite] == [exact[k] for k in finite]
            assert [counts[k] == 0 for k in finite] == [not exact[k] for k in finite]
            assert math.isnan(counts[2]) and math.isnan(counts[5])  # undecided, not "changed"


def test_a_frozen_infinite_mask_in_a_fused_optimizer_is_not_frozen_but_changed(one_thread):
    """A frozen parameter holding -inf (an attention mask kept as an nn.Parameter) given to a fused
    optimizer (no version counters: every parameter is compared) stays silent under "raise"."""
    torch.manual_seed(0)

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)
            self.mask = nn.Parameter(torch.tensor([float("-inf"), 0.0, 0.0, 0.0]), requires_grad=False)

        def forward(self, x):
            return self.lin(x).masked_fill(torch.isinf(self.mask), 0.0)

    model = Masked()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    losses = []
    with gh.GradHealth(model, opt, on_problem="raise", change_every=1) as mon:
        for _ in range(12):
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            r = mon.check(loss=loss)
            opt.step()
            losses.append(loss.item())
    assert torch.isinf(model.mask).any() and r.status["mask"] == "FROZEN"  # the premise
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_change_test_sees_a_one_ulp_change_in_a_low_precision_tensor(one_thread, dtype):
    """The change test subtracts in the tensor's own dtype (in the snapshot's buffer): a change of one
    ulp, at a large value and at the smallest subnormal, is still a change, and an untouched tensor
    is exactly 0."""
    from gradhealth.measure.compare import Packed

    tiny = torch.finfo(dtype).smallest_normal / 4  # a subnormal
    ts = [torch.tensor([1000.0, -3.0, 0.5], dtype=dtype), torch.tensor([0.0, tiny, 1.0], dtype=dtype),
          torch.tensor([2.0, 4.0], dtype=dtype)]
    packed = Packed([t.view(-1) for t in ts], reuse=True)
    assert packed._fused
    before = packed.snapshot()
    ts[0][0] = torch.nextafter(ts[0][0:1], torch.tensor([math.inf], dtype=dtype))[0]
    ts[1][1] = torch.nextafter(ts[1][1:2], torch.tensor([0.0], dtype=dtype))[0]  # a subnormal one ulp down
    assert ts[0][0] != 1000.0 and ts[1][1] != tiny  # the premise: both really moved
    values = [float(c) for c in packed.changed(before)]
    assert values[0] > 0 and values[1] > 0 and values[2] == 0.0, values


def test_a_complex_parameter_takes_the_general_change_test(one_thread):
    """No in-place abs of a complex tensor: complex samples are compared with ``!=``."""
    from gradhealth.measure.compare import Packed

    ts = [torch.randn(5, dtype=torch.complex64), torch.randn(3, dtype=torch.complex64)]
    packed = Packed([t.view(-1) for t in ts], reuse=True)
    assert not packed._fused
    before = packed.snapshot()
    ts[0][1] += 1j
    assert [c > 0 for c in torch.cat([c.reshape(-1) for c in packed.changed(before)]).tolist()] == [True, False]


@pytest.mark.parametrize("name, make_opt", [r for r in RULES if r[0].startswith("Adam")])
def test_adam_update_norms_from_step_counts_kept_on_the_device(monkeypatch, name, make_opt):
    """Fused or capturable Adam keeps its step counts as device tensors: the bias corrections are
    then computed on the device, never read (a host read would stall a GPU at every measured step).
    The same code path here, on the CPU's counts: every tensor's norm against a copy."""
    from gradhealth.measure import rules

    taken = []
    coefs = rules._adam_coefs

    def spy(t, *args):
        taken.append(isinstance(t, torch.Tensor))
        return coefs(t, *args)

    monkeypatch.setattr(rules, "_on_host", lambda t: False)  # (as on a GPU: the counts stay where they are)
    monkeypatch.setattr(rules, "_adam_coefs", spy)
    _updates_against_copies(name, make_opt)
    assert taken and all(taken)  # (the premise: the device path computed every correction)


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_a_fused_step_that_skipped_itself_at_its_first_step_measures_zero(monkeypatch, on_device, decay):
    """A fused AdamW step handed ``found_inf`` (a grad scaler's, or the deferred guard's) at the very
    first step leaves its step count at 0 and m, v at 0: its update is 0 for every parameter, weight
    decay included, whether the counts are read on the host or kept on the device (0, not 0/0)."""
    from gradhealth.measure import rules

    monkeypatch.setattr(rules, "_on_host", lambda t: not on_device)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=decay, fused=True)
    model(torch.randn(16, 8)).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # (the premise: it skipped itself)
    assert all(float(opt.state[p]["step"]) == 0.0 for p in model.parameters())
    norms = rules.rule_norms(opt, "adam", list(model.parameters()), 1 << 20)
    assert norms.tolist() == [0.0, 0.0]
