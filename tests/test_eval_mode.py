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


def test_batchnorm_in_eval_with_trainable_affine_is_still_an_error():
    torch.manual_seed(0)
    model = Backbone()
    model.features[4].eval()  # left in eval by mistake, its affine parameters still train
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    model(torch.randn(4, 3, 8, 8)).sum().backward()
    r = mon.check()
    [f] = r.findings_of("GRAD_MODE")
    assert f.level == "error" and f.params == ("features.4",)


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
    from gradhealth.integrations.lightning_demo import SyntheticData

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
