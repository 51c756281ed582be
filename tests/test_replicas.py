"""Replicas as real code runs them, on 2 gloo ranks: gradients reduced inside the optimizer (no
DDP wrapper), a hand-made all-reduce that misses one gradient, nanoGPT's require_backward_grad_sync
with a bug on one rank, and the lockstep counts."""

import pytest

from test_distributed import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def kinds(report):
    return [f[0] for f in report["findings"]]


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_reduction_inside_the_optimizer_is_silent_under_raise(tmp_path, mode):
    ranks = spawn(f"in_optimizer_{mode}", tmp_path)
    for r in ranks:
        assert r["same"] is True  # the premise: the replicas are bit-identical at the end
        assert sum(r["losses"][-3:]) < 0.5 * sum(r["losses"][:3])  # and they learn
        assert len(r["reports"]) == 20 and all(rep["ok"] for rep in r["reports"])
    said = [rep for rep in ranks[0]["reports"] if "GRAD_SYNC" in kinds(rep)]
    if mode == "auto":  # said once, at info, at the first check
        assert said == [ranks[0]["reports"][0]]
        [f] = [f for f in said[0]["findings"] if f[0] == "GRAD_SYNC"]
        assert f[2] == "info"
    else:
        assert said == []
    assert all("GRAD_DISAGREE" not in kinds(rep) for r in ranks for rep in r["reports"])
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_a_rank_whose_optimizer_skips_one_reduction_is_named_at_the_next_check(tmp_path):
    ranks = spawn("in_optimizer_drift", tmp_path)
    assert ranks[0]["same"] is False  # the premise: the replicas drifted
    reps = ranks[0]["reports"]
    assert all("DESYNC" not in kinds(rep) for rep in reps[:4])  # steps 0-2 reduce everything
    # step 3 (after check 3) left 2.weight out of rank 1's reduction: check 4 names it
    for rep in reps[4:]:
        [f] = [f for f in rep["findings"] if f[0] == "DESYNC"]
        assert f[1] == ["2.weight"] and f[3] == {"2.weight": [1]} and f[2] == "error"
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_a_gradient_left_out_of_a_manual_all_reduce_is_named_exactly(tmp_path):
    ranks = spawn("manual_missing", tmp_path)
    assert ranks[0]["reports"] == ranks[1]["reports"]
    for rep in ranks[0]["reports"]:
        [f] = [f for f in rep["findings"] if f[0] == "GRAD_DISAGREE"]
        assert f[1] == ["2.bias"] and "GRAD_SYNC" not in kinds(rep)


def test_a_manual_all_reduce_before_the_check_is_silent_under_raise(tmp_path):
    ranks = spawn("manual_ok", tmp_path)
    for r in ranks:
        assert r["same"] is True and all(rep["ok"] for rep in r["reports"]) and len(r["reports"]) == 8
        assert all("GRAD_SYNC" not in kinds(rep) for rep in r["reports"])
        assert sum(r["losses"][-2:]) < sum(r["losses"][:2])


def test_nanogpt_accumulation_under_ddp_is_silent(tmp_path):
    ranks = spawn("nanogpt_ok", tmp_path)
    for r in ranks:
        assert all(rep is not None and rep["ok"] for rep in r["reports"])
        assert sum(r["losses"][-2:]) < sum(r["losses"][:2])


def test_one_rank_skipping_its_sync_is_named_within_one_check(tmp_path):
    ranks = spawn("nanogpt_bug", tmp_path)
    r0, r1 = ranks[0]["reports"], ranks[1]["reports"]
    assert r1[3] is None  # the premise: rank 1 deferred its check at iteration 3 (no sync) and stepped
    # rank 0's check of iteration 3 met rank 1's of iteration 4 in the collective: both stop there
    assert r0[-1]["raised_at"] == 3 and r1[-1]["raised_at"] == 4 and len(r0) == 4 and len(r1) == 5
    named = r0[-1]
    [lock] = [f for f in named["findings"] if f[0] == "LOCKSTEP"]
    assert lock[2] == "error" and lock[3] == [1]
    [lost] = [f for f in named["findings"] if f[0] == "DDP_NOT_SYNCED"]
    assert lost[3] == [1]  # the cause, on the rank that had it
    assert named["findings"] == r1[-1]["findings"]  # the same verdict on both ranks
    assert all(rep["ok"] for rep in r0[:3])


