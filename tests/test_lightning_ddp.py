"""Lightning with strategy="ddp_spawn" on 2 CPU processes: one verdict, logs from rank zero, and a
raise that stops every rank."""

import csv
import glob
import os

import lightning.pytorch as pl
import torch
import pytest
from lightning.pytorch.loggers import CSVLogger

import gradhealth as gh
from gradhealth.integrations.lightning import GradHealthCallback
from gradhealth.demos.lightning_parts import DemoModule, SyntheticData
from conftest import run_spawned

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def trainer(tmp_path, cb, steps=4):
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[cb],
                      logger=CSVLogger(str(tmp_path), name="ddp"), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, log_every_n_steps=1, limit_val_batches=0)


def test_ddp_spawn_logs_from_rank_zero(tmp_path):
    run_spawned(lambda: trainer(tmp_path, GradHealthCallback(), steps=4).fit(DemoModule(bug="not_in_optimizer"),
                                                                              SyntheticData(n_batches=8)),
                fresh=[tmp_path / "ddp"])
    files = glob.glob(os.path.join(str(tmp_path), "ddp", "*", "metrics.csv"))
    assert len(files) == 1  # one run, written by rank zero
    rows = [r for r in csv.DictReader(open(files[0])) if r.get("gradhealth/status/NOT_IN_OPTIMIZER")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert all(float(r["gradhealth/status/NOT_IN_OPTIMIZER"]) == 2.0 for r in rows)


def test_ddp_spawn_raise_stops_every_rank(tmp_path):
    with pytest.raises(Exception) as err:  # re-raised in the launching process; no rank is left hanging
        run_spawned(lambda: trainer(tmp_path, GradHealthCallback(on_problem="raise", expect_frozen=[]), steps=4).fit(
            DemoModule(bug="frozen"), SyntheticData(n_batches=8)))
    assert "GradHealthError" in repr(err.value) or isinstance(err.value, gh.GradHealthError)
    assert "UNEXPECTED_FROZEN" in str(err.value)


class NaNOnRank1(DemoModule):
    """DemoModule's nan_batch bug on rank 1 only (each rank sees its own shard of the data)."""

    def training_step(self, batch, batch_idx):
        if self.global_rank != 1 and batch_idx == self.hparams.nan_batch:
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y)
        return super().training_step(batch, batch_idx)


class Origins:
    """A sink that writes each rank's NONFINITE_ORIGIN findings to a file (ddp_spawn ranks are processes)."""

    def __init__(self, out):
        self.out = out

    def write(self, report):
        import json
        import torch.distributed as dist

        found = [[f.message, f.data.get("reproduced"), f.data.get("rank"), f.data.get("batch_idx")]
                 for f in report.findings_of("NONFINITE_ORIGIN") if "reproduced" in f.data]
        if found:  # (one file per rank and step: a relaunch by run_spawned writes the same files again)
            with open(os.path.join(self.out, f"rank{dist.get_rank()}-step{report.step}.json"), "w") as f:
                f.write(json.dumps({"step": report.step, "found": found}))


def test_ddp_spawn_nan_on_one_rank_gets_one_origin_verdict_on_every_rank(tmp_path):
    import json

    cb = GradHealthCallback(on_problem="ignore", skip_nonfinite=True, sinks=[Origins(str(tmp_path))])
    run_spawned(lambda: trainer(tmp_path, cb, steps=4).fit(NaNOnRank1(bug="nan_batch", nan_batch=2),
                                                           SyntheticData(n_batches=8)))
    got = [[json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / f"rank{r}-step*.json")))] for r in (0, 1)]
    assert got[0] == got[1]  # the same verdict on both ranks
    [at] = got[0]
    assert at["step"] == 2
    [[message, reproduced, rank, batch_idx]] = at["found"]
    assert reproduced is True and rank == 1 and batch_idx == 2
    assert message.startswith("on rank 1: batch 2 at step 2: it reproduced") and "did NOT" not in message


