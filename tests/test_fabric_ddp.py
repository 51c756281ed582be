"""Fabric's DDP on 2 gloo processes, launched as users launch it (``strategy="ddp"`` with
``fabric.launch()``, which runs the script again; ``"ddp_spawn"`` with ``fabric.launch(fn)``):
tests/fabric_ddp_script.py."""

import json
import os
import sys

import pytest

from conftest import free_port
import procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = os.path.dirname(__file__)
NAMES = ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]


_RUNS: dict = {}


def launched(launch, tmp_path_factory):
    """Both ranks' results of one launch (made once per test session)."""
    if launch not in _RUNS:
        out = tmp_path_factory.mktemp(launch)
        if launch == "ddp":  # the script runs itself again for rank 1
            env = {**os.environ, "MASTER_PORT": str(free_port()),
                   "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
            proc = procs.run([sys.executable, os.path.join(HERE, "fabric_ddp_script.py"), launch, str(out)],
                             env=env, capture_output=True, text=True, timeout=240)
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:  # ``fabric.launch(fn)`` spawns both ranks from this process, as test_lightning_ddp's ddp_spawn fits
            # do (the script's own ``__main__`` makes the same call; a process of its own only to spawn two
            # would import Lightning once more)
            import fabric_ddp_script
            from conftest import run_spawned

            run_spawned(lambda: fabric_ddp_script.spawn(launch, str(out)))
        _RUNS[launch] = [json.load(open(out / f"{launch}-{r}.json")) for r in range(2)]
    ranks = _RUNS[launch]
    for r in ranks:
        for case, v in r.items():
            assert "error" not in v, (case, v["error"])
    return ranks


@pytest.mark.parametrize("launch,case", [("ddp", "inside"), ("ddp", "after"), ("ddp", "before_setup"),
                                         ("ddp", "compiled"), ("ddp_spawn", "inside")])
def test_healthy_accumulating_fabric_ddp_is_silent_under_raise(tmp_path_factory, launch, case):
    """The check after every backward (inside ``no_backward_sync``), just after the block, on a
    monitor made before ``fabric.setup``, and on Fabric's DDP around a compiled model: the
    accumulating micro-steps are deferred (None), every synchronised check is silent."""
    ranks = launched(launch, tmp_path_factory)
    for r in ranks:
        v = r[case]
        assert v["raised"] is None and v["same"] is True and v["ddp_found"] is True
        assert sum(v["losses"][-3:]) < sum(v["losses"][:3])  # it learns
        assert v["names"] == NAMES
        reps = v["reports"]
        assert len(reps) == 16 and reps[0::2] == [None] * 8  # the accumulating micro-steps: deferred
        assert all(rep["ok"] and rep["names"] == NAMES and not rep["findings"] for rep in reps[1::2])
    assert ranks[0][case]["reports"] == ranks[1][case]["reports"]


def test_a_replica_bug_under_fabric_ddp_is_named_on_both_ranks(tmp_path_factory):
    ranks = launched("ddp", tmp_path_factory)
    for r in ranks:
        v = r["bug"]
        assert v["same"] is False  # the premise: rank 1 stepped on a gradient it changed
        for rep in v["reports"][1::2]:
            [f] = [f for f in rep["findings"] if f[0] == "GRAD_DISAGREE"]
            assert f[1] == ["head.weight"] and f[2] == "error" and f[3] == {"head.weight": [1]}
    assert ranks[0]["bug"]["reports"] == ranks[1]["bug"]["reports"]


def test_names_under_fabric_ddp_around_a_compiled_model(tmp_path_factory):
    """``_forward_module._orig_mod.module...`` on the wire: the report, rank 0's warning and its
    TensorBoard tags say ``head.weight``; the verdict is the same on both ranks."""
    ranks = launched("ddp", tmp_path_factory)
    r0, r1 = ranks[0]["head_out"], ranks[1]["head_out"]
    assert r0["report"] == r1["report"] and r0["report"]["names"] == NAMES
    assert [f for f in r0["report"]["findings"] if f[2] == "error"] == []
    assert len(r0["said"]) == 1 and r1["said"] == []  # rank 0 says it
    assert "NOT_IN_OPTIMIZER: head.* (2 params)" in r0["said"][0]
    assert not any(bad in r0["said"][0] for bad in ("_forward_module", "_orig_mod", "module."))
    assert {f"gradhealth/grad_norm/{n}" for n in NAMES} <= set(r0["tags"])
    assert not [t for t in r0["tags"] if "_forward_module" in t or "_orig_mod" in t or "module." in t]
