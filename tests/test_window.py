"""An accumulation window as its checks saw it (gradhealth/measure/window.py): the deferred checks' losses and
valid counts kept on the device and read with the check that ends the window; the findings about a
micro-batch inside it. The runs: DDP's accumulation on 2 gloo ranks and an
engine's accumulation on one process (tests/accum_workers.py); DeepSpeed's is tests/test_deepspeed.py."""

import math

import pytest
import torch

from gradhealth.judge.micro_batches import findings
from gradhealth.measure.window import Seen, Window, quiet_row


def _window(losses, counts=None):
    """A window of deferred calls: ``losses`` per micro-batch (None: no loss given), ``counts`` per
    micro-batch ({name: count}, or None)."""
    w = Window()
    for k, loss in enumerate(losses):
        valid = {n: torch.tensor(c) for n, c in (counts[k] if counts else {}).items()}
        w.add(None if loss is None else torch.tensor(loss), valid)
    return w


def test_the_window_keeps_each_deferred_calls_loss_and_counts_in_order():
    w = _window([0.5, None, math.nan], [{"tokens": 3}, {}, {"tokens": 0}])
    taken = w.take()
    assert w.take() is None  # (a fresh window in its place)
    losses, counts = taken.parts({"tokens": torch.tensor(5)})  # the check that ends it: micro-batch 3
    assert [t.item() for t in losses][0] == 0.5 and math.isnan(losses[1].item())
    assert [t.item() for t in counts["tokens"]] == [3, 0, 5]
    seen = taken.seen([t.item() for t in losses], {"tokens": [3.0, 0.0, 5.0]}, {"tokens": None})
    assert seen.micro == 4 and [k for k, _ in seen.bad] == [2] and seen.empty == {"tokens": [2]}
    assert seen.sums == {"tokens": 8} and seen.notable
    assert seen.row(["tokens"])[:2] == [4.0, 2.0] and seen.row(["tokens"])[3] == 2.0


def test_a_window_empty_as_a_whole_is_left_to_the_usual_finding():
    seen = Seen(2, [], {"tokens": [0, 1]}, {"tokens": 0})
    assert not seen.notable and seen.row(["tokens"])[3] == -1.0
    assert quiet_row(["a", "b"]) == [1.0, -1.0, 0.0, -1.0, -1.0]


def test_the_loss_of_a_micro_batch_is_named_with_its_rank_and_place():
    rows = [quiet_row(["tokens"]), [2.0, 0.0, math.nan, -1.0]]
    [f] = findings(rows, ["tokens"], 5, False, True)
    assert f.kind == "NON_FINITE_LOSS" and f.level == "error" and f.data["ranks"] == [1]
    assert f.data["micro_batches"] == {1: 0} and f.data["window"] == 2
    assert "micro-batch 1 of 2 on rank 1" in f.message and "ends at step 5" in f.message
    # one process: no rank named
    [f] = findings([[3.0, 1.0, math.inf]], [], 2, False, False)
    assert "micro-batch 2 of 3 of the accumulation window" in f.message and "rank" not in f.message


def test_an_empty_micro_batch_is_the_cause_of_its_nan_loss():
    rows = [[2.0, 0.0, math.nan, 0.0]]  # micro-batch 0 empty, its loss NaN: one finding, the emptiness
    [f] = findings(rows, ["tokens"], 3, False, False)
    assert f.kind == "EMPTY_VALID_SET" and f.level == "error" and "'tokens'" in f.message and "nan" in f.message
    # a guarded mean (a finite loss) in a window whose gradients are finite added nothing: said, not an error
    [f] = findings([[2.0, -1.0, 0.0, 0.0]], ["tokens"], 3, True, False)
    assert f.kind == "EMPTY_VALID_SET" and f.level == "warning" and "Not taken as an error" in f.message
    # the same with non-finite gradients: an error
    [f] = findings([[2.0, -1.0, 0.0, 0.0]], ["tokens"], 3, False, False)
    assert f.level == "error"


# ------------------------------------------------------------------ real runs (spawned gloo ranks)
from test_distributed import spawn  # noqa: E402


def _kinds(report):
    return [f[0] for f in report["findings"]]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tracked", [False, True])
def test_a_nan_loss_inside_a_ddp_window_is_named_with_its_rank_and_micro_batch(tmp_path, tracked):
    """nanoGPT's accumulation under DDP, the check after every backward: rank 1's first micro-batch of
    iteration 2 selects no token (a token mean: 0/0). The window's check names it: the NaN loss, or
    with ``track_valid`` the empty selection, on rank 1, micro-batch 1 of 2; the same on both ranks."""
    ranks = spawn("nan_in_window_tracked" if tracked else "nan_in_window", tmp_path)
    assert ranks[1]["nan_at"] == [2, 0] and ranks[0]["nan_at"] is None  # the premise: there, and only there
    reports = [[rep for rep in r["reports"] if rep is not None] for r in ranks]
    assert reports[0] == reports[1]
    assert [rep["step"] for rep in reports[0]] == [0, 1, 2]  # one report per window, at its end
    assert all(rep["ok"] for rep in reports[0][:2])
    at = reports[0][2]
    kind = "EMPTY_VALID_SET" if tracked else "NON_FINITE_LOSS"
    [f] = [f for f in at["findings"] if f[0] == kind and f[5] is not None]
    assert f[2] == "error" and f[3] == [1] and f[5] == {"1": 0}
    if tracked:
        assert at["valid"] == {"tokens": 48} and "NON_FINITE_LOSS" not in _kinds(at)  # (the window's count)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_nan_loss_inside_an_engines_window_on_one_process(tmp_path):
    """An engine's own accumulation (3 micro-batches) on one process: the NaN loss of the window's
    second micro-batch is named at the window's end, without a rank."""
    [r] = spawn("engine_window", tmp_path, world=1)
    reps = r["reports"]
    assert [rep is None for rep in reps] == [True, True, False, True, True, False]  # the premise: windows of 3
    assert reps[2]["ok"]
    [f] = [f for f in reps[5]["findings"] if f[0] == "NON_FINITE_LOSS"]
    assert f[2] == "error" and f[5] == {"0": 1}
    [message] = [m for m in reps[5]["messages"] if m.startswith("the loss was nan")]
    assert "micro-batch 2 of 3 of the accumulation window that ends at step 1" in message and "rank" not in message
