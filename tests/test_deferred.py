"""Deferred checks (``lag=1``): the same reports as the synchronous check, one check later, and no
host read on the check's path but the completed copy of an earlier check; the step guard decided
on the device for torch's fused optimizers."""

from __future__ import annotations

import contextlib
import math
import sys
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.check import deferred
from gradhealth.measure import host, rules, stats
from gradhealth.benchmarks.counts import TolistWatch, within

pytestmark = pytest.mark.usefixtures("one_thread")


class Keep:
    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def _net():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def train(lag: int, case: str, steps: int = 10, watch: list | None = None, counted: dict | None = None):
    """One plain loop with a planted ``case``; returns the sink's reports, check()'s return values,
    the losses and the monitor. ``watch``: each step's check and optimizer step run under
    ``HostReads(strict=True)``, and (what it flagged, the transfers ``counted``) is appended."""
    torch.manual_seed(0)
    model = _net()
    head = nn.Linear(16, 4)  # used only by "unused"
    params = list(model.parameters())
    if case == "frozen_decay":
        model[0].weight.requires_grad_(False)
    if case == "not_in_optimizer":
        params = params[:4]
    if case == "unused":
        model.add_module("head", head)
        params = list(model.parameters())
    lr = 0.0 if case == "lr0" else 1e-2
    fused = case in ("nan_guard_fused", "healthy_fused")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if case == "scaler" else None
    keep = Keep()
    monitor = gh.GradHealth(model, opt, scaler=scaler, on_problem="ignore", lag=lag, sinks=[keep], update_every=3,
                            change_every=2, skip_nonfinite=case.startswith("nan_guard"))
    returned, losses = [], []
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        micro = 2 if case == "accumulate" else 1
        for _ in range(micro):
            x = torch.randn(32, 8, generator=g)
            y = x[:, :4].sum(1, keepdim=True)
            if case.startswith("nan") and step == 4:
                x[0, 0] = math.inf
            mask = torch.ones(32, dtype=torch.bool) if not (case == "empty_mask" and step == 3) else torch.zeros(32, dtype=torch.bool)
            monitor.track_valid(mask, "rows")
            out = model[:5](x) if case != "unused" else model[:5](x)
            loss = ((out - y) ** 2)[mask].sum() / mask.sum().clamp(min=1) / micro
            if case == "tiny":  # gradients of ~1e-30: their fp32 squares underflow (the exact norms' edge)
                loss = loss * 1e-30
            (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(float(loss.detach()))
        before = dict(counted or {})
        with HostReads(strict=True) if watch is not None else contextlib.nullcontext() as mode:
            r = monitor.check(loss=loss)
            returned.append(None if r is None else r.step)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if case != "no_zero_grad":
                opt.zero_grad()
        if watch is not None:
            watch.append((mode.reads, *(counted[k] - before[k] for k in ("fetch", "values"))))
    monitor.close()
    return keep.reports, returned, losses, monitor


def _key(r, traced: bool = True):
    """(``traced``: with the tracer's word that a NaN did not recur; a skipped step's words up to how
    it was skipped: a fused optimizer's found_inf with ``lag=1``, the gradients dropped otherwise)"""
    return (r.step, {n: s.value for n, s in r.status.items()}, r.grad_norm, r.total_grad_norm, r.loss,
            r.valid_counts, sorted((f.kind, f.level, f.step, tuple(f.params), f.message if f.kind != "STEP_SKIPPED"
                                    else f.message.split("; ")[0]) for f in r.findings
                                   if traced or f.data.get("recurred") is not False),
            r.update_norm, r.ok)


def same(a, b, rel: float = 1e-6) -> bool:
    """``a == b``, but floats within ``rel`` of each other (NaN equal to NaN): a deferred check
    accumulates its norms in float64, the synchronous one in float32 (within 1e-6 of each other)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b) or math.isclose(a, b, rel_tol=rel)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, rel) for x, y in zip(a, b))
    return a == b


CASES = ["healthy", "healthy_fused", "not_in_optimizer", "unused", "frozen_decay", "lr0", "no_zero_grad",
         "accumulate", "scaler", "empty_mask", "nan_guard", "nan_guard_fused", "tiny"]


@pytest.mark.parametrize("case", CASES)
def test_deferred_reports_are_the_synchronous_ones_one_check_later(case):
    sync, returned_sync, losses, _ = train(0, case)
    late, returned_late, _, _ = train(1, case)
    # check() returns its own report synchronously, the previous one deferred (None at the first); close() the last
    assert returned_sync == list(range(10)) and returned_late == [None, *range(9)]
    steps = [r.step for r in late]
    assert sorted(set(steps)) == list(range(10))
    # every report the sinks got (first delivery, then again once its step's updates are known), identical,
    # but for the tracer's word on a NaN: deferred, it is armed a step later and watches the step after
    traced = lambda reports: [(r.step, f.message) for r in reports for f in r.findings_of("NONFINITE_ORIGIN")  # noqa: E731
                              if f.data.get("recurred") is False]
    assert same([_key(r, traced=False) for r in late], [_key(r, traced=False) for r in sync])
    if case.startswith("nan"):  # (the NaN of step 4 only: the batch named in step 4's report, in both modes)
        named = [(r.step, f.message) for r in sync for f in r.findings_of("NONFINITE_ORIGIN")]
        assert {s for s, _ in named} == {4} and all("the batch itself holds NaN/inf" in m for _, m in named), named
        assert traced(sync) == traced(late) == []  # (named: no tracer armed for the step after)
    if case == "healthy":  # a healthy control: it trains, and every report is clean
        assert losses[-1] < losses[0] and all(r.ok and not r.problems for r in sync)
        assert any(r.update_norm for r in late)  # the update numbers travel too
    kinds = {f.kind for r in sync for f in r.findings}
    if case == "not_in_optimizer":  # each planted bug is named in the synchronous reports (and so in the deferred)
        assert set(sync[0].problems.values()) == {gh.Status.NOT_IN_OPTIMIZER}
    if case == "unused":
        assert set(sync[-1].problems.values()) == {gh.Status.NO_GRAD}
    if case == "lr0":
        assert "NOT_UPDATED" in kinds
    if case == "no_zero_grad":
        assert "STALE_GRAD" in kinds
    if case == "empty_mask":
        assert sync[3].valid_counts == {"rows": 0} and sync[3].findings_of("EMPTY_VALID_SET")
    if case == "tiny":  # the premise: fp32 squares underflow; both modes report the exact norms
        norms = [v for r in sync for v in r.grad_norm.values()]
        assert all(0 < v < 1e-22 for v in norms) and all(math.isfinite(r.total_grad_norm) for r in late)
        assert all(r.ok and not r.problems for r in sync)
    if case.startswith("nan_guard"):
        bad = [r for r in sync if not r.grads_finite]
        assert [r.step for r in bad][:1] == [4] and bad[0].findings_of("STEP_SKIPPED")
        [skipped] = [f for r in late if r.step == 4 for f in r.findings_of("STEP_SKIPPED")][:1]
        device = "the fused optimizer skipped it on the device (its found_inf), leaving the gradients for zero_grad()"
        assert (device in skipped.message) == (case == "nan_guard_fused"), skipped.message
        assert ("were dropped before it" in skipped.message) == (case == "nan_guard"), skipped.message


def test_raise_comes_one_check_later_naming_the_step():
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(list(model.parameters())[:4], lr=0.1)
    monitor = gh.GradHealth(model, opt, on_problem="raise", lag=1)
    model(torch.randn(4, 8)).sum().backward()
    assert monitor.check() is None  # launched: nothing read yet
    opt.step()
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(gh.GradHealthError, match="step 0") as err:
        monitor.check()
    assert "NOT_IN_OPTIMIZER" in str(err.value) and "4." in str(err.value)


def test_flush_delivers_the_check_in_flight():
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keep = Keep()
    monitor = gh.GradHealth(model, opt, lag=1, sinks=[keep])
    model(torch.randn(4, 8)).sum().backward()
    monitor.check()
    assert keep.reports == []
    monitor.flush()
    assert [r.step for r in keep.reports] == [0]
    monitor.close()


def test_skip_spikes_is_refused_with_lag():
    with pytest.raises(ValueError, match="skip_spikes .* lag=1"):
        gh.Options(lag=1, skip_spikes=6.0)
    with pytest.raises(ValueError, match="lag must be one of 0, 1"):
        gh.Options(lag=2)


# ----------------------------------------------------------------------------- host reads
#: ops whose output's size depends on the values (the host must read them: a synchronisation)
DATA_DEPENDENT = {"nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                  "unique_consecutive", "unique_dim_consecutive", "argwhere", "masked_scatter"}
#: the functions that build tensors from Python data on the host and move them without a sync
HOST_SIDE = {host.host_to.__code__, host.host_segments.__code__}
#: where gradhealth reads values on purpose: the checks' transfers, and tensors in host memory
TRANSFERS = {stats.fetch.__code__, deferred.Transfer.values.__code__, rules._host_values.__code__}


def _ours() -> bool:
    """Is this op dispatched by gradhealth's own code (not by the optimizer or the user)?"""
    f = sys._getframe(2)
    while f is not None:
        if "/gradhealth/" in f.f_code.co_filename.replace("\\", "/") and "/tests/" not in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


class HostReads(TolistWatch):
    """Every read of a tensor's value by the host: a scalar read (``item``, ``bool``, ``int``), a
    copy from a device to the CPU, and (``strict``) what makes the host wait on a GPU although the
    CPU shows no read: an op whose output's size depends on the values (``nonzero``,
    ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats, boolean-mask indexing
    or assignment), and a tensor made from Python data (``torch.tensor([...])``: ``lift_fresh``),
    which on a GPU is a blocking copy from pageable memory. The rule that makes the last two
    detectable on the CPU, where every tensor is on the "device": they are allowed only inside
    :func:`gradhealth.measure.host.host_to` (host-side construction, then a non-blocking copy from pinned
    memory); anywhere else in gradhealth's own code they are flagged. The user's and the
    optimizer's ops are not the monitor's, and are not counted. ``Tensor.tolist()`` (no op on the
    CPU: it reads memory; on a GPU a blocking copy) is watched too, in gradhealth's own code outside
    the two transfer points (``stats.fetch``, ``Transfer.values``) and the reads of tensors that are
    in host memory by construction (``rules._host_values``)."""

    READS = {"_local_scalar_dense", "item", "is_nonzero"}

    def __init__(self, strict: bool = False):
        super().__init__()
        self.reads = []
        self.strict = strict

    def tolist_called(self, frame) -> None:
        if _ours() and not within(frame, TRANSFERS):
            self.reads.append(f"tolist in {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in self.READS:
            if not self.strict or _ours():
                self.reads.append(name)
        elif name in ("_to_copy", "copy_", "to"):
            src = args[1] if name == "copy_" else args[0]
            dst = kwargs.get("device") if name != "copy_" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and torch.device(dst or "cpu").type == "cpu":
                self.reads.append(f"{name}:{src.device}->cpu")
        elif self.strict:
            flagged = name in DATA_DEPENDENT or name == "lift_fresh"
            if name == "repeat_interleave":
                flagged = isinstance(args[0] if func.__name__.endswith("Tensor") and len(args) == 1 else
                                     (args[1] if len(args) > 1 else kwargs.get("repeats")), torch.Tensor)
            elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
                flagged = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                              for i in (args[1] or ()))
            if flagged and _ours() and not within(sys._getframe(1), HOST_SIDE):
                self.reads.append(f"{func.__name__} in {_where()}")
        return func(*args, **kwargs)


def _where() -> str:
    f = sys._getframe(2)
    while f is not None and "/gradhealth/" not in f.f_code.co_filename:
        f = f.f_back
    return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}" if f else "?"