def test_one_rank_skipping_an_optimizer_step_is_named_at_the_next_check(tmp_path):
    ranks = spawn("nanogpt_skip_step", tmp_path)
    r0, r1 = ranks[0]["reports"], ranks[1]["reports"]
    assert all(rep["ok"] for rep in r0[:4]) and len(r0) == len(r1) == 5  # both raise at check 4 together
    assert r0[-1]["raised_at"] == r1[-1]["raised_at"] == 4
    [lock] = [f for f in r0[-1]["findings"] if f[0] == "LOCKSTEP"]
    assert lock[3] == [1] and [f for f in r1[-1]["findings"] if f[0] == "LOCKSTEP"] == [lock]
    assert "NOT_UPDATED" in kinds(r1[-1])  # (and rank 1 itself says its step did not run)
    assert "DDP_NOT_SYNCED" not in kinds(r0[-1])  # its gradients were reduced: it only skipped the step


def _fell(losses):
    return sum(losses[-3:]) < 0.7 * sum(losses[:3])


@pytest.mark.parametrize("idiom", ["ddp", "in_optimizer"])
def test_a_rank_that_skips_one_check_is_named_at_that_check(tmp_path, idiom):
    ranks = spawn(f"skipped_check_rank1_{idiom}", tmp_path)
    r0, r1 = ranks[0]["reports"], ranks[1]["reports"]
    assert 5 not in ranks[1]["called"] and 5 in ranks[0]["called"]  # the premise: only rank 1 skipped the call
    assert all(r0[str(i)]["ok"] and r1[str(i)]["ok"] for i in range(5))
    # rank 0 raised in its check, rank 1 in optimizer.step(): the check its loop skipped was joined
    # from there, so neither waits in a collective the other never enters (no gloo abort, no hang)
    assert r0["5"]["raised_at"] == r1["5"]["raised_at"] == 5 and len(r0) == len(r1) == 6
    assert r1["5"]["in_step"] and not r0["5"]["in_step"]
    [lock] = [f for f in r0["5"]["findings"] if f[0] == "LOCKSTEP"]
    assert lock[2] == "error" and lock[3] == [1]
    assert r0["5"]["findings"] == r1["5"]["findings"]  # the same verdict on both ranks
    assert r0["5"]["status"] == r1["5"]["status"] and r0["5"]["total"] == pytest.approx(r1["5"]["total"], rel=1e-12)


def test_a_rank_that_skips_one_check_under_warn_trains_on(tmp_path):
    ranks = spawn("skipped_check_rank1_warn", tmp_path)
    r0, r1 = ranks[0]["reports"], ranks[1]["reports"]
    assert r1["5"]["from_step"] and len(r0) == len(r1) == 16
    for i in range(16):  # named at that check only; the counts stay in step after it
        want = [["LOCKSTEP", [], "error", [1], None]] if i == 5 else []
        assert r0[str(i)]["findings"] == r1[str(i)]["findings"] == want
    for r in ranks:
        assert r["same"] is True and _fell(r["losses"])  # DDP kept the replicas together; they learn


def test_a_skipped_call_that_every_n_steps_would_skip_is_silent(tmp_path):
    ranks = spawn("skipped_check_rank1_gated", tmp_path)
    assert 5 not in ranks[1]["called"]
    for r in ranks:  # every_n_steps=2: checks 0, 2, ... 14 on both ranks, all healthy under raise
        assert sorted(map(int, r["reports"])) == list(range(0, 16, 2)) and all(rep["ok"] for rep in r["reports"].values())
        assert r["same"] is True and _fell(r["losses"])


@pytest.mark.parametrize("idiom", ["ddp", "in_optimizer"])
def test_a_call_every_rank_skips_is_the_loops_cadence(tmp_path, idiom):
    ranks = spawn(f"skipped_check_every_{idiom}", tmp_path)
    for r in ranks:
        assert 5 not in r["called"] and len(r["reports"]) == 16 and r["same"] is True and _fell(r["losses"])
        assert all(rep["ok"] for rep in r["reports"].values())  # silent under raise
        [said] = [f for rep in r["reports"].values() for f in rep["findings"] if f[0] == "LOCKSTEP"]
        assert said[2] == "info" and r["reports"]["5"]["from_step"]
    assert ranks[0]["reports"] == ranks[1]["reports"]


