"""A small LightningModule with plantable bugs, and a synthetic data module (no downloads).

Used by the demo (``gradhealth demo``), the LightningCLI configs in ``configs/`` and the tests.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["DemoModule", "SyntheticData", "BUGS"]

BUGS = (
    "none",
    "detached",
    "frozen",
    "not_in_optimizer",
    "division_by_zero",
    "missing_zero_grad",
    "lr_zero",
    "all_masked",
    "mask_after_divide",
    "where_overflow",
    "nan_batch",
    "eval_mode",
)


class SyntheticData(pl.LightningDataModule):
    """A learnable toy task: the class is the argmax of a fixed random projection of x."""

    def __init__(self, n_batches: int = 16, batch_size: int = 32, d_in: int = 16, n_classes: int = 4, seed: int = 0):
        super().__init__()
        self.n_batches, self.batch_size, self.d_in, self.n_classes, self.seed = n_batches, batch_size, d_in, n_classes, seed

    def _dataset(self, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        proj = torch.randn(self.d_in, self.n_classes, generator=torch.Generator().manual_seed(self.seed))
        x = torch.randn(self.n_batches * self.batch_size, self.d_in, generator=g)
        return TensorDataset(x, (x @ proj).argmax(dim=1))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(self.seed + 1), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(self.seed + 2), batch_size=self.batch_size)


class _Standardize(nn.Module):
    """Divide by the batch std, then mask the constant features: after the division."""

    def forward(self, h):
        std = h.std(dim=0, keepdim=True)
        z = (h - h.mean(dim=0, keepdim=True)) / std
        return torch.where(std > 0, z, torch.zeros_like(z))


class _Softplus(nn.Module):
    """log(1 + exp(x)) with torch.where replacing the overflowed values: after the fact."""

    def forward(self, x):
        e = x.exp()
        return torch.where(torch.isinf(e), x, e.log1p())


class DemoModule(pl.LightningModule):
    """A 3-layer classifier; ``bug`` plants one classic mistake (see ``BUGS``).

    Args:
        bug: which mistake to plant.
        nan_batch: for ``bug="nan_batch"``, the batch index whose loss divides by zero.
    """

    def __init__(self, bug: str = "none", d_in: int = 16, hidden: int = 32, n_classes: int = 4, lr: float = 0.1,
                 weight_decay: float = 0.0, nan_batch: int = 2, dropout: float = 0.0):
        super().__init__()
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {', '.join(repr(b) for b in BUGS)}; got {bug!r}")
        self.save_hyperparameters()
        if bug == "eval_mode":  # eval() must change what the forward computes for the bug to be real
            dropout = max(dropout, 0.1)
        self.encoder = nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, n_classes)
        self.norm = _Standardize() if bug == "mask_after_divide" else nn.Identity()
        self.act = _Softplus() if bug == "where_overflow" else nn.Identity()
        if bug == "frozen":
            self.encoder[0].requires_grad_(False)

    def forward(self, x):
        h = self.encoder(x)
        if self.hparams.bug == "mask_after_divide":
            h = h * (torch.arange(h.shape[1], device=h.device) != 0)  # feature 0 off: its std is 0
        if self.hparams.bug == "where_overflow":
            h = h * 100
        return self.head(self.act(self.norm(h)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        bug = self.hparams.bug
        if bug == "detached":
            out = out.detach()
        if bug == "all_masked":
            valid = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
            loss = nn.functional.cross_entropy(out[valid], y[valid])
        elif bug == "division_by_zero":
            weight = torch.ones(out.shape[0], device=out.device)
            weight[0] = 0.0
            loss = (nn.functional.cross_entropy(out, y, reduction="none") / weight).mean()
        elif bug == "nan_batch" and batch_idx == self.hparams.nan_batch:
            # a per-sample weight of 0 divided by, then masked after the division: the loss is
            # finite, its gradient is NaN (only on this one batch)
            per = nn.functional.cross_entropy(out, y, reduction="none")
            den = torch.ones_like(per)
            den[0] = 0.0
            loss = torch.where(den != 0, per / den, torch.zeros_like(per)).mean()
        else:
            loss = nn.functional.cross_entropy(out, y)
        self.log("train_loss", loss.detach(), prog_bar=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def on_train_batch_start(self, batch, batch_idx):
        if self.hparams.bug == "eval_mode":
            self.eval()  # e.g. a validation helper that forgot model.train()

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if self.hparams.bug != "missing_zero_grad":
            optimizer.zero_grad(set_to_none=True)

    def configure_optimizers(self):
        lr = 0.0 if self.hparams.bug == "lr_zero" else self.hparams.lr
        params = self.encoder.parameters() if self.hparams.bug == "not_in_optimizer" else self.parameters()
        return torch.optim.SGD(params, lr=lr, weight_decay=self.hparams.weight_decay)
