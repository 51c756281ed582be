"""The cross-rank reduction as a pure function: per-rank vectors summed in-process, against
hand-computed global numbers (the spawned tests in test_distributed.py run the real collective)."""

import math

import torch

from gradhealth.ranks import crossrank
from gradhealth.measure.deltas import StepStats
from gradhealth.measure.observe import Observation


def obs(norms, loss, valid, upd, stale=False, sharded=()):
    o = Observation([0, 1, 2], list(norms), loss=loss, valid=valid, sharded=set(sharded))
    u = StepStats([0, 1], torch.zeros(0))
    u.set_triple(list(upd))
    o.updates = [u]
    o.stale = {0} if stale else set()
    return o


def reduce(ranks, pre=None):
    world = len(ranks)
    packed = [crossrank.pack_rank(o, r, world, pre[r] if pre else None) for r, o in enumerate(ranks)]
    lay = packed[0][1]
    summed = torch.stack([v for v, _ in packed]).sum(0)
    mine = ranks[0]
    return crossrank.combine(summed, lay, mine, world), mine


def test_replicated_gradients_average_and_flags_combine():
    # DDP: replicated gradients are equal on every rank; a zero here and non-zero there is not zero
    a = obs([3.0, 0.0, None], 2.0, {"tokens": 4}, [0.1, 0.2, 1.0, 2.0, 1.0, 0.0], stale=True)
    b = obs([3.0, 0.0, None], 4.0, {"tokens": 0}, [0.1, 0.2, 1.0, 2.0, 0.0, 0.0])
    across, o = reduce([a, b])
    assert across.failed == 0
    assert o.norm_of == [3.0, 0.0, None]
    assert o.loss == 3.0  # mean over ranks
    assert o.valid == {"tokens": 4} and across.empty_masks == {"tokens": 2.0}  # rank 1's bit
    assert across.stale_mask == 1.0  # rank 0's bit
    u = o.updates[0].triple()
    assert u[:4] == [0.1, 0.2, 1.0, 2.0] and u[4:] == [1.0, 0.0]  # changed anywhere -> changed


def test_an_undecided_change_on_any_rank_stays_undecided():
    a = obs([1.0, 1.0, None], None, {}, [0.1, 0.2, 1.0, 2.0, math.nan, 1.0])
    b = obs([1.0, 1.0, None], None, {}, [0.1, 0.2, 1.0, 2.0, 0.0, 0.0])
    _, o = reduce([a, b])
    changed = o.updates[0].changed
    assert math.isnan(changed[0]) and changed[1] == 1.0


def test_sharded_gradients_sum_their_squares_and_nonfinite_wins():
    a = obs([3.0, 1.0, 2.0], None, {}, [0.0] * 6, sharded=(0, 1, 2))
    b = obs([4.0, math.inf, None], None, {}, [0.0] * 6, sharded=(0, 1, 2))
    across, o = reduce([a, b])
    assert o.norm_of[0] == 5.0 and o.norm_of[1] == math.inf and o.norm_of[2] == 2.0
    assert o.loss is None


def test_a_tiny_gradient_never_reads_as_zero_and_nan_stays_nan():
    a = obs([1e-200, math.nan, 0.0], None, {}, [0.0] * 6, sharded=(0, 1, 2))
    b = obs([0.0, 1.0, 0.0], None, {}, [0.0] * 6, sharded=(0, 1, 2))
    _, o = reduce([a, b])
    assert 0.0 < o.norm_of[0] and math.isnan(o.norm_of[1]) and o.norm_of[2] == 0.0


def test_failure_flag_and_rank_origin_masks():
    a = obs([1.0, 1.0, 1.0], None, {}, [0.0] * 6)
    b = obs([1.0, 1.0, 1.0], None, {}, [0.0] * 6)
    across, _ = reduce([a, b], pre=[([0.0, 1.0, 0.0], [0.0, 0.0, 1.0]), ([0.0, 1.0, 0.0], [0.0, 0.0, 0.0])])
    assert across.has_pre and across.pre_bad == [0.0, 3.0, 0.0] and across.pre_zero == [0.0, 0.0, 1.0]
    vec, lay = crossrank.pack_rank(a, 1, 2, failed=True)
    assert crossrank.combine(vec, lay, a, 2).failed == 2.0


def test_replicas_that_agree_bit_for_bit_pass_and_a_one_percent_difference_is_caught():
    import random

    rng = random.Random(0)
    for world in (2, 3, 8, 64):
        for _ in range(50):  # identical norms of every magnitude: the float64 rounding never trips the test
            n = [rng.choice([1e-30, 1e-8, 1.0, 3.7e5, 1e20]) * rng.random() for _ in range(3)]
            ranks = [obs(n, None, {}, [0.0] * 6) for _ in range(world)]
            across, _ = reduce(ranks)
            assert across.disagree == [], (world, n)
    same = [2.0, 5.0, 1.0]
    off = [2.0, 5.0 * (1 - 0.005), 1.0]  # 1% of a bucket zeroed: its norm 0.5% lower on one rank
    across, _ = reduce([obs(same, None, {}, [0.0] * 6), obs(off, None, {}, [0.0] * 6)])
    assert across.disagree == [1]
    # sharded gradients are meant to differ; non-finite ones are judged elsewhere
    across, _ = reduce([obs(same, None, {}, [0.0] * 6, sharded=(1,)), obs(off, None, {}, [0.0] * 6, sharded=(1,))])
    assert across.disagree == []
    across, _ = reduce([obs([2.0, math.inf, 1.0], None, {}, [0.0] * 6), obs(off, None, {}, [0.0] * 6)])
    assert across.disagree == [] and across.bad_mask[1] == 1.0  # rank 0's bit


def test_the_vector_grows_by_one_number_per_parameter_and_one_flag():
    o = obs([1.0, 2.0, 3.0], None, {}, [0.0] * 6)
    vec, lay = crossrank.pack_rank(o, 0, 2)
    assert lay.slots["n1"][1] == 3 and "unsynced" in lay
    # the former layout: 6 numbers per parameter, 8 flags, the update triples
    # (+ nosync_step, missed, the lockstep counts; the update grid over the entries; local, window)
    assert vec.numel() == 7 * 3 + 17 + 4 * 3