@pytest.fixture
def counted(monkeypatch):
    """The project's own transfer points, counted: ``stats.fetch`` (a synchronous check's one
    transfer) and ``Transfer.values`` (a deferred check's completed copy)."""
    calls = {"fetch": 0, "values": 0}
    fetch, values = stats.fetch, deferred.Transfer.values

    def counted_fetch(parts):
        calls["fetch"] += 1
        return fetch(parts)

    def counted_values(self):
        calls["values"] += 1
        return values(self)

    monkeypatch.setattr(stats, "fetch", counted_fetch)
    monkeypatch.setattr(deferred.Transfer, "values", counted_values)
    return calls


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("fused", [False, True])
def test_host_reads_during_a_check(counted, lag, fused):
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    monitor = gh.GradHealth(model, opt, lag=lag, update_every=2, change_every=1, skip_nonfinite=fused)
    per_check = []
    for step in range(8):
        x = torch.randn(16, 8)
        loss = ((model(x) - x[:, :1]) ** 2).mean()
        loss.backward()
        before = dict(counted)
        with HostReads() as mode:
            monitor.check(loss=loss)
        per_check.append((mode.reads, counted["fetch"] - before["fetch"], counted["values"] - before["values"]))
        opt.step()
        opt.zero_grad()
    monitor.close()
    for step, (reads, fetches, values) in enumerate(per_check):
        assert reads == [], (step, reads)  # no scalar read, no copy to the host: not even the guard's (fused)
        if lag:
            assert fetches == 0 and values == (0 if step == 0 else 1), (step, fetches, values)
        else:
            assert fetches == 1 and values == 0, (step, fetches, values)  # exactly the one transfer


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("case", CASES)
def test_no_host_wait_from_check_0_on_the_catalogue(counted, case, lag):
    """From the first check on (plans included), on every planted bug: no host read, no op whose
    output's size depends on the values, no tensor made from Python data outside ``host_to``
    (see ``HostReads``), through the check and the optimizer step's hooks; one transfer per
    synchronous check (a second only where a norm first came back 0 or inf), the completed copy
    alone in deferred mode."""
    watch = []
    train(lag, case, watch=watch, counted=counted)
    # the reads a diagnosis adds, where it is due: step 4's NaN batch is named from the model's kept
    # inputs, read once when its report completes (deferred: in the call of step 5); the zero
    # gradients of step 3's empty mask are re-checked exactly, once
    extra = ({4 + lag: 1} if case.startswith("nan") else {3: 1} if case == "empty_mask" and not lag
             else {0: 1} if case == "tiny" and not lag else {})  # (tiny: its underflowing norms, re-checked once)
    for step, (reads, fetches, values) in enumerate(watch):
        if lag and case == "nan_guard":  # a non-fused optimizer: the guard reads its one flag (said once)
            assert reads == ["_local_scalar_dense"], (step, reads)
        else:
            assert reads == [], (step, reads)
        if lag:
            assert fetches == extra.get(step, 0) and values == (0 if step == 0 else 1), (step, fetches, values)
        else:
            assert fetches == 1 + extra.get(step, 0) and values == 0, (step, fetches, values)


