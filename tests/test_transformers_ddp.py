"""Hugging Face Trainer under torchrun: 2 CPU processes (gloo), the callback on each rank."""

import json
import os
import sys

import pytest

pytest.importorskip("transformers")

from conftest import free_port  # noqa: E402
import procs

HERE = os.path.dirname(__file__)


_RUNS: dict = {}


def torchrun(tmp_path_factory, mode):
    """Both ranks' results of ``mode``: one torchrun launch per test session runs both modes, each its own
    Trainer, model and callback (tests/hf_ddp_worker.py), one after the other."""
    if not _RUNS:
        out = tmp_path_factory.mktemp("hf_ddp")
        env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE), "OMP_NUM_THREADS": "1"}
        first = None
        for _ in range(2):  # like run_spawned: one retry for the launcher (a port taken meanwhile, a gloo teardown abort)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), os.path.join(HERE, "hf_ddp_worker.py"), str(out), "ok", "bug"]
            res = procs.run(cmd, capture_output=True, text=True, timeout=300, env=env)
            if res.returncode == 0:
                break
            first = first or res
        else:
            raise AssertionError(first.stdout[-3000:] + first.stderr[-3000:])
        for m in ("ok", "bug"):
            _RUNS[m] = [json.load(open(out / f"{m}-rank{r}.json")) for r in (0, 1)]
    return _RUNS[mode]


@pytest.mark.slow
def test_checks_see_the_reduced_pre_clip_gradients_on_every_rank(tmp_path_factory):
    r0, r1 = torchrun(tmp_path_factory, "ok")
    assert r0["world"] == 2 and r0["ddp"] == "DistributedDataParallel"
    # Trainer's grad_norm is over the DDP-averaged gradients (each rank saw different data): the
    # check ran after DDP's reduction finished, before clipping (max_grad_norm=0.1 clips every step)
    assert len(r0["rows"]) == 6
    for step, grad_norm, ours, _ in r0["rows"]:
        assert ours == pytest.approx(grad_norm, rel=1e-5) and ours > 0.1
    assert r0["last"] == r1["last"] and "healthy" in r0["last"]
    assert r0["warnings"] == r1["warnings"] == []
    # metrics go to Trainer's logs on the main process only
    assert all(ours is None for _, _, ours, _ in r1["rows"])


@pytest.mark.slow
def test_every_rank_reaches_the_same_verdict_and_rank_zero_says_it(tmp_path_factory):
    r0, r1 = torchrun(tmp_path_factory, "bug")
    assert r0["last"] == r1["last"] and "4 NOT_IN_OPTIMIZER" in r0["last"]
    assert r0["warnings"][:1] == ["gradhealth step 1: 4 NOT_IN_OPTIMIZER"]  # said once (then only reminders)
    assert not any(w.startswith("gradhealth step 2:") for w in r0["warnings"])
    assert r1["warnings"] == []
