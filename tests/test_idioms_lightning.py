"""Lightning's own idioms, as their users write them: manual optimization with clip_gradients,
two optimizers taking turns (toggle_optimizer), accumulate_grad_batches; real Trainer.fit runs."""

import math
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.demos.lightning_parts import DemoModule, SyntheticData
from gradhealth.integrations.lightning import GradHealthCallback
from conftest import CountClips


class Keep:
    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def fit(module, callbacks, steps, data=None, **kw):
    trainer = pl.Trainer(**{"logger": False, **kw}, max_steps=steps, accelerator="cpu", enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data or SyntheticData(n_batches=16))
    return trainer, [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]


class ManualClip(pl.LightningModule):
    """Lightning's manual-optimization recipe with gradient clipping, as its docs write it."""

    def __init__(self, clip=0.1):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.clip = clip
        self.preclip, self.losses = [], []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        # the oracle: the true pre-clip norm, per parameter, naively
        self.preclip.append({n: p.grad.double().norm().item() for n, p in self.named_parameters()})
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        self.losses.append(loss.item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_manual_optimization_with_clip_gradients_reports_preclip_norms():
    torch.manual_seed(0)  # (the data is seeded; the weights too, whatever ran before in this worker)
    module, keep = ManualClip(), Keep()
    cb = GradHealthCallback(on_problem="raise", sinks=[keep], log=False)
    fit(module, [cb], steps=24)
    assert len(keep.reports) == 24 == len(module.preclip)
    total = [math.sqrt(sum(v * v for v in ref.values())) for ref in module.preclip]
    assert min(total) > 0.1  # the premise: the clip bites at every step (post-clip totals would all be 0.1)
    for r, ref, t in zip(keep.reports, module.preclip, total):
        assert r.total_grad_norm == pytest.approx(t, rel=1e-5)
        for n, v in ref.items():
            assert r.grad_norm[n] == pytest.approx(v, rel=1e-5)
        assert not r.findings_of("POSTCLIP")
    assert sum(module.losses[-4:]) < sum(module.losses[:4])  # healthy: it learns


class BareBackward(ManualClip):
    """Manual optimization whose backward bypasses self.manual_backward: only step() is seen."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        nn.functional.cross_entropy(self.net(x), y).backward()
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()


def test_a_check_that_can_only_run_after_the_clip_says_so():
    from gradhealth.integrations.lightning import metrics_of

    keep = Keep()
    fit(BareBackward(), [GradHealthCallback(on_problem="raise", sinks=[keep], log=False)], steps=4)
    assert len(keep.reports) == 4
    for r in keep.reports:
        [f] = r.findings_of("POSTCLIP")
        assert f.level == "info" and "post-clip" in f.message
        assert r.total_grad_norm == pytest.approx(0.1, rel=1e-4)  # what it measured is the clipped norm
        keys = metrics_of(r)
        assert "gradhealth/grad_norm_postclip/total" in keys and not any("preclip" in k for k in keys)


class GAN(pl.LightningModule):
    """Lightning's two-optimizer GAN recipe (toggle_optimizer phases); ``bug`` forgets the
    generator's step or steps the discriminator's optimizer in its place."""

    def __init__(self, bug="none"):
        super().__init__()
        self.automatic_optimization = False
        self.bug = bug
        self.gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.disc = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        x = batch[0][:, :4]
        z = torch.randn_like(x)
        self.toggle_optimizer(opt_d)
        d_loss = nn.functional.softplus(-self.disc(x)).mean() + nn.functional.softplus(self.disc(self.gen(z).detach())).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.toggle_optimizer(opt_g)
        g_loss = nn.functional.softplus(-self.disc(self.gen(z))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        if self.bug == "none":
            opt_g.step()
        elif self.bug == "wrong_optimizer":
            opt_d.step()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), 1e-3), torch.optim.Adam(self.disc.parameters(), 1e-3)


def test_healthy_gan_phases_are_silent_under_raise():
    keep = Keep()
    module = GAN()
    before = [p.detach().clone() for p in module.gen.parameters()]
    fit(module, [GradHealthCallback(on_problem="raise", sinks=[keep], log=False)], steps=40)
    assert all(not torch.equal(a, b) for a, b in zip(before, module.gen.parameters()))  # both train
    assert {r.optimizer_index for r in keep.reports} == {0, 1} and all(r.ok for r in keep.reports)


@pytest.mark.parametrize("bug", ["forgot_step", "wrong_optimizer"])
def test_an_optimizer_that_never_steps_is_named(bug):
    keep = Keep()
    module = GAN(bug)
    before = [p.detach().clone() for p in module.gen.parameters()]
    cb = GradHealthCallback(on_problem="ignore", sinks=[keep], log=False)
    fit(module, [cb], steps=20)
    assert all(torch.equal(a, b) for a, b in zip(before, module.gen.parameters()))  # the premise: G never moves
    named = [r for r in keep.reports if r.findings_of("NOT_STEPPED")]
    assert named, "NOT_STEPPED never said"
    first = named[0]
    # named within grad_patience (3) of the generator's checks, every one after
    g_checks = [r for r in keep.reports if r.optimizer_index == 0]
    assert first is g_checks[3]
    assert all(r.findings_of("NOT_STEPPED") for r in g_checks[3:])
    [f] = first.findings_of("NOT_STEPPED")
    assert f.level == "error" and f.data["optimizer"] == 0 and f.data["class"] == "Adam" and f.data["checks"] == 3
    assert set(f.params) == {n for n, _ in module.named_parameters() if n.startswith("gen.")}
    assert "optimizer 0 (Adam)" in f.message and "gen.*" in f.message
    assert not any(r.findings_of("NOT_STEPPED") for r in keep.reports if r.optimizer_index == 1)


def test_accumulation_replay_names_the_micro_batch_that_made_the_nan():
    keep = Keep()
    module = DemoModule(bug="nan_batch", nan_batch=9)
    cb = GradHealthCallback(on_problem="ignore", sinks=[keep], log=False, skip_nonfinite=True)
    fit(module, [cb], steps=4, accumulate_grad_batches=4)
    [r] = [r for r in keep.reports if not r.grads_finite]  # (the guard keeps the NaN out of the weights)
    assert r.step == 2  # batches 8-11 make optimizer step 2
    [f] = [f for f in r.findings_of("NONFINITE_ORIGIN") if "reproduced" in f.data]
    assert f.data["reproduced"] is True and f.data["batch_idx"] == 9 and f.data["micro_batch"] == 1
    assert "batch 9" in f.message and "micro-batch 2 of the 4" in f.message and "did NOT" not in f.message


def test_accumulation_without_a_nan_is_silent_under_raise_and_learns():
    torch.manual_seed(0)  # (the data is seeded; the weights too, whatever ran before in this worker)
    losses = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    keep = Keep()
    fit(DemoModule(), [GradHealthCallback(on_problem="raise", sinks=[keep], log=False), Losses()], steps=12,
        accumulate_grad_batches=4)
    assert len(keep.reports) == 12 and all(r.ok for r in keep.reports)
    assert sum(losses[-8:]) < sum(losses[:8])


@pytest.mark.parametrize("manual", [False, True])
def test_lightnings_clip_by_norm_uses_the_checks_norms(tmp_path, monkeypatch, manual):
    """gradient_clip_val (automatic) and self.clip_gradients (manual): the same training as without
    the callback, with no second read of the gradients; the clip's factor is logged."""
    from lightning.pytorch.loggers import CSVLogger

    counter = CountClips(monkeypatch)
    runs = []
    for callbacks in ([GradHealthCallback(on_problem="raise")], []):
        torch.manual_seed(0)
        module = ManualClip(clip=0.1) if manual else DemoModule(bug="none")
        before = counter.calls
        logger = CSVLogger(str(tmp_path), name=f"run{len(runs)}")
        trainer, said = fit(module, callbacks, 8, logger=logger, log_every_n_steps=1,
                            **({} if manual else {"gradient_clip_val": 0.1}))
        assert not said and "clip_grad_by_norm" not in vars(trainer.precision_plugin)  # (undone at the end of fit)
        runs.append((module, counter.calls - before, logger))
    (ours, calls, logger), (twin, twin_calls, _) = runs
    # Lightning's own clip reads the gradients at every step; ours: never with gradient_clip_val (the
    # callback knows a clip follows every check), after the first self.clip_gradients under manual optimization
    assert calls == (1 if manual else 0) and twin_calls == 8
    for (name, p), q in zip(ours.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-8), name
    import csv

    rows = [r for r in csv.DictReader(open(os.path.join(logger.log_dir, "metrics.csv"))) if r.get("gradhealth/clip_coef")]
    assert len(rows) == 8 - manual and all(float(r["gradhealth/clip_coef"]) < 1.0 for r in rows)  # the clip bit
    if manual:
        assert ours.losses[-1] < ours.losses[0]


def test_clip_by_value_and_a_module_of_its_own_are_left_to_lightning(monkeypatch):
    counter = CountClips(monkeypatch)
    fit(DemoModule(bug="none"), [GradHealthCallback(on_problem="raise")], 4, gradient_clip_val=0.1,
        gradient_clip_algorithm="value")
    assert counter.calls == 0  # (by value: torch's clip_grad_value_, not ours, not a norm)

    class OwnClip(DemoModule):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)  # the user's own call stays theirs

    fit(OwnClip(bug="none"), [GradHealthCallback(on_problem="raise")], 4, gradient_clip_val=0.1)
    assert counter.calls == 4