def test_a_non_fused_guard_reads_one_flag_and_says_so_once(counted, caplog):
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = gh.GradHealth(model, opt, lag=1, skip_nonfinite=True)
    reads = []
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        with HostReads() as mode:
            monitor.check()
        reads.append(mode.reads)
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert reads == [["_local_scalar_dense"]] * 3
    said = [r for r in caplog.records if "reads one flag on the host" in r.getMessage()]
    assert len(said) == 1 and "AdamW" in said[0].getMessage()


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_the_fused_guard_leaves_a_poisoned_step_bit_for_bit(name):
    torch.manual_seed(0)
    model = _net()
    kw = {"momentum": 0.9} if name == "SGD" else {}
    opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2, fused=True, **kw)
    monitor = gh.GradHealth(model, opt, lag=1, skip_nonfinite=True, on_problem="ignore")
    keep = Keep()
    monitor.publisher.sinks = (*monitor.publisher.sinks, keep)
    for step in range(6):
        x = torch.randn(16, 8)
        if step == 3:
            x[0, 0] = math.inf
        loss = ((model(x) - x[:, :1].nan_to_num(posinf=0.0)) ** 2).mean()
        loss.backward()
        monitor.check(loss=loss)
        if step == 3:  # the premise: the gradients are poisoned; what the step would change is all of it
            assert not all(torch.isfinite(p.grad).all() for p in model.parameters())
            before = ([p.detach().clone() for p in model.parameters()],
                      [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])
        opt.step()
        if step == 3:
            assert all(torch.equal(a, p) for a, p in zip(before[0], model.parameters()))
            for saved, p in zip(before[1], model.parameters()):
                assert saved.keys() == opt.state[p].keys()
                assert all(torch.equal(saved[k], opt.state[p][k]) for k in saved)
            assert not hasattr(opt, "found_inf")  # handed back after the step
        opt.zero_grad()
    monitor.close()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # and training went on
    skipped = [f for r in keep.reports for f in r.findings if f.kind == "STEP_SKIPPED"]
    assert skipped and skipped[0].step == 3


