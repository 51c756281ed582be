"""Each judge from a table of plain values: no model, no tensors."""

import math

import pytest

import gradhealth as gh
from gradhealth.judge import judges
from gradhealth.measure.observe import ForwardRecord

S = gh.Status
K = gh.FindingKind
STATUS = {"enc.0.weight": S.OK, "enc.0.bias": S.OK, "head.weight": S.FROZEN, "head.bias": S.NO_GRAD}


def kinds(found):
    return [(f.kind, f.level) for f in found]


@pytest.mark.parametrize("call, expected", [
    (lambda: judges.loss_cause(None, 3), []),
    (lambda: judges.loss_cause("cut graph", 3), [(K.GRAD_MODE, "error")]),
    (lambda: judges.empty_valid_set({"tokens": 5}, 1.0, [1.0], 3), []),
    (lambda: judges.empty_valid_set({"tokens": 0}, 0.0, [1.0], 3), [(K.EMPTY_VALID_SET, "error")]),
    (lambda: judges.empty_valid_set({}, math.nan, [0.0, 0.0], 3), [(K.EMPTY_VALID_SET, "error")]),
    (lambda: judges.empty_valid_set({}, math.inf, [1.0], 3), [(K.NON_FINITE_LOSS, "error")]),
    (lambda: judges.empty_valid_set({}, None, [], 3), []),
    (lambda: judges.eval_mode(None, 3), []),
    (lambda: judges.eval_mode(ForwardRecord(True, False, False), 3), [(K.GRAD_MODE, "error")]),
    (lambda: judges.stale_grad(STATUS, set(), 3), []),
    (lambda: judges.stale_grad(STATUS, {"enc.0.weight", "not.judged"}, 3), [(K.STALE_GRAD, "error")]),
    (lambda: judges.expect_frozen(STATUS, None, 3), []),
    (lambda: judges.expect_frozen(STATUS, ("head.*",), 3), [(K.UNEXPECTED_TRAINABLE, "error")]),
    (lambda: judges.expect_frozen(STATUS, ("nothing",), 3), [(K.UNEXPECTED_FROZEN, "error")]),
    (lambda: judges.not_updated(STATUS, {}, 3), []),
    (lambda: judges.not_updated(STATUS, {"enc.0.bias": ""}, 3), [(K.NOT_UPDATED, "error")]),
    (lambda: judges.not_updated(STATUS, {"enc.0.bias": "new"}, 3), [(K.NOT_UPDATED, "info")]),
    (lambda: judges.not_updated(STATUS, {"enc.0.bias": "again"}, 3), [(K.NOT_UPDATED, "error")]),
    (lambda: judges.not_updated(STATUS, {"enc.0.bias": "new", "enc.0.weight": ""}, 3),
     [(K.NOT_UPDATED, "info"), (K.NOT_UPDATED, "error")]),
    (lambda: judges.frozen_but_changed(STATUS, ["head.weight"], 3), [(K.FROZEN_BUT_CHANGED, "error")]),
    (lambda: judges.skipped_step(STATUS, dict.fromkeys(STATUS, True), 3), [(K.NOT_UPDATED, "error")]),
    (lambda: judges.skipped_step(STATUS, dict.fromkeys(STATUS, False), 3), []),
    (lambda: judges.skipped_step({**STATUS, "head.bias": S.NON_FINITE_GRAD}, dict.fromkeys(STATUS, True), 3), []),
    (lambda: judges.amp_skip(1024.0, 1, 3, 3), [(K.AMP_SKIPPED, "info")]),
    (lambda: judges.amp_skip(1024.0, 3, 3, 3), [(K.AMP_SKIPPED, "error")]),
    (lambda: judges.amp_floor(0.5, 1.0, 3), [(K.AMP_SKIPPED, "error")]),
    (lambda: judges.amp_floor(2.0, 1.0, 3), []),
])
def test_judge_table(call, expected):
    found = call()
    assert kinds(found) == expected
    assert all(f.step == 3 for f in found)


def test_messages_name_the_parameters_and_modules():
    [f] = judges.stale_grad(STATUS, {"enc.0.weight", "enc.0.bias"}, 7)
    assert f.params == ("enc.0.weight", "enc.0.bias") and "enc.* (2 params)" in f.message
    [f] = judges.eval_mode(ForwardRecord(True, False, True, ("bn1", "drop")), 7, " (on rank 1)")
    assert "bn1, drop" in f.message and "(on rank 1)" in f.message and f.params == ("bn1", "drop")
    [f] = judges.empty_valid_set({"tokens": 0, "pixels": 3}, 0.0, [], 7)
    assert "'tokens'" in f.message and "'pixels'" not in f.message and f.data["counts"] == {"tokens": 0, "pixels": 3}


def test_finding_kind_is_a_str_enum_like_status():
    assert all(k.value == k.name for k in gh.FindingKind)
    f = gh.Finding("STALE_GRAD", "x")
    assert f.kind is gh.FindingKind.STALE_GRAD and f.kind == "STALE_GRAD" and str(f) == "STALE_GRAD: x"
    with pytest.raises(ValueError):
        gh.Finding("NOT_A_KIND", "x")
    with pytest.raises(ValueError, match="level must be one of"):
        gh.Finding("STALE_GRAD", "x", level="fatal")


def test_one_error_base():
    assert issubclass(gh.GradModeError, gh.GradHealthError) and issubclass(gh.GradModeError, RuntimeError)
    assert issubclass(gh.EmptyValidSetError, gh.GradHealthError) and issubclass(gh.EmptyValidSetError, ValueError)
    import torch

    with pytest.raises(gh.GradHealthError):
        gh.masked_mean(torch.ones(3), torch.zeros(3, dtype=torch.bool), empty="raise")
    with pytest.raises(gh.GradHealthError):
        gh.check_loss(1.0)
