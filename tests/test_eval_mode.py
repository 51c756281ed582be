"""Eval mode judged where the forward really ran: inner models, any submodule; the frozen-BatchNorm
idiom recognised as intended."""

import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.features(x))


def freeze_bn(model):
    """The fine-tuning idiom of detection/vision codebases: BN in eval with frozen affine."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
            m.weight.requires_grad_(False)
            m.bias.requires_grad_(False)


def test_frozen_batchnorm_backbone_is_silent_under_raise():
    torch.manual_seed(0)
    model = Backbone()
    freeze_bn(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2, momentum=0.9)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        for _ in range(8):
            model.train()
            freeze_bn(model)  # what train() undid, done again, as the idiom does
            opt.zero_grad()
            x = torch.randn(4, 3, 8, 8)
            nn.functional.cross_entropy(model(x), torch.randint(0, 3, (4,))).backward()
            reports.append(mon.check())
            opt.step()
    assert all(r.ok for r in reports)
    [note] = reports[0].findings_of("FROZEN_NORM")
    assert note.level == "info" and set(note.params) == {"features.1", "features.4"}
    assert not any(r.findings_of("FROZEN_NORM") for r in reports[1:])  # said once
    assert not any(r.findings_of("GRAD_MODE") for r in reports)


def norm_eval(model):
    """The detection-backbone idiom (mmdet's norm_eval=True): every BatchNorm in eval, affine
    parameters still trainable, dropout and the rest in train mode."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


class WithDropout(Backbone):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.head(self.drop(self.features(x)))


def run(model, steps=30, seed=0, at=None, **kw):
    """``steps`` SGD steps over 4 fixed batches; ``at(step)`` runs before each step's forward."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mon = gh.GradHealth(model, opt, **kw)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    reports, losses = [], []
    for step in range(steps):
        if at is not None:
            at(step)
        x, y = data[step % 4]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        reports.append(mon.check(loss=loss))
        opt.step()
        losses.append(loss.item())
    return reports, losses


def test_norm_eval_with_trainable_affine_is_said_once_at_info_under_raise():
    torch.manual_seed(0)
    model = WithDropout()
    model.train()
    norm_eval(model)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(not m.training and m.weight.requires_grad for m in bns) and model.drop.training  # the premise
    before = [m.running_mean.clone() for m in bns]
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        reports, losses = run(model, on_problem="raise")
    assert losses[-1] < losses[0]  # healthy: it learns
    assert all(torch.equal(b, m.running_mean) for b, m in zip(before, bns))  # statistics really frozen
    assert all(r.ok and not r.findings_of("GRAD_MODE") for r in reports)
    notes = [f for r in reports for f in r.findings_of("FROZEN_NORM")]
    assert len(notes) == 1 and notes[0].level == "info" and "norm_eval / freeze_bn_stats" in notes[0].message
    assert notes[0].params == ("features.1", "features.4")
    assert all(r.status[n] is gh.Status.OK for r in reports for n in ("features.1.weight", "features.4.bias"))


def test_qat_freeze_bn_stats_late_in_training_is_silent_under_raise():
    from torch.ao.nn.intrinsic.qat import freeze_bn_stats
    from torch.ao.quantization import fuse_modules_qat, get_default_qat_qconfig, prepare_qat

    torch.manual_seed(0)
    model = Backbone().train()
    model = fuse_modules_qat(model, [["features.0", "features.1", "features.2"], ["features.3", "features.4", "features.5"]])
    model.qconfig = get_default_qat_qconfig("x86")
    prepare_qat(model, inplace=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        # PyTorch's QAT recipe: freeze the BN statistics late in training
        reports, losses = run(model, steps=40, seed=1, on_problem="raise",
                              at=lambda step: model.apply(freeze_bn_stats) if step == 25 else None)
    bns = [m.bn for m in model.modules() if hasattr(m, "freeze_bn")]
    assert len(bns) == 2 and all(not b.training and b.weight.requires_grad for b in bns)  # the premise
    assert sum(losses[-4:]) < sum(losses[:4])
    assert all(r.ok for r in reports)
    notes = [(r.step, f) for r in reports for f in r.findings_of("FROZEN_NORM")]
    assert [s for s, _ in notes] == [25] and notes[0][1].level == "info"


@pytest.mark.parametrize("how, named", [("model", ()), ("dropout", ("drop",)), ("child", ("features",))])
def test_eval_mode_of_the_model_a_child_or_dropout_stays_an_error_beside_norm_eval(how, named):
    torch.manual_seed(0)
    model = WithDropout().train()
    norm_eval(model)
    {"model": model, "dropout": model.drop, "child": model.features}[how].eval()
    reports, _ = run(model, steps=2, on_problem="ignore")
    [f] = reports[0].findings_of("GRAD_MODE")
    assert f.level == "error" and "model.train()" in f.message
    if how == "model":
        assert "the model was in eval() mode" in f.message
    else:
        assert tuple(p for p in f.params if p in ("drop", "features")) == named
    assert not reports[0].findings_of("FROZEN_NORM")  # not called an idiom beside a real eval() mistake


class Inner(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), *([nn.Dropout(0.1)] if dropout else []), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("dropout, named", [(True, "model.body.2"), (False, "model")])
def test_lightning_inner_model_left_in_eval_is_flagged(dropout, named):
    import lightning.pytorch as pl

    from gradhealth.integrations.lightning import GradHealthCallback
    from gradhealth.demos.lightning_parts import SyntheticData

    class Wrapper(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Inner(dropout)

        def training_step(self, batch, batch_idx):
            self.model.eval()  # the bug: a helper left the inner model in eval
            return nn.functional.cross_entropy(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    cb = GradHealthCallback(on_problem="ignore", log=False)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(Wrapper(), SyntheticData(n_batches=4))
    [f] = cb.last_report.findings_of("GRAD_MODE")
    assert named in f.params and "model.train()" in f.message


# ------------------------------------------ eval() that changes nothing (nothing reads `training`)


class Noisy(nn.Module):
    """A user module whose own forward branches on ``self.training`` (no dropout, no norm)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        x = self.lin(x)
        return x + 0.1 * torch.randn_like(x) if self.training else x


class Sampling(nn.Module):
    """Reads ``training`` one call down, in a method of its own (as InstanceNorm does)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def _maybe_drop(self, x):
        return nn.functional.dropout(x, 0.5, self.training)

    def forward(self, x):
        return self._maybe_drop(self.lin(x))


FLAT, SEQ, CHANNELS = (5, 6), (5, 3, 6), (5, 6, 3)  # the input shapes: features; (seq, batch, features); (N, C, L)
MODULES = {
    "Linear": (lambda: nn.Linear(6, 6), FLAT), "ReLU": (nn.ReLU, FLAT), "GroupNorm": (lambda: nn.GroupNorm(2, 6), FLAT),
    "LayerNorm": (lambda: nn.LayerNorm(6), FLAT), "Dropout(0)": (lambda: nn.Dropout(0.0), FLAT),
    "Dropout(0.3)": (lambda: nn.Dropout(0.3), FLAT), "BatchNorm1d": (lambda: nn.BatchNorm1d(6), FLAT),
    "BatchNorm1d(no stats)": (lambda: nn.BatchNorm1d(6, track_running_stats=False), FLAT),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(6), CHANNELS),
    "InstanceNorm1d(stats)": (lambda: nn.InstanceNorm1d(6, track_running_stats=True), CHANNELS),
    "LSTM(dropout 0)": (lambda: nn.LSTM(6, 6, num_layers=2), SEQ),
    "LSTM(dropout 0.5)": (lambda: nn.LSTM(6, 6, num_layers=2, dropout=0.5), SEQ),
    "MultiheadAttention(0)": (lambda: nn.MultiheadAttention(6, 2), SEQ),
    "MultiheadAttention(0.5)": (lambda: nn.MultiheadAttention(6, 2, dropout=0.5), SEQ),
    "TransformerEncoderLayer(0)": (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0), SEQ),
    "TransformerEncoderLayer(0.1)": (lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0.1), SEQ),
    "Noisy": (Noisy, FLAT), "Sampling": (Sampling, FLAT),
}


def _differs(make, shape) -> bool:
    """The oracle: does the module compute something else in eval() than in train(), from the same
    input and the same random state?"""
    torch.manual_seed(0)
    m, x = make(), torch.randn(shape)
    outs = []
    for train in (True, False):
        torch.manual_seed(1)
        with torch.no_grad():
            out = m.train(train)(*([x] * 3 if isinstance(m, nn.MultiheadAttention) else [x]))
        outs.append(out[0] if isinstance(out, tuple) else out)
    return not torch.equal(*outs)


@pytest.mark.parametrize("name", list(MODULES))
def test_which_modules_the_mode_matters_for_is_decided_from_their_code_as_running_them_shows(name):
    from gradhealth.judge.guards import mode_matters

    make, shape = MODULES[name]
    assert mode_matters(make()) is _differs(make, shape), name


def _sequential_run(eval_mode: bool, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    if eval_mode:
        model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gh.GradHealth(model, opt, **kw)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(1, keepdim=True)
    reports, losses = [], []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        reports.append(mon.check(loss=loss))
        opt.step()
        losses.append(loss.item())
    mon.close()
    return model, reports, losses


def test_eval_on_a_model_nothing_in_which_reads_the_mode_is_a_warning_not_an_error():
    """``nn.Sequential(Linear, ReLU, Linear).eval()`` while training (a model the user may not be
    able to change: a library put it in eval()): training is bit-identical to train() mode, so
    gradhealth says what it saw and does not stop the run."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model, reports, losses = _sequential_run(True, on_problem="raise")
    reference, _, ref_losses = _sequential_run(False, on_problem="ignore")
    assert not model.training and losses[-1] < 0.5 * losses[0]  # premise: in eval() the whole run, and it learns
    assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    [f] = reports[0].findings_of("GRAD_MODE")
    assert f.level == "warning" and "the model was in eval() mode" in f.message
    assert "Not taken as an error: nothing that ran in this forward reads `training`" in f.message
    assert all(r.ok for r in reports)
    assert any("GRAD_MODE" in str(w.message) for w in seen)  # said, not raised


@pytest.mark.parametrize("extra, reader", [(nn.Dropout(0.2), "2"), (nn.BatchNorm1d(16), "2"), (Noisy, "2")])
def test_eval_on_a_model_with_dropout_batch_norm_or_a_training_branch_in_the_forward_stays_an_error(extra, reader):
    torch.manual_seed(0)
    if extra is Noisy:
        extra = Noisy()
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), extra, nn.Linear(6, 1)).eval()
    else:
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), extra, nn.Linear(16, 1)).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)).backward()
    with pytest.raises(gh.GradHealthError, match="GRAD_MODE") as raised:
        mon.check()
    assert f"{reader} ran in eval() mode, so dropout is off" in str(raised.value)
    assert "Not taken as an error" not in str(raised.value)