# ----------------------------------------------------------------------------- through the callbacks
def _lightning(lag: int, bug: str | None):
    from test_lightning import Reports, fit

    from gradhealth.demos.lightning_parts import DemoModule
    from gradhealth.integrations.lightning import GradHealthCallback

    keep = Reports()
    cb = GradHealthCallback(lag=lag, sinks=[keep], on_problem="ignore", replay_on_nonfinite=False)
    torch.manual_seed(0)
    fit(DemoModule(bug=bug) if bug else DemoModule(), [cb], steps=5)
    return keep.reports


@pytest.mark.parametrize("bug", [None, "not_in_optimizer", "lr_zero", "missing_zero_grad", "eval_mode"])
def test_the_lightning_callback_takes_lag_and_reports_the_same(bug):
    sync, late = _lightning(0, bug), _lightning(1, bug)
    assert [r.step for r in sync] == [0, 1, 2, 3, 4] == sorted({r.step for r in late})  # the last one too
    assert same([_key(r) for r in late], [_key(r) for r in sync])
    if bug is None:
        assert all(r.ok and not r.problems for r in sync)
    else:
        assert any(r.problems or r.findings for r in sync)


def test_the_hf_trainer_callback_takes_lag(tmp_path):
    pytest.importorskip("transformers")
    from test_transformers import HeadOutOfOptimizer, Kept, Tokens, arguments, tiny_bert

    from gradhealth.integrations.transformers import GradHealthCallback

    runs = []
    for lag in (0, 1):
        torch.manual_seed(0)
        kept = Kept()
        cb = GradHealthCallback(on_problem="ignore", lag=lag, sinks=[kept])
        trainer = HeadOutOfOptimizer(model=tiny_bert(), args=arguments(tmp_path / str(lag), max_steps=4),
                                     train_dataset=Tokens(), callbacks=[cb])
        trainer.train()
        runs.append(kept.reports)
    sync, late = runs
    assert [r.step for r in sync] == [1, 2, 3, 4] == sorted({r.step for r in late})
    # the same states, norms and losses; the same findings about the same steps (Trainer's logging flushes
    # the monitor, which delivers a finding about a step's update into that step's report alone, or also into
    # the next one when the check that resolves it comes first)
    numbers = lambda r: (r.step, r.status, r.grad_norm, r.loss, r.update_norm)  # noqa: E731
    assert same([numbers(r) for r in late], [numbers(r) for r in sync])
    said = lambda reports: {(f.kind, f.level, f.step, f.message) for r in reports for f in r.findings}  # noqa: E731
    assert said(late) == said(sync) | {f for f in said(late) if f[0] == "NOT_UPDATED" and f[1] == "info"}
    assert {s for s in sync[0].problems.values()} == {gh.Status.NOT_IN_OPTIMIZER}