@pytest.mark.parametrize("idiom", ["ddp", "in_optimizer"])
def test_every_check_called_is_silent(tmp_path, idiom):
    ranks = spawn(f"skipped_check_none_{idiom}", tmp_path)
    for r in ranks:
        assert len(r["called"]) == len(r["reports"]) == 16 and r["same"] is True and _fell(r["losses"])
        assert all(rep["ok"] and not rep.get("from_step") for rep in r["reports"].values())
        assert all(f[0] == "GRAD_SYNC" for rep in r["reports"].values() for f in rep["findings"])


def test_a_grad_scalers_first_overflow_under_ddp_is_silent_under_raise(tmp_path):
    """fp16 AMP's settling on DDP: the scaler skips the first optimizer.step(), so the first step
    interval holds two checks; one check per step after that is the loop's cadence, not a skip."""
    ranks = spawn("skipped_check_none_amp", tmp_path)
    for r in ranks:
        assert r["scaler_skipped"][0] and not any(r["scaler_skipped"][1:5])  # the premise: it skipped step 0 only, early on
        assert len(r["called"]) == 16 and r["same"] is True and _fell(r["losses"])
        assert all(rep["ok"] for rep in r["reports"].values())  # silent under raise
        said = [f for rep in r["reports"].values() for f in rep["findings"]]
        assert not [f for f in said if f[0] == "LOCKSTEP"]  # the shorter cadence is learnt without a word
        rank = [f for f in said if f[0] == "NONFINITE_RANK"]  # the scaler's overflow: where it began, at info
        assert rank and all(f[2] == "info" for f in rank)
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_a_rank_that_skips_one_check_under_a_grad_scaler_is_named(tmp_path):
    ranks = spawn("skipped_check_rank1_amp", tmp_path)
    assert ranks[0]["scaler_skipped"][0] and 5 not in ranks[1]["called"]  # premise: a settling scaler, then the skip
    r0, r1 = ranks[0]["reports"], ranks[1]["reports"]
    assert r0["5"]["raised_at"] == r1["5"]["raised_at"] == 5 and r1["5"]["in_step"]
    [lock] = [f for f in r0["5"]["findings"] if f[0] == "LOCKSTEP"]
    assert lock[2] == "error" and lock[3] == [1] and r0["5"]["findings"] == r1["5"]["findings"]


def test_huge_finite_gradients_are_not_a_nonfinite_rank(tmp_path):
    """The rank-origin hook reads each gradient's largest |element| before DDP's all-reduce: a
    2-norm of finite elements overflows (1e25 squared), and it named a rank for a NaN it never made."""
    ranks = spawn("huge_finite", tmp_path)
    for r in ranks:
        assert r["finite"] and r["norm_overflows"]  # the premise
        assert r["report"]["ok"] and set(r["report"]["status"].values()) == {"OK"}
        assert not [f for f in r["report"]["findings"] if f[0] in ("NONFINITE_RANK", "NONFINITE_COLLECTIVE")]


def test_nanochat_zero_projections_and_gains_are_silent_from_check_0(tmp_path):
    """nanochat's loop on 2 ranks, the gradients reduced inside the optimizer: at check 0 the
    zero-initialised projections leave exactly-zero gradients behind them (equal on both ranks, no
    evidence either way); the inference still says 'reduced inside the optimizer', nothing raises."""
    ranks = spawn("nanochat_ok", tmp_path)
    for r in ranks:
        # the premise: check 0 has gradients that are exactly zero on every rank
        assert "transformer.h.0.attn.c_q.weight" in r["zero_at_0"] and "smear_gate.weight" in r["zero_at_0"]
        assert r["same"] is True and len(r["reports"]) == 20
        assert r["losses"][-1] < 0.7 * r["losses"][0]  # and it learns
        assert all(rep["ok"] and "raised_at" not in rep for rep in r["reports"])
        assert all(f[0] not in ("GRAD_DISAGREE", "DESYNC") for rep in r["reports"] for f in rep["findings"])
    [said] = [f for f in ranks[0]["reports"][0]["findings"] if f[0] == "GRAD_SYNC"]
    assert said[2] == "info"
    assert ranks[0]["reports"] == ranks[1]["reports"]


