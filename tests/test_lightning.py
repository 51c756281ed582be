"""GradHealthCallback through real Trainer.fit runs on CPU."""

import csv
import glob
import math
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import gradhealth as gh
from gradhealth.integrations.lightning import GradHealthCallback, metrics_of
from gradhealth.demos.lightning_parts import DemoModule, SyntheticData
from test_idioms_lightning import GAN  # Lightning's two-optimizer recipe


def fit(module, callbacks, steps=4, data=None, **trainer_kw):
    kw = dict(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    kw.update(trainer_kw)
    trainer = pl.Trainer(callbacks=callbacks, **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data or SyntheticData(n_batches=8))
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    return trainer, said


class Reports:
    def __init__(self):
        self.reports, self.updates = [], []

    def write(self, report):
        self.reports.append(report)

    def write_update(self, report):
        self.updates.append(report)


@pytest.mark.parametrize("bug, check", [
    ("frozen", lambda r: r.status["encoder.0.weight"] == "FROZEN"),
    ("not_in_optimizer", lambda r: r.problems == {"head.weight": "NOT_IN_OPTIMIZER", "head.bias": "NOT_IN_OPTIMIZER"}),
    ("division_by_zero", lambda r: set(r.status.values()) == {gh.Status.NON_FINITE_GRAD}),
    ("all_masked", lambda r: r.findings_of("EMPTY_VALID_SET")),
    ("lr_zero", lambda r: r.findings_of("NOT_UPDATED")),
    ("missing_zero_grad", lambda r: r.findings_of("STALE_GRAD")),
    ("eval_mode", lambda r: r.findings_of("GRAD_MODE")),
])
def test_each_planted_bug_reported(bug, check):
    cb = GradHealthCallback(on_problem="ignore", replay_on_nonfinite=False)
    fit(DemoModule(bug=bug), [cb], steps=3)
    assert cb.last_report is not None and check(cb.last_report), str(cb.last_report)


def test_healthy_run_is_silent():
    cb = GradHealthCallback()
    _, said = fit(DemoModule(), [cb], steps=6)
    assert said == [] and cb.last_report.ok and cb.last_report.step == 5


def test_detached_loss_raises_grad_mode_error():
    with pytest.raises(gh.GradModeError, match=r"\.detach\(\)"):
        fit(DemoModule(bug="detached"), [GradHealthCallback()], steps=2)


def test_hooks_removed_after_fit():
    module = DemoModule()
    cb = GradHealthCallback()
    trainer, _ = fit(module, [cb], steps=2)
    assert cb.monitor is None
    assert all(len(m._forward_hooks) == 0 for m in module.modules())
    opt = trainer.optimizers[0]
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    assert all(not getattr(p, "_backward_hooks", None) for p in module.parameters())


def test_accumulation_one_check_per_step_and_accumulated_grads():
    torch.manual_seed(0)
    module = DemoModule()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    sink = Reports()
    cb = GradHealthCallback(sinks=[sink])
    _, said = fit(module, [cb], steps=2, accumulate_grad_batches=4)
    assert [r.step for r in sink.reports] == [0, 1]
    assert said == [] and all(not r.findings for r in sink.reports)
    # reference: the summed gradients of the first four micro-batches (each loss / 4)
    ref = DemoModule()
    ref.load_state_dict(start)
    for x, y in list(SyntheticData(n_batches=8).train_dataloader())[:4]:
        (nn.functional.cross_entropy(ref(x), y) / 4).backward()
    expected = math.sqrt(sum(p.grad.double().norm().item() ** 2 for p in ref.parameters()))
    assert sink.reports[0].total_grad_norm == pytest.approx(expected, rel=1e-5)


def test_norms_are_pre_clip():
    sink_a, sink_b = Reports(), Reports()
    torch.manual_seed(0)
    fit(DemoModule(), [GradHealthCallback(sinks=[sink_a])], steps=1)
    torch.manual_seed(0)
    module = DemoModule()
    clipped = []
    cb = GradHealthCallback(sinks=[sink_b])

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def after_step(opt, args, kwargs):  # the gradients the step used: clipped
                clipped.append(math.sqrt(sum(p.grad.norm().item() ** 2 for p in pl_module.parameters())))

            trainer.optimizers[0].register_step_post_hook(after_step)

    fit(module, [cb, Spy()], steps=1, gradient_clip_val=0.01)
    assert sink_b.reports[0].total_grad_norm == pytest.approx(sink_a.reports[0].total_grad_norm, rel=1e-6)
    assert sink_b.reports[0].total_grad_norm > 0.05 and clipped[0] == pytest.approx(0.01, rel=1e-3)


def test_bf16_mixed_on_cpu():
    cb = GradHealthCallback(on_problem="ignore")
    fit(DemoModule(bug="not_in_optimizer"), [cb], steps=2, precision="bf16-mixed")
    assert cb.last_report.problems == {"head.weight": "NOT_IN_OPTIMIZER", "head.bias": "NOT_IN_OPTIMIZER"}
    cb = GradHealthCallback()
    _, said = fit(DemoModule(), [cb], steps=3, precision="bf16-mixed")
    assert said == [] and cb.last_report.ok


def test_logged_values_equal_the_report(tmp_path):
    sink = Reports()
    cb = GradHealthCallback(sinks=[sink])
    logger = CSVLogger(str(tmp_path), name="run")
    fit(DemoModule(), [cb], steps=3, logger=logger, log_every_n_steps=1)
    rows = list(csv.DictReader(open(glob.glob(os.path.join(str(tmp_path), "run", "*", "metrics.csv"))[0])))
    by_step: dict = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith("gradhealth/") and v != "":
                by_step.setdefault(int(row["step"]), {})[k] = float(v)
    for r in sink.reports:
        logged = by_step[r.step]
        for key, value in metrics_of(r).items():
            assert logged[key] == pytest.approx(value, rel=1e-6), key
        assert logged["gradhealth/status/OK"] == 6.0
        assert logged["gradhealth/grad_norm_preclip/head"] == pytest.approx(math.hypot(r.grad_norm["head.weight"], r.grad_norm["head.bias"]))
    assert sink.updates, "the update ratios of the steps that ran"
    first = sink.updates[0]
    ratio = by_step[first.step]["gradhealth/update_ratio/head"]
    expected = math.hypot(first.update_norm["head.weight"], first.update_norm["head.bias"]) / math.hypot(
        first.update_norm["head.weight"] / first.update_ratio["head.weight"], first.update_norm["head.bias"] / first.update_ratio["head.bias"])
    assert ratio == pytest.approx(expected, rel=1e-6)


def test_resume_keeps_history(tmp_path):
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last=True, every_n_train_steps=5)
    cb = GradHealthCallback()
    other = GradHealthCallback(every_n_steps=2)  # a differently configured one coexists
    assert cb.state_key != other.state_key
    fit(DemoModule(), [cb, other, ckpt_cb], steps=10, enable_checkpointing=True)
    saved = torch.load(os.path.join(str(tmp_path), "last.ckpt"), weights_only=False)["callbacks"]
    assert saved[cb.state_key]["monitor"]["history"]["seen"] == 10
    assert saved[other.state_key]["monitor"]["history"]["seen"] == 5
    resumed = GradHealthCallback()
    seen_at_start = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not seen_at_start:
                seen_at_start.append(resumed.monitor.history.seen)

    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[resumed, Spy()], default_root_dir=str(tmp_path))
    trainer.fit(DemoModule(), SyntheticData(n_batches=8), ckpt_path=os.path.join(str(tmp_path), "last.ckpt"))
    assert seen_at_start == [10]
    assert resumed.state_dict()["monitor"]["history"]["seen"] == 12