def test_a_deferred_check_that_fails_inside_is_said_and_the_next_one_still_launches(monkeypatch):
    """A failure while completing the check in flight (its numbers read back) is said as a
    synchronous check's failure is; the check of this step is still launched (not lost with it),
    and a failure inside ``flush()`` is said too, never raised into the loop."""
    from gradhealth.check import deferred

    # (planted where every completion passes, a plain steady check's too: its numbers read back)
    values, calls = deferred.Transfer.values, {"n": 0}

    def fails_at(*which):
        def planted(self):
            calls["n"] += 1
            if calls["n"] in which:
                raise RuntimeError("planted failure")
            return values(self)
        return planted

    monkeypatch.setattr(deferred.Transfer, "values", fails_at(2, 6))
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = gh.GradHealth(model, opt, lag=1, on_problem="raise")
    returned, losses = [], []
    with pytest.warns(gh.GradHealthInternalWarning) as said:
        for step in range(6):
            x = torch.randn(16, 8)
            loss = ((model(x) - x[:, :1]) ** 2).mean()
            loss.backward()
            r = monitor.check(loss=loss)
            returned.append(None if r is None else r.step)
            opt.step()
            opt.zero_grad()
        monitor.flush()  # (the completion of check 5 fails too: said, not raised)
    assert calls["n"] == 6  # (the premise: both planted failures were reached)
    assert returned == [None, 0, None, 2, 3, 4]  # check 1's completion failed; check 2 was launched all the same
    assert monitor.last_report.step == 4
    texts = [str(w.message) for w in said]
    assert sum("check at step 1 failed internally" in t and "planted failure" in t for t in texts) == 1, texts
    assert sum("check at step 5 failed internally" in t for t in texts) == 1, texts
    monitor.close()


