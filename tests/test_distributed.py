"""Real multi-process torch.distributed runs (spawn, gloo, a free port, a timeout on each test)."""

import json
import os

import pytest

from conftest import free_port
import dist_workers
import procs
from test_deferred import same

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


HERE = os.path.dirname(os.path.abspath(__file__))
# What a rank imports (torch, torch.distributed, gradhealth, the workers, FSDP2 and DTensor), imported
# once in multiprocessing's fork server; each rank is forked from it: a fresh process that has run
# nothing yet (the server only imports), without the seconds of CPU a spawned rank spends importing
# (two ranks a test, about a hundred tests). The server forks, so it holds no thread (OMP_NUM_THREADS=1).
# torch._dynamo: DDP's constructor and the optimizers import it at first use (about 0.8 s of CPU a rank).
PRELOAD = ["dist_workers", "replica_workers", "mesh_workers", "clip_workers", "accum_workers", "reduce_workers",
           "nanochat_port", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.device_mesh", "torch.nn.parallel", "torch._dynamo", "torch.profiler._cupti_monitor",
           "torch.distributed.algorithms.ddp_comm_hooks",
           # (gradhealth's public names load at first use: loaded here, not again in every rank)
           *(f"gradhealth.{m}" for m in ("monitor", "brief", "classify", "replay", "testing", "trace", "history"))]


def _fork_server():
    """The fork server, started with the workers preloaded (Python 3.11's server takes no sys.path:
    tests/ on its PYTHONPATH while it starts; the ranks get this process's sys.path anyway)."""
    import multiprocessing
    import multiprocessing.forkserver as forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE] + ([before] if before else []))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def spawn(scenario, tmp_path, world=2, limit=180):
    _fork_server()
    ctx = procs.spawn(dist_workers.run, args=(world, free_port(), str(tmp_path), scenario), nprocs=world,
                      start_method="forkserver")
    if not procs.join(ctx, limit):  # (killed on a hang, a failure, a timeout or Ctrl-C)
        pytest.fail(f"{scenario}: the ranks did not finish in {limit}s (a hang)")
    out = []
    for r in range(world):
        data = json.load(open(os.path.join(str(tmp_path), f"{r}.json")))
        assert "error" not in data, data.get("error")
        out.append(data)
    return out


def test_same_verdict_unused_and_partly_used(tmp_path):
    ranks = spawn("verdict", tmp_path)
    assert ranks[0]["reports"] == ranks[1]["reports"]  # statuses, norms, findings: identical
    r = ranks[0]["reports"][0]
    assert r["status"]["c.weight"] == "NO_GRAD" and r["status"]["c.bias"] == "NO_GRAD"  # unused everywhere
    assert r["status"]["b.weight"] == "OK"
    partly = [f for f in r["findings"] if f[0] == "PARTIALLY_USED"]
    assert partly and set(partly[0][1]) == {"b.weight", "b.bias"} and partly[0][4] == [1] and partly[0][2] == "info"


def test_nan_traced_to_the_rank_that_produced_it(tmp_path):
    ranks = spawn("nan_rank1", tmp_path)
    assert ranks[0]["report"] == ranks[1]["report"]
    r = ranks[0]["report"]
    assert r["status"]["0.weight"] == "NON_FINITE_GRAD" and r["status"]["2.bias"] == "OK"  # d(sum)/d(bias) stays finite
    origin = [f for f in r["findings"] if f[0] == "NONFINITE_RANK"]
    assert origin and origin[0][3] == [1]


def test_desync_names_parameter_and_rank(tmp_path):
    ranks = spawn("desync", tmp_path)
    kinds = [[f[0] for f in rep["findings"]] for rep in ranks[0]["reports"]]
    assert "DESYNC" not in kinds[0]  # first check: in sync
    assert "DESYNC" in kinds[3]  # check 3 (every 3 checks) after rank 1 changed 1.bias at step 2
    f = next(f for f in ranks[0]["reports"][3]["findings"] if f[0] == "DESYNC")
    assert f[1] == ["1.bias"] and f[3] == {"1.bias": [1]}
    assert ranks[0]["reports"][3]["findings"] == ranks[1]["reports"][3]["findings"]


def test_raise_on_all_ranks_together(tmp_path):
    ranks = spawn("raise", tmp_path)
    assert ranks[0]["raised"] and ranks[1]["raised"]
    assert "GRAD_MODE" in ranks[0]["message"] and "rank 1" in ranks[0]["message"]


def test_no_sync_checks_are_deferred(tmp_path):
    ranks = spawn("no_sync", tmp_path)
    for r in ranks:
        assert r["deferred"] == [True, True, False] and r["final_ok"]


