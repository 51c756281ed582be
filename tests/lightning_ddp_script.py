"""Lightning's ``Trainer(strategy="ddp")`` on 2 CPU processes, launched as its users launch it
(``python lightning_ddp_script.py OUT CASE...``: the strategy runs this script again for rank 1).
Lightning's own ``BoringModel`` with SGD and the callback under ``on_problem="raise"``; each rank
writes OUT/<case>-<rank>.json with what the test asserts (the premise and the verdict).

Cases: ``accum`` (``accumulate_grad_batches=2``: Lightning runs the first micro-batch of each
window under ``no_sync()`` and the last one, reduced, inside ``optimizer.step(closure)``), ``swa``
(Lightning's ``StochasticWeightAveraging`` on a BoringModel with a batch norm: its last epoch
recomputes the batch-norm statistics, one accumulation window over the whole epoch with no
backward).
"""

import json
import os
import sys
import traceback
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

import gradhealth as gh
from gradhealth.integrations.lightning import GradHealthCallback


class SGDBoring(BoringModel):
    """BoringModel with SGD (its own configure_optimizers adds a StepLR); ``bn``: a batch norm in it
    (Lightning's SWA tests use one), with batches of 4 that batch norm needs."""

    def __init__(self, bn: bool = False):
        super().__init__()
        if bn:
            self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                             torch.nn.Linear(32, 2))
        self.bn = bn
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.losses.append(float(out["loss"]))
        return out

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64), batch_size=4 if self.bn else 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class Reports(Callback):
    """The callback's report after every optimizer step, kept for the test."""

    def __init__(self, watched: GradHealthCallback):
        self.watched, self.seen = watched, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        r = self.watched.last_report
        if r is not None and (not self.seen or self.seen[-1]["step"] != r.step):
            self.seen.append({"step": r.step, "ok": r.ok, "findings": [[f.kind, f.level, list(f.params)] for f in r.findings]})


def fit(case: str) -> dict:
    torch.manual_seed(0)
    model = SGDBoring(bn=case == "swa")
    cb = GradHealthCallback(on_problem="raise")
    keep = Reports(cb)
    callbacks = [cb, keep]
    if case == "swa":
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1))
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=3, limit_train_batches=8,
                         accumulate_grad_batches=2 if case == "accum" else 1, limit_val_batches=0, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    raised = None
    try:
        trainer.fit(model)
    except gh.GradHealthError as exc:
        raised = str(exc)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = trainer.strategy.all_gather(flat)
    return {"raised": raised, "reports": keep.seen, "losses": model.losses, "global_step": trainer.global_step,
            "same": bool(torch.equal(gathered[0], gathered[1])), "rank": trainer.global_rank}


def main(out: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for case in cases:
        try:
            result = fit(case)
        except Exception:
            result = {"error": traceback.format_exc(), "rank": int(os.environ.get("LOCAL_RANK", "0"))}
        with open(os.path.join(out, f"{case}-{result['rank']}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