def test_two_optimizers_classified_per_step():
    sink = Reports()
    cb = GradHealthCallback(sinks=[sink])
    _, said = fit(GAN(), [cb], steps=6)
    assert said == []
    d_reports = [r for r in sink.reports if r.optimizer_index == 1]
    g_reports = [r for r in sink.reports if r.optimizer_index == 0]
    assert d_reports and g_reports
    assert all(set(r.status) == {n for n, _ in GAN().named_parameters() if n.startswith("disc.")} for r in d_reports)
    assert all(set(r.status) == {n for n, _ in GAN().named_parameters() if n.startswith("gen.")} for r in g_reports)
    assert all(r.ok for r in sink.reports)


@pytest.mark.parametrize("lag, skip, every", [(0, False, 1), (1, False, 1), (1, True, 1), (1, True, 2)])
def test_replay_names_the_origin_and_leaves_training_unchanged(lag, skip, every):
    """The replay runs the NaN step's own batch (with ``lag=1``: the batch of the check that just
    completed, a step later, not the current one, also when ``every_n_steps`` lets checks through
    between steps it skips), and training is bit for bit as without it."""
    def run(replay):
        torch.manual_seed(0)
        module = DemoModule(bug="nan_batch", nan_batch=2, dropout=0.2)
        sink = Reports()
        cb = GradHealthCallback(on_problem="ignore", replay_on_nonfinite=replay, sinks=[sink], lag=lag,
                                skip_nonfinite=skip, every_n_steps=every)
        fit(module, [cb], steps=5)
        return module, sink, cb

    with_replay, sink, cb = run(True)
    without, _, _ = run(False)
    for a, b in zip(with_replay.parameters(), without.parameters()):
        assert torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))  # bit-identical, NaN included
    r = next(r for r in sink.reports if r.step == 2)
    f = [x for x in r.findings_of("NONFINITE_ORIGIN") if not x.data.get("from_loss")]  # the replay's
    assert f and f[0].data["reproduced"] is True and f[0].data["batch_idx"] == 2, [str(x) for x in r.findings]
    assert "reproduced" in f[0].message
    assert cb.last_report.step == 4 and [r.step for r in sink.reports] == list(range(0, 5, every))  # (the last too)