def test_sharded_norms_equal_the_unsharded_model(tmp_path):
    ranks = spawn("sharded", tmp_path)
    for r in ranks:
        assert set(r["grad_norm"]) == set(r["ref"])
        for name, ref in r["ref"].items():
            assert abs(r["grad_norm"][name] - ref) <= 1e-5 * max(ref, 1e-12), (name, r["grad_norm"][name], ref)
        assert abs(r["total"] - r["ref_total"]) <= 1e-5 * r["ref_total"]
        for name, expected in r["lr_times_grad"].items():  # SGD: ||Δθ|| = lr * ||g||, over all shards
            assert abs(r["update"][name] - expected) <= 1e-4 * expected, (name, r["update"][name], expected)
    assert ranks[0]["status2"] == ranks[1]["status2"]
    assert ranks[0]["status2"]["2.weight"] == "OK"  # zero on rank 0's shard only: not ZERO_GRAD
    assert ranks[0]["status2"]["2.bias"] == "NON_FINITE_GRAD"  # NaN in one shard: non-finite everywhere
    assert ranks[0]["status2"]["0.weight"] == "NO_GRAD"


def test_fsdp1_flat_shards_reduce_to_the_unsharded_norms(tmp_path):
    ranks = spawn("fsdp1", tmp_path)
    for r in ranks:
        assert set(r["status"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # the wrapped module's names
        assert set(r["status"].values()) == {"OK"}
        for name, ref in r["ref"].items():
            assert abs(r["grad_norm"][name] - ref) <= 1e-5 * ref, (name, r["grad_norm"][name], ref)


def test_a_check_that_fails_on_one_rank_does_not_hang_the_others(tmp_path):
    ranks = spawn("local_failure", tmp_path, limit=120)
    for r in ranks:
        assert r["report"] is False  # every rank skipped this check, none is stuck in the collective
        assert any("failed on rank(s) [1]" in s for s in r["said"]) or r is ranks[1]
    assert any("planted failure" in s for s in ranks[1]["said"])


def _kinds(report):
    return [f[0] for f in report["findings"]]


@pytest.mark.parametrize("case", ["roundtrip", "around", "bucket"])
def test_replicas_whose_gradients_differ_are_named_at_once(tmp_path, case):
    ranks = spawn(f"replicas_{case}", tmp_path)
    assert ranks[0]["reports"] == ranks[1]["reports"]  # one verdict on every rank
    first = ranks[0]["reports"][0]
    [disagree] = [f for f in first["findings"] if f[0] == "GRAD_DISAGREE"]
    assert disagree[2] == "error" and not first["ok"]
    if case == "bucket":  # part of one bucket: the parameters whose gradients were damaged, on rank 1
        assert disagree[1] and set(disagree[1]) < set(first["status"])
        assert all(v == [1] for v in disagree[3].values())
        assert "DDP_NOT_SYNCED" not in _kinds(first)  # rank_origin=False: no hook of ours to see it
    else:  # nothing was averaged: every parameter differs, and the lost synchronisation is named
        assert set(disagree[1]) == set(first["status"])
        [lost] = [f for f in first["findings"] if f[0] == "DDP_NOT_SYNCED"]
        assert lost[3] == [0, 1]
    if case == "around":  # only the step that bypassed the wrapper
        assert all(f[0] not in ("GRAD_DISAGREE", "DDP_NOT_SYNCED") for r in ranks[0]["reports"][1:] for f in r["findings"])


@pytest.mark.parametrize("case", ["roundtrip_fixed", "around_fixed", "bucket_fixed"])
def test_the_fixed_replicas_are_silent_under_raise(tmp_path, case):
    ranks = spawn(f"replicas_{case}", tmp_path)
    for r in ranks:
        assert len(r["reports"]) == 3 and all(rep.get("ok") for rep in r["reports"]), r["reports"]


def test_a_nan_made_by_the_collective_names_the_communication_and_the_rank(tmp_path):
    ranks = spawn("replicas_nan_collective", tmp_path)
    first = ranks[0]["reports"][0]
    assert ranks[0]["reports"][0] == ranks[1]["reports"][0]
    [f] = [f for f in first["findings"] if f[0] == "NONFINITE_COLLECTIVE"]
    assert f[3] == [1] and f[2] == "error"
    assert "NONFINITE_RANK" not in _kinds(first)  # no rank produced it before the all-reduce


def test_healthy_ddp_with_unused_parameters_and_bf16_is_silent(tmp_path):
    ranks = spawn("healthy_replicas", tmp_path)
    for r in ranks:
        assert r["errors"] == [[]] * 6


def test_healthy_fsdp2_is_silent_its_shards_are_not_compared(tmp_path):
    ranks = spawn("fsdp2_healthy", tmp_path)
    for r in ranks:
        assert r["ok"] == [True] * 4
        # fully_shard keeps the module's own names (it swaps the class, adds no wrapper module)
        assert r["names"] == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]


def test_a_nan_on_one_rank_is_skipped_by_every_rank_together(tmp_path):
    ranks = spawn("skip_rank1", tmp_path)
    for r in ranks:
        assert r["skipped"] == [None, None, None, [3, [1]], None, None]  # step 3, produced on rank 1
        assert all(r["finite"]) and r["steps"] == [5.0] * 4  # 6 steps, one dropped: 5 updates
    assert ranks[0]["params"] == ranks[1]["params"]  # the replicas stay identical


def test_a_deferred_check_that_fails_on_one_rank_does_not_hang_the_others(tmp_path):
    ranks = spawn("deferred_failure", tmp_path, limit=120)
    for r in ranks:  # checks 1 (failed at launch) and 3 (at completion) skipped by every rank, the others judged
        assert r["returned"] == [None, [0, True], None, [2, True], None, [4, True]], r
        assert r["last"] == [5, True]
        assert sum("failed on rank(s) [1]" in s for s in r["said"]) == 2, r["said"]
        assert r["losses"][-1] < r["losses"][0]  # (DDP trained on: a healthy run whose loss falls)
    assert any("planted failure at launch" in s for s in ranks[1]["said"])
    assert any("planted failure at completion" in s for s in ranks[1]["said"])


def test_a_deferred_launch_that_fails_on_one_rank_after_its_observation_joins_flagged(tmp_path):
    ranks = spawn("deferred_late_failure", tmp_path, limit=120)
    for r in ranks:  # checks 1 and 3 skipped by every rank together; the others judged
        assert r["returned"] == [None, 0, None, 2, None, 4], r
        assert sum("failed on rank(s) [1]" in s for s in r["said"]) == 2, r["said"]
        assert r["finite"]  # step 3's NaN step skipped everywhere: rank 1 decided its guard from its gradients
    assert ranks[0]["params"] == ranks[1]["params"]  # the replicas stay identical
    said = ranks[1]["said"]
    assert any("planted failure after the observation" in s for s in said) and any("planted failure at launch" in s
                                                                                 for s in said)


def test_a_check_whose_bookkeeping_fails_on_one_rank_does_not_hang_the_others(tmp_path):
    ranks = spawn("early_failure", tmp_path, limit=120)
    for r in ranks:
        sync, late = r["0"], r["1"]
        assert sync["returned"] == [[0, True], None, [2, True], [3, True]], sync
        assert late["returned"] == [None, [0, True], None, [2, True]] and late["last"] == [3, True], late
        for run in (sync, late):
            assert sum("failed on rank(s) [1]" in s for s in run["said"]) == 1, run["said"]
    assert all(any("planted early failure" in s for s in ranks[1][lag]["said"]) for lag in "01")


def test_deferred_checks_give_every_rank_the_synchronous_reports(tmp_path):
    ranks = spawn("deferred", tmp_path)
    for r in ranks:
        sync, late = r["0"], r["1"]
        assert sync["returned"] == list(range(6)) and late["returned"] == [None, *range(5)]
        # one collective per check, made when the check completes (norms accumulated in float64: within 1e-6);
        # the tracer armed by step 3's NaN says it did not recur a step later when deferred (it watched step 5)
        traced = lambda reports: [rep["step"] for rep in reports for f in rep["findings"] if f[:3] == [  # noqa: E731
            "NONFINITE_ORIGIN", [], "info"]]
        untraced = lambda reports: [{**rep, "findings": [f for f in rep["findings"] if f[:3] != [  # noqa: E731
            "NONFINITE_ORIGIN", [], "info"]]} for rep in reports]
        assert same(untraced(late["reports"]), untraced(sync["reports"]))
        assert traced(sync["reports"]) == [4] and traced(late["reports"]) == [5]
    assert ranks[0]["1"]["reports"] == ranks[1]["1"]["reports"]
    first = ranks[0]["0"]["reports"][0]
    assert set(first["status"].values()) == {"OK", "NOT_IN_OPTIMIZER"}
    poisoned = [rep for rep in ranks[0]["0"]["reports"] if rep["step"] == 3][0]
    kinds = {f[0] for f in poisoned["findings"]}
    assert "STEP_SKIPPED" in kinds and "NONFINITE_RANK" in kinds
