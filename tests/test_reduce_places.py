"""Where the replicas are reduced, inferred per optimizer and verified inside the step it concerns,
on 2 gloo ranks (tests/reduce_workers.py): modded-nanogpt's loop and TrainCheck's jxmnop loop."""

import pytest

from test_distributed import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def kinds(report):
    return [f[0] for f in report["findings"]]


def test_modded_nanogpt_reducing_in_two_places_is_silent_under_raise(tmp_path):
    ranks = spawn("nanogpt_two_places_ok", tmp_path)
    for r in ranks:
        assert r["same"] is True and sum(r["losses"][-3:]) < 0.8 * sum(r["losses"][:3])  # premise: in step, learning
        assert all(rep["ok"] for rep in r["reports"]) and len(r["reports"]) == 10
    assert [kinds(rep) for rep in ranks[0]["reports"]][0] == ["GRAD_SYNC"]  # Muon's, said once at info
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_modded_nanogpt_lm_head_left_out_of_the_manual_all_reduce_is_named_at_check_0(tmp_path):
    ranks = spawn("nanogpt_two_places_head", tmp_path)
    assert ranks[0]["same"] is False  # premise: the replicas drift
    first = ranks[0]["reports"][0]
    [f] = [f for f in first["findings"] if f[0] == "GRAD_DISAGREE"]
    assert f[1] == ["lm_head.weight"] and f[2] == "error"  # Adam's own evidence: embed agrees, lm_head does not
    assert "GRAD_SYNC" in kinds(first)  # Muon's gradients: reduced inside its step
    assert "DESYNC" in kinds(ranks[0]["reports"][1])
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_jxmnop_drift_of_a_bare_step_is_named_before_the_fresh_ddp_hides_it(tmp_path):
    ranks = spawn("jxmnop_alternating_ddp", tmp_path)
    assert ranks[0]["drift"][0] is True and ranks[0]["drift"][1] is False  # premise: drift, then re-broadcast
    reps = ranks[0]["reports"]
    assert "GRAD_SYNC" in kinds(reps[0])
    [f] = [f for f in reps[1]["findings"] if f[0] == "DESYNC"]
    assert f[2] == "error" and set(f[1]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_one_optimizer_reducing_its_groups_in_two_places_is_silent_under_raise(tmp_path):
    ranks = spawn("one_optimizer_two_places_ok", tmp_path)
    for r in ranks:
        assert r["same"] is True and sum(r["losses"][-3:]) < 0.8 * sum(r["losses"][:3])  # premise: in step, learning
        assert all(rep["ok"] for rep in r["reports"]) and len(r["reports"]) == 10
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_a_param_group_reduced_by_hand_is_judged_on_its_own_evidence(tmp_path):
    """One optimizer whose groups are reduced in two places: the hand-reduced group's own evidence
    (embed agrees, lm_head does not) names lm_head at check 0, although most of the optimizer's
    gradients (the blocks', reduced inside its step) differ."""
    ranks = spawn("one_optimizer_two_places_head", tmp_path)
    assert ranks[0]["same"] is False  # premise: the replicas drift
    first = ranks[0]["reports"][0]
    [f] = [f for f in first["findings"] if f[0] == "GRAD_DISAGREE"]
    assert f[1] == ["lm_head.weight"] and f[2] == "error"
    assert ranks[0]["reports"] == ranks[1]["reports"]
