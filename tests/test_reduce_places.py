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
    """The bare module's gradients differ at check 0, and torch.optim.SGD's step reduces nothing: named
    there, before the step applies them (no reduction to come is guessed); the fresh DDP's steps agree."""
    ranks = spawn("jxmnop_alternating_ddp", tmp_path)
    assert ranks[0]["drift"][0] is True and ranks[0]["drift"][1] is False  # premise: drift, then re-broadcast
    reps = ranks[0]["reports"]
    assert "GRAD_SYNC" not in kinds(reps[0])
    for k in (0, 2):  # the bare steps
        [f] = [f for f in reps[k]["findings"] if f[0] == "GRAD_DISAGREE"]
        assert f[2] == "error" and set(f[1]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert reps[1]["ok"] and reps[3]["ok"]  # DDP's
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


def test_modded_nanogpt_healthy_loop_is_silent_under_raise(tmp_path):
    """The port of modded-nanogpt's loop (tests/moddednanogpt_port.py): Adam's gradients all-reduced by
    hand, Muon's inside its step. Check 0 holds only lm_head's gradient (zero-initialised lm_head and
    projections): equal on both ranks, it says nothing of Muon; check 1 says Muon reduces in its step."""
    ranks = spawn("modded_nanogpt_ok", tmp_path)
    for r in ranks:
        assert r["nonzero_at_0"] == ["lm_head.weight"] and r["head_differs_at_0"] is False  # the premise
        assert r["same"] is True and r["losses"][-1] < 0.2 * r["losses"][0]  # the replicas agree; it learns
        assert len(r["reports"]) == 6 and all(rep["ok"] for rep in r["reports"])
        assert all(f[0] not in ("GRAD_DISAGREE", "DESYNC") for rep in r["reports"] for f in rep["findings"])
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_modded_nanogpt_lm_head_left_out_is_named_at_check_0_where_it_is_alone(tmp_path):
    """lm_head left out of the hand all-reduce: at check 0 it is the only non-zero gradient of Adam's
    groups, so "most of them differ" cannot tell a reduction to come from one that missed it; but
    torch.optim.Adam's step reduces nothing: the gradients differ at check 0, named there."""
    ranks = spawn("modded_nanogpt_head", tmp_path)
    for r in ranks:
        assert r["nonzero_at_0"] == ["lm_head.weight"] and r["head_differs_at_0"] is True  # the premise
    assert ranks[0]["same"] is False  # the replicas drift
    first = ranks[0]["reports"][0]
    [f] = [f for f in first["findings"] if f[0] == "GRAD_DISAGREE"]
    assert f[1] == ["lm_head.weight"] and f[2] == "error" and f[3] == {"lm_head.weight": [1]}
    assert not first["ok"] and "GRAD_SYNC" not in kinds(first)  # (no reduction to come is guessed for Adam)
    assert ranks[0]["reports"] == ranks[1]["reports"]