def test_a_relaunch_leaves_one_run_behind(tmp_path):
    """run_spawned's retry (after gloo's teardown abort) starts from an empty log folder: the relaunched
    fit's logs are the only ones there, so the one-run assertions above hold after a retry too."""
    from torch.multiprocessing.spawn import ProcessExitedException

    logs, tries = tmp_path / "ddp", []

    def fit():
        tries.append(1)
        (logs / f"version_{len(list(logs.glob('version_*'))) if logs.exists() else 0}").mkdir(parents=True)
        if len(tries) == 1:
            raise ProcessExitedException("process 1 terminated with signal SIGABRT", 1, 0, -6, "SIGABRT")

    run_spawned(fit, fresh=[logs])
    assert len(tries) == 2 and [p.name for p in logs.iterdir()] == ["version_0"]


# ---------------------------------------------------------------- strategy="ddp", launched as users launch it
# (tests/lightning_ddp_script.py: Lightning's BoringModel with SGD, the callback under on_problem="raise")
_LAUNCHED: dict = {}


def launched(tmp_path_factory) -> dict:
    """Both ranks' results of each case, from one launch per test session."""
    import json
    import procs
    import sys

    from conftest import free_port

    if not _LAUNCHED:
        out = tmp_path_factory.mktemp("lddp")
        here = os.path.dirname(__file__)
        env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
        proc = procs.run([sys.executable, os.path.join(here, "lightning_ddp_script.py"), str(out), "accum", "swa"],
                         env=env, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for case in ("accum", "swa"):
            _LAUNCHED[case] = [json.load(open(out / f"{case}-{r}.json")) for r in (0, 1)]
    for ranks in _LAUNCHED.values():
        for r in ranks:
            assert "error" not in r, r.get("error")
    return _LAUNCHED


def test_ddp_with_accumulation_is_silent_under_raise(tmp_path_factory):
    """``accumulate_grad_batches=2``: Lightning runs the window's first micro-batch under ``no_sync()``
    and the last one inside ``optimizer.step(closure)``, reduced: every step consumed reduced gradients.
    (Before: DDP_NOT_SYNCED at every step, on both ranks: the step's pre-hook ran before its closure.)"""
    ranks = launched(tmp_path_factory)["accum"]
    for r in ranks:
        assert r["raised"] is None and r["global_step"] == 12  # 3 epochs of 8 batches, 2 a step
        assert r["same"] is True  # the premise: the replicas are identical after the fit
        assert sum(r["losses"][-4:]) < 0.5 * sum(r["losses"][:4])  # and it learns
        assert len(r["reports"]) == 12 and all(rep["ok"] and not rep["findings"] for rep in r["reports"])
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_ddp_with_stochastic_weight_averaging_is_silent_under_raise(tmp_path_factory):
    """Lightning's SWA on a model with batch norm: its added last epoch runs every batch's forward with no
    backward (one accumulation window under ``no_sync()``, the last forward synchronised); the step at
    its end still holds the previous epoch's reduced gradients. (Before: DDP_NOT_SYNCED at that step.)"""
    ranks = launched(tmp_path_factory)["swa"]
    for r in ranks:
        assert r["raised"] is None and r["global_step"] == 25  # 3 epochs of 8 steps, and SWA's batch-norm epoch
        assert r["same"] is True
        assert sum(r["losses"][16:24]) < 0.7 * sum(r["losses"][:8])  # epoch 2 against epoch 0
        assert len(r["reports"]) == 25 and all(rep["ok"] for rep in r["reports"])
        assert not r["reports"][-1]["findings"]  # SWA's batch-norm epoch's step: nothing said of it
        # The one thing said, at info, is true of any run of this model: layer.0.bias is a Linear's bias right
        # before the batch norm, whose gradient is zero in exact arithmetic (the norm takes the mean away), so a
        # step the change test samples may leave it exactly unchanged (its update below the weights' precision).
        # The dense update-norm cadence (checks 0, 1, 2, 4, ...) samples steps 1, 2 and 4 too.
        said = [f for rep in r["reports"] for f in rep["findings"]]
        assert all(f == ["NOT_UPDATED", "info", ["layer.0.bias"]] for f in said), said
    assert ranks[0]["reports"] == ranks[1]["reports"]