def test_nanochat_a_rank_whose_optimizer_drifts_is_desync_at_the_next_check(tmp_path):
    ranks = spawn("nanochat_drift", tmp_path)
    assert ranks[0]["same"] is False  # the premise: rank 1 stepped lm_head on its own gradient from step 3
    reps = ranks[0]["reports"]
    assert all("DESYNC" not in kinds(rep) for rep in reps[:4])
    [f] = [f for f in reps[4]["findings"] if f[0] == "DESYNC"]
    assert f[1] == ["lm_head.weight"] and f[3] == {"lm_head.weight": [1]} and f[2] == "error"
    assert ranks[0]["reports"] == ranks[1]["reports"]


@pytest.mark.parametrize("case", ["module", "before", "none"])
def test_a_forward_that_bypasses_ddp_is_named_within_two_checks(tmp_path, case):
    """TrainCheck's bug: the loop calls ``ddp.module(x)``; the monitor holds the module (made before
    or after the wrapper). ``none``: no wrapper at all and no reduction anywhere: torch.optim.AdamW's
    step reduces nothing, so the gradients that differ at check 0 are named there too."""
    ranks = spawn(f"ddp_bypassed_{case}", tmp_path)
    assert ranks[0]["same"] is False  # the premise: the replicas drifted apart
    reps = ranks[0]["reports"]
    first = next(k for k, rep in enumerate(reps) if any(f[2] == "error" for f in rep["findings"]))
    assert first <= 1
    [f] = [f for f in reps[first]["findings"] if f[0] in ("GRAD_DISAGREE", "DESYNC")]
    assert set(f[1]) == {"0.weight", "0.bias", "2.weight", "2.bias"} and all(v == [1] for v in f[3].values())
    assert first == 0 and f[0] == "GRAD_DISAGREE"
    if case != "none":  # the wrapper is found from the module: with the lost synchronisation
        assert "DDP_NOT_SYNCED" in kinds(reps[0])
    else:
        assert "GRAD_SYNC" not in kinds(reps[0])
    assert ranks[0]["reports"] == ranks[1]["reports"]


@pytest.mark.parametrize("where", ["every", "after"])
def test_a_last_micro_step_under_no_sync_is_ddp_not_synced_on_every_rank(tmp_path, where):
    """Every micro-step of the window under ``no_sync()``, the last one too: DDP never reduces, each
    rank steps on its own gradients. The checks inside the window wait for a synchronising micro-step
    the loop does not have; after the first such step the next check is made at once, on every rank,
    and names it (error, with the replicas that drifted), under raise on both ranks together."""
    ranks = spawn(f"never_synced_{where}", tmp_path)
    for r in ranks:
        assert r["drift"][0] is True  # the premise: the first step moved the replicas apart
        raised = r["reports"][-1]
        assert raised["raised_at"] == 1  # named at the first check after that step
        assert all(rep is None for rep in r["reports"][:-1])  # (before it, the checks waited)
        [lost] = [f for f in raised["findings"] if f[0] == "DDP_NOT_SYNCED"]
        assert lost[2] == "error" and lost[3] == [0, 1]
        [apart] = [f for f in raised["findings"] if f[0] == "DESYNC"]
        assert apart[2] == "error" and set(apart[1]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert "GRAD_DISAGREE" not in kinds(raised)  # (the gradients checked are the window's own, not compared)
    assert ranks[0]["reports"][-1]["findings"] == ranks[1]["reports"][-1]["findings"]


def test_gradients_reduced_by_hand_after_no_sync_are_said_not_an_error(tmp_path):
    """The same loop, the gradients all-reduced by hand before each step: DDP reduced nothing, the loop
    did, and the replicas stay together: said at warning (what was seen), nothing raises."""
    ranks = spawn("never_synced_by_hand", tmp_path)
    for r in ranks:
        assert not any(r["drift"]) and r["after"] < 0.8 * r["before"]  # the premise: together, learning
        said = [rep for rep in r["reports"] if rep is not None]
        assert len(said) == 5 and all(rep["ok"] and "raised_at" not in rep for rep in said)
        for rep in said:
            [lost] = [f for f in rep["findings"] if f[0] == "DDP_NOT_SYNCED"]
            assert lost[2] == "warning" and "DESYNC" not in kinds(rep)
    assert ranks[0]["reports"] == ranks[1]["reports"]
