"""Every element counted once on 2-D meshes (gloo ranks on CPU, a tiny Llama-style model): HSDP on
(2, 1), tensor parallel on 2 ranks, FSDP2 + TP on (dp=2, tp=2) as torchtitan applies them; norms and
update norms against the unsharded model in one process, and against DTensor's clip_grad_norm_."""

import pytest

from test_distributed import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = {"hsdp": 2, "hsdp22": 4, "tp": 2, "fsdp_tp": 4}


def close(a, b, rel=1e-5):
    return abs(a - b) <= rel * max(abs(b), 1e-12)


@pytest.mark.parametrize("layout", ["hsdp", "hsdp22", "tp", "fsdp_tp"])
def test_norms_and_updates_equal_the_unsharded_model(tmp_path, layout):
    ranks = spawn(f"mesh_{layout}_healthy", tmp_path, world=WORLD[layout], limit=240)
    ref = ranks[0]["ref"]
    for r in ranks:  # (under raise: a healthy run said nothing)
        assert [g["grad"] for g in r["got"]] == [g["grad"] for g in ranks[0]["got"]]  # one verdict everywhere
        for step, (got, want, upd) in enumerate(zip(r["got"], ref, r["updates"])):
            assert got["ok"] and set(got["grad"]) == set(want["grad"])
            for name, v in want["grad"].items():
                assert close(got["grad"][name], v), (layout, step, name, got["grad"][name], v)
            assert close(got["total"], want["total"])
            assert got["clip"] is None if layout == "tp" else close(got["clip"], want["total"])
            for name, v in want["update"].items():
                assert close(upd[name], v), (layout, step, name, upd[name], v)


@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_a_frozen_tensor_parallel_weight_is_named_on_every_rank(tmp_path, layout):
    ranks = spawn(f"mesh_{layout}_frozen", tmp_path, world=WORLD[layout], limit=240)
    for r in ranks:
        first = r["got"][0]
        assert first["status"]["layers.0.attention.wq.weight"] == "FROZEN"
        [f] = [f for f in first["findings"] if f[0] == "UNEXPECTED_FROZEN"]
        assert f[1] == ["layers.0.attention.wq.weight"] and f[2] == "error"
        assert first["findings"] == ranks[0]["got"][0]["findings"]


def test_a_nan_batch_on_one_data_parallel_rank_is_named_with_its_ranks(tmp_path):
    ranks = spawn("mesh_fsdp_tp_nan", tmp_path, world=4, limit=240)
    for r in ranks:
        bad = r["got"][1]
        assert not bad["ok"] and "NON_FINITE_GRAD" in bad["status"].values()
        [loss] = [f for f in bad["findings"] if f[0] == "NON_FINITE_LOSS"]
        assert loss[3] == [2, 3]  # the data-parallel group 1: ranks 2 and 3 (its two TP ranks)
        assert bad["findings"] == ranks[0]["got"][1]["findings"]


def test_hsdp_replicas_whose_shards_differ_are_named_with_the_rank(tmp_path):
    ranks = spawn("mesh_hsdp22_damaged", tmp_path, world=4, limit=240)
    for r in ranks:
        assert all("GRAD_DISAGREE" not in [f[0] for f in g["findings"]] for g in (r["got"][0], r["got"][2]))
        [f] = [f for f in r["got"][1]["findings"] if f[0] == "GRAD_DISAGREE"]
        # rank 3 holds the same shard as rank 1 (mesh (replicate=2, shard=2): ranks 1 and 3 share shard 1)
        assert f[1] == ["layers.1.feed_forward.w2.weight"] and f[3] == {"layers.1.feed_forward.w2.weight": [3]}
        assert r["got"][1]["findings"] == ranks[0]["got"][1]["findings"]


def test_a_partial_gradient_is_normed_as_its_pending_sum(tmp_path):
    for r in spawn("partial_grad", tmp_path, world=2):
        assert close(r["got"], r["want"]) and not close(r["got"], r["local"])


def test_hsdp_replicas_whose_parameters_drift_are_desync_with_the_rank(tmp_path):
    ranks = spawn("mesh_hsdp22_drifted", tmp_path, world=4, limit=240)
    for r in ranks:
        assert "DESYNC" not in [f[0] for f in r["got"][0]["findings"]]
        for g in r["got"][1:]:  # from the check after it moved on
            [f] = [f for f in g["findings"] if f[0] == "DESYNC"]
            assert f[1] == ["layers.0.ffn_norm.weight"] and f[3] == {"layers.0.ffn_norm.weight": [3]}


@pytest.mark.parametrize("how", ["fsdp2", "ddp"])
def test_stacked_experts_are_judged_per_expert_under_fsdp2_and_ddp(tmp_path, how):
    for r in spawn(f"moe_{how}", tmp_path, world=2):
        assert r["want"][3] == 0.0 and all(v > 0 for v in r["want"][:3])  # the premise: expert 3 got no token
        for got, want in zip(r["got"], r["want"]):
            assert close(got, want) if want else got == 0.0
        assert r["status"] == {"experts[0]": "OK", "experts[1]": "OK", "experts[2]": "OK", "experts[3]": "ZERO_GRAD"}