def test_grads_are_unscaled_when_classified():
    from lightning.pytorch.plugins.precision import MixedPrecision

    seen = []

    class Spy(pl.Callback):  # runs after gradhealth's hook, on the same gradients
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(math.sqrt(sum(p.grad.double().norm().item() ** 2 for p in pl_module.parameters())))

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    sink = Reports()
    cb = GradHealthCallback(sinks=[sink])
    fit(DemoModule(), [cb, Spy()], steps=3, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert cb.monitor is None and len(sink.reports) == 3
    for r, ref in zip(sink.reports, seen):
        assert r.total_grad_norm == pytest.approx(ref, rel=1e-5)  # unscaled, and not divided a second time
        assert r.total_grad_norm < 100  # the scaled gradients would be ~65536x larger


class _NoneStep(DemoModule):
    """A training_step that returns None at every step: Lightning skips backward (and the step
    changes nothing)."""

    def training_step(self, batch, batch_idx):
        return None


class _Spare(DemoModule):
    """The counterpart: a backward runs, and a layer the forward never uses gets no gradient from it."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(4, 4)


@pytest.mark.parametrize("module, words, wrong", [
    (_NoneStep, "got no gradient because no backward ran before this check", "from this backward"),
    (_Spare, "got no gradient from this backward", "no backward ran"),
])
def test_no_grad_says_no_backward_ran_where_lightning_ran_none(module, words, wrong):
    kept = Reports()
    _, said = fit(module(), [GradHealthCallback(on_problem="warn", sinks=[kept], log=False)], steps=4)
    if module is _NoneStep:  # premise: nothing reached any parameter, at every check
        assert all(set(r.status.values()) == {gh.Status.NO_GRAD} for r in kept.reports)
    [no_grad] = [s for s in said if "NO_GRAD" in s]
    assert words in no_grad and wrong not in no_grad