def test_a_launch_that_fails_inside_keeps_the_report_completed_before_it(monkeypatch):
    """The check in flight completes before this step's is launched: a failure while launching is
    said, and the completed report still reaches the caller and the policy (here: raised)."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(list(model.parameters())[:-1], lr=1e-2)  # the last bias left out: an error
    monitor = gh.GradHealth(model, opt, lag=1, on_problem="raise")
    x = torch.randn(16, 8)
    ((model(x) - x[:, :1]) ** 2).mean().backward()
    assert monitor.check() is None  # (launched; nothing completed yet)

    def broken(*args, **kwargs):
        raise RuntimeError("planted failure at launch")

    from gradhealth.check import quiet

    monkeypatch.setattr(deferred.Transfer, "__init__", broken)
    monkeypatch.setattr(quiet, "_launch_later", broken)  # (a plain check's launch, whose CPU numbers need no Transfer)
    ((model(x) - x[:, :1]) ** 2).mean().backward()
    with pytest.warns(gh.GradHealthInternalWarning, match="check at step 1 failed internally.*planted failure"):
        with pytest.raises(gh.GradHealthError, match="NOT_IN_OPTIMIZER"):  # step 0's verdict, not lost with step 1's launch
            monitor.check()
    monitor.close()


@pytest.mark.parametrize("lag", [0, 1])
def test_a_nan_diagnosis_reads_only_through_the_transfer_point(counted, lag):
    """A NaN batch: the check that diagnoses it (the batch named from the model's kept inputs, when
    the NaN's report completes) reads what it needs through ``stats.fetch`` (a GPU script allows
    exactly that) and nothing else, fused AdamW's step counts included (``rules._on_host`` as on a
    GPU, where fused Adam keeps them on the device)."""
    from gradhealth.measure import rules

    rules_on_host = rules._on_host
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    monitor = gh.GradHealth(model, opt, on_problem="ignore", lag=lag, skip_nonfinite=True, update_every=1)
    seen = []
    for step in range(6):
        x = torch.randn(16, 8)
        if step == 2:
            x[0, 0] = math.nan
        loss = ((model(x) - x[:, :1]) ** 2).mean()  # (the model itself: its forward watch sees the output)
        loss.backward()
        before = dict(counted)
        rules._on_host = lambda t: False
        try:
            with HostReads(strict=True) as mode:
                r = monitor.check(loss=loss)
                opt.step()
                opt.zero_grad()
        finally:
            rules._on_host = rules_on_host
        seen.append((mode.reads, counted["fetch"] - before["fetch"], r))
    monitor.close()
    assert all(reads == [] for reads, _, _ in seen), [(k, reads[:3]) for k, (reads, _, _) in enumerate(seen)]
    said = {r.step: {f.kind for f in r.findings} for _, _, r in seen if r is not None}
    assert "NON_FINITE_LOSS" in said[2] and "STEP_SKIPPED" in said[2]  # (the premise: the NaN was there)
    assert "NONFINITE_ORIGIN" in said[2] and "NONFINITE_ORIGIN" not in said[3]  # the batch, in its own report
    # the transfers: one per synchronous check; the NaN's report adds its batch read (deferred: completed at step 3)
    assert [n for _, n, _ in seen] == ([1, 1, 2, 1, 1, 1] if not lag else [0, 0, 0, 1, 0, 0]), seen


def test_two_deferred_monitors_never_write_into_each_others_buffers(monkeypatch):
    """Each monitor keeps its own pinned buffers: with two ``lag=1`` monitors whose packed numbers
    have the same size, checks in the order A, B, B, A leave A's numbers where A copied them. The
    device path is taken on the CPU (its copy, its event) as on a GPU."""

    class Event:  # (the CPU has no events; a copy on the CPU is complete when it returns)
        def __init__(self, device=None):
            pass

        record = synchronize = lambda self: None

    monkeypatch.setattr(deferred.Transfer, "HOST", "nowhere")
    monkeypatch.setattr(torch, "Event", Event)
    made = []

    def monitor(seed):
        torch.manual_seed(seed)
        model = _net()
        mon = gh.GradHealth(model, torch.optim.SGD(model.parameters(), lr=1e-2), on_problem="ignore", lag=1)
        made.append(mon)
        return model, mon

    (a, ma), (b, mb) = monitor(0), monitor(1)
    x = torch.randn(16, 8)
    truth = []

    def backward(model):
        model.zero_grad()
        model(x).pow(2).mean().backward()
        return {n: torch.linalg.vector_norm(p.grad.double()).item() for n, p in model.named_parameters()}

    truth.append(backward(a))
    assert ma.check() is None
    backward(b)
    mb.check()
    backward(b)
    mb.check()
    truth.append(backward(a))
    first = ma.check()
    assert ma._deferred.pinned and mb._deferred.pinned  # (the premise: both took the device path)
    assert first.step == 0 and first.grad_norm == pytest.approx(truth[0], rel=1e-6)
    for m in made:
        m.close()


@pytest.mark.parametrize("change", ["freeze", "freeze_kept_grads", "unfreeze", "add_param_group", "swap_head",
                                    "swap_fewer", "swap_more"])
def test_a_deferred_report_is_judged_as_its_step_was_set_up(change):
    """The loop changes what trains between a check and its completion (at the top of the next
    step: a freeze, a gradual unfreeze with ``add_param_group``, a head swapped in with the same,
    fewer or more parameters): the deferred report of the step before still says what that step
    was, as the synchronous one does, and nothing fails inside."""

    def run(lag):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        if change == "unfreeze":
            model[0].requires_grad_(False)
        left_out = change in ("unfreeze", "add_param_group")
        opt = torch.optim.AdamW(list(model[2].parameters()) if left_out else list(model.parameters()), lr=1e-2)
        keep = Keep()
        monitor = gh.GradHealth(model, opt, on_problem="ignore", lag=lag, sinks=[keep])
        g = torch.Generator().manual_seed(1)
        for step in range(7):
            if step == 4:
                if change.startswith("freeze"):  # (kept grads: zero_grad(set_to_none=False), AdamW decays it)
                    model[0].requires_grad_(False)
                if change == "unfreeze":
                    model[0].requires_grad_(True)
                if left_out:
                    opt.add_param_group({"params": list(model[0].parameters())})
                if change.startswith("swap"):
                    model[2] = {"swap_head": lambda: nn.Linear(16, 1), "swap_fewer": lambda: nn.Linear(16, 1, bias=False),
                                "swap_more": lambda: nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))}[change]()
            opt.zero_grad(set_to_none=change != "freeze_kept_grads")
            x = torch.randn(16, 8, generator=g)
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            monitor.check()
            opt.step()
        monitor.close()
        return {r.step: ({n: s.name for n, s in r.status.items()}, r.ok, sorted((f.kind, f.level) for f in r.findings))
                for r in keep.reports}

    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthInternalWarning)
        sync, late = run(0), run(1)
    assert sync[3] != sync[4] or change == "swap_head"  # (the premise: the change shows from step 4 on)
    if change == "freeze_kept_grads":  # (the frozen weight keeps a zero gradient: AdamW's decay moves it)
        assert ("FROZEN_BUT_CHANGED", "error") in sync[4][2]
    assert late == sync


class _Norm(nn.Module):
    """h / (1 + ||h||): a row of zeros gives a finite forward and NaN gradients (sqrt at 0)."""

    def forward(self, h):
        return h / (1 + torch.sqrt((h * h).sum(-1, keepdim=True)))


@pytest.mark.parametrize("nan_at", [(5, 6), (5, 6, 7)])
def test_the_deferred_tracer_is_judged_against_the_step_it_watched(nan_at):
    """With ``lag=1`` a NaN made inside the model (a batch row of zeros through a sqrt at 0: finite
    data, so the kept inputs name no batch, and the weights have moved when the report completes, so
    no replay) arms the tracer when the NaN's report completes, a step later, so it watches the
    forward after the next one: it is resolved with that step's report (not the one completed in
    between, whose forward it never saw: that said "born outside the modules" of a step that held the
    NaN). The synchronous monitor names it at the NaN's own check, by a replay of the model's calls."""

    def run(lag):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16, bias=False), _Norm(), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        keep = Keep()
        monitor = gh.GradHealth(model, opt, on_problem="ignore", lag=lag, skip_nonfinite=True, sinks=[keep])
        g = torch.Generator().manual_seed(1)
        for step in range(10):
            opt.zero_grad()
            x = torch.randn(16, 8, generator=g)
            if step in nan_at:
                x[0] = 0.0
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            monitor.check()
            opt.step()
        monitor.close()
        return {r.step: [f for f in r.findings_of("NONFINITE_ORIGIN") if not f.data.get("from_loss")]
                for r in keep.reports}

    from gradhealth.origin import trace

    seen_forwards, resolve = [], trace.NonFiniteTracer.resolve

    def counted(self):  # the forwards a tracer recorded when it is resolved: the step it watched alone
        seen_forwards.append(sum(1 for e in self._events if e.kind == "inp" and e.module == "0"))
        return resolve(self)

    trace.NonFiniteTracer.resolve = counted
    try:
        sync, late = run(0), run(1)
    finally:
        trace.NonFiniteTracer.resolve = resolve
    assert seen_forwards and set(seen_forwards) == {1}, seen_forwards
    for k in nan_at:  # synchronous: each NaN named at its own check, module, operation and line
        [named] = sync[k]
        assert named.message.startswith(f"replayed at step {k}") and named.data["op"] == "SqrtBackward0"
    said = [f.message for found in late.values() for f in found]
    assert not any("born outside" in m for m in said), said  # nothing false
    assert not late[5] and not late[6]  # (deferred: no replay, the tracer armed when step 5's report completes)
    if nan_at == (5, 6):  # armed at step 6 (step 5's report), watching step 7's forward: clean
        assert [f.data.get("recurred") for f in late[7]] == [False] and "of step 5 did not recur at step 7" in said[0]
    else:  # step 7's forward held the NaN too: named by the tracer, as the synchronous replay named it
        [named] = late[7]
        assert named.message.startswith("traced at step 7 after NaN/inf gradients at step 5: ")
        assert named.data["backward_origin"] == "1" and named.data["op"] == "SqrtBackward0"
        assert named.level == sync[7][0].level == "error"


def test_close_raises_the_last_deferred_verdict_after_closing(monkeypatch):
    """With ``lag=1`` the last check's report is delivered by ``close()``: under ``on_problem="raise"``
    its verdict is raised there (as ``flush()`` does), once every hook is removed and every sink
    closed (it was said as the monitor's own failure to fetch the last updates)."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.SGD(list(model.parameters())[:-1], lr=1e-2)  # the last bias left out: an error
    closed = []

    class Sink:
        def write(self, report):
            pass

        def close(self):
            closed.append(True)

    monitor = gh.GradHealth(model, opt, lag=1, on_problem="raise", sinks=[Sink()])
    x = torch.randn(16, 8)
    ((model(x) - x[:, :1]) ** 2).mean().backward()
    assert monitor.check() is None  # (launched; its verdict is still to come)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthInternalWarning)
        with pytest.raises(gh.GradHealthError, match="NOT_IN_OPTIMIZER"):
            monitor.close()
    assert closed == [True] and monitor._closed  # closed all the same: every hook removed, every sink closed
    assert not model._forward_hooks and not model._forward_pre_hooks and not opt._optimizer_step_post_hooks
    monitor.close()  # (idempotent)
    again = gh.GradHealth(model, opt, lag=1, on_problem="raise")
    ((model(x) - x[:, :1]) ** 2).mean().backward()
    again.check()
    try:
        raise StopIteration  # (a loop that ends in an except block of its own: the verdict is still raised)
    except StopIteration:
        with pytest.raises(gh.GradHealthError, match="NOT_IN_OPTIMIZER"):
            again.close()
    with pytest.raises(KeyError, match="the loop's own"):  # leaving a with-block on an exception: that one is seen
        with gh.GradHealth(model, opt, lag=1, on_problem="raise") as again:
            ((model(x) - x[:, :1]) ** 2).mean().backward()
            again.check()
            raise KeyError("the loop's own")


def test_the_last_steps_updates_reach_the_sinks_when_the_last_verdict_raises():
    """``flush()`` under ``on_problem="raise"`` with ``lag=1``: the last check's verdict is raised
    after the last step's update numbers have reached the sinks (as under ``warn``)."""
    def run(on_problem):
        torch.manual_seed(0)
        model = _net()
        opt = torch.optim.SGD(list(model.parameters())[:-1], lr=1e-2)  # the last bias left out: an error
        updated = []

        class Sink:
            def write(self, report):
                pass

            def write_update(self, report):
                updated.append(report.step)

        monitor = gh.GradHealth(model, opt, lag=1, on_problem=on_problem, sinks=[Sink()], update_every=1)
        x = torch.randn(16, 8)
        for step in range(3):
            ((model(x) - x[:, :1]) ** 2).mean().backward()
            try:
                monitor.check()
            except gh.GradHealthError:
                pass
            opt.step()
            opt.zero_grad()
        with contextlib.suppress(gh.GradHealthError):
            monitor.close()
        return updated

    assert run("raise") == run("warn") == [0, 1, 2]
