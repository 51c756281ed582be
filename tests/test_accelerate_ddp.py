"""The README's Accelerate recipe on 2 CPU processes under torchrun (gloo), checked after every
``accelerator.backward`` inside ``accelerator.accumulate(model)``."""

import json
import os
import sys

import pytest

pytest.importorskip("accelerate")

from conftest import free_port  # noqa: E402
import procs

HERE = os.path.dirname(__file__)


@pytest.mark.slow
def test_accelerate_accumulate_checked_after_every_backward_is_silent(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(HERE, "accelerate_worker.py"), str(tmp_path)]
    res = procs.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    for r in (r0, r1):
        assert r["world"] == 2 and r["ddp"] == "DistributedDataParallel" and r["found_ddp"] is True
        # the micro-steps inside no_sync() are deferred; the synchronising ones are judged healthy
        assert r["checks"] == [None, None, None, [True, True]] * 4
        assert r["said"] == [] and r["same"] is True  # the premise: the replicas agree bit for bit
        assert r["after"] < 0.8 * r["before"]  # it learns (the loss over all the data, 4 steps)
