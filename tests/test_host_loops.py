"""The per-parameter picks a check makes in C (``map``/``zip``/``compress`` over ``operator``
functions, so that 1000 parameters cost the Python of 10: tests/test_launch_budget.py) against the
plain per-parameter loops they replace, on random cases: the exact copies taken in turn, a step's
change decisions, the decision tree over a check's entries, and the packing of the numbers read back."""

from __future__ import annotations

import math
import random

import pytest
import torch

import gradhealth as gh
from gradhealth.judge.classify import classify_selection, decide
from gradhealth.measure.compare import in_turn
from gradhealth.measure.stats import joined
from gradhealth.measure.steps import StepStats

S = gh.Status


def _naive_in_turn(wanted, tensors, start, budget):
    chosen, used = [], 0
    for j in range(len(wanted)):
        k = wanted[(start + j) % len(wanted)]
        size = tensors[k].numel()
        if used + size <= budget and tensors[k].is_contiguous():
            chosen.append(k)
            used += size
        elif chosen:
            break
    return chosen


def test_copies_in_turn_agree_with_the_loop():
    rng = random.Random(0)
    for trial in range(3000):
        tensors = []
        for _ in range(rng.randint(1, 12)):
            t = torch.zeros(rng.choice([0, 1, 3, 8, 20]), rng.choice([1, 2, 5]))
            tensors.append(t.t() if rng.random() < 0.2 and min(t.shape) > 1 else t)  # (some not contiguous)
        wanted = sorted(rng.sample(range(len(tensors)), rng.randint(1, len(tensors))))
        start, budget = rng.randrange(len(wanted)), rng.choice([0, 5, 10, 30, 100])
        assert in_turn(wanted, tensors, start, budget) == _naive_in_turn(wanted, tensors, start, budget), trial


def _naive_changed(stats, values):
    n = len(stats.indices)
    changed = [math.nan] * n if stats.touched is None else [math.nan if t else 0.0 for t in stats.touched]
    for j, k in enumerate(stats.flag_pos):
        v = values[j]
        changed[k] = 1.0 if v > 0 else (0.0 if v == 0 and stats.sure[j] else math.nan)
    return changed


def test_change_decisions_agree_with_the_loop():
    rng = random.Random(1)
    same = lambda a, b: len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))  # noqa: E731
    for trial in range(2000):
        n = rng.randint(1, 10)
        touched = None if rng.random() < 0.4 else [rng.random() < 0.7 for _ in range(n)]
        flag_pos = sorted(rng.sample(range(n), rng.randint(0, n))) if rng.random() < 0.6 else list(range(n))
        values = [rng.choice([0.0, 0.0, 1.0, 3.0, math.nan]) for _ in flag_pos]
        measured = rng.random() < 0.5
        values += [rng.random() for _ in range(2 * n)] if measured else []
        stats = StepStats(list(range(n)), torch.zeros(0), touched=touched, flag_pos=flag_pos,
                          sure=[rng.random() < 0.8 for _ in flag_pos], measured=measured)
        want = _naive_changed(stats, values)
        stats.fetched(list(values))
        assert same(stats.changed, want), (trial, stats.changed, want)


def test_the_decision_tree_over_entries_agrees_with_each_parameter_decided_alone():
    rng = random.Random(2)
    for trial in range(1500):
        n = rng.randint(1, 12)
        trainable_share = rng.choice([0.1, 0.85, 1.0])  # (a frozen base model, a few frozen, none)
        params = [torch.nn.Parameter(torch.zeros(2), requires_grad=rng.random() < trainable_share) for _ in range(n)]
        names = [f"m{i}.w" for i in range(n)]
        pids = [id(p) for p in params]
        norms = [rng.choice([None, 0.0, 1.0, 2.5, math.inf, math.nan, 1e-30]) if rng.random() < 0.3 else 1.0
                 for _ in range(n)]
        ids = None if rng.random() < 0.2 else {id(p) for p in params if rng.random() < 0.9}
        idx = sorted(rng.sample(range(n), rng.randint(1, n)))
        dense = [norms[i] for i in idx] if all(norms[i] is not None for i in idx) and rng.random() < 0.8 else None
        inside = (ids is not None and ids.issuperset(pids)) if rng.random() < 0.5 else None  # (as the view knows it)
        # as a deferred check's launch took them, or read now (a freeze since then: the launch's stand)
        requires = [p.requires_grad for p in params] if rng.random() < 0.5 else None
        if requires is not None and rng.random() < 0.3:
            params[rng.randrange(n)].requires_grad_(rng.random() < 0.5)
        status, in_opt, not_ok, frozen = classify_selection(names, params, pids, idx, norms, ids, dense, inside, requires)
        trainable = requires or [p.requires_grad for p in params]
        want = {names[i]: decide(trainable[i], norms[i], ids is None or pids[i] in ids) for i in idx}
        assert status == want, trial
        assert not_ok == [names[i] for i in idx if want[names[i]] not in (S.OK, S.FROZEN)], trial
        assert frozen == [names[i] for i in idx if want[names[i]] is S.FROZEN], trial
        if ids is not None:
            assert in_opt == {names[i]: pids[i] in ids for i in idx}, trial


@pytest.mark.parametrize("seed", range(3))
def test_packing_agrees_with_concatenating_each_part(seed, monkeypatch):
    """One flat tensor holding every part's values exactly, in order (float64 where a part is wider
    than float32 or a count), from 0-d and 1-d parts of mixed dtypes, empty ones among them; never
    by a kernel that fails first (a ``stack`` of a vector and scalars: a float64 group's norms
    beside a loss, at every deferred check)."""
    from gradhealth.measure import stats

    stack, failed = torch.stack, []

    def counted(tensors, *args, **kwargs):
        try:
            return stack(tensors, *args, **kwargs)
        except RuntimeError:
            failed.append(len(tensors))
            raise

    monkeypatch.setattr(stats.torch, "stack", counted)
    rng = random.Random(seed)
    kinds = [lambda: torch.tensor(rng.random(), dtype=torch.float32),
             lambda: torch.rand(rng.randint(0, 3), dtype=torch.float32),
             lambda: torch.tensor(rng.random(), dtype=torch.float64),
             lambda: torch.tensor(rng.randint(0, 2**40), dtype=torch.int64),
             lambda: torch.rand(2, 2, dtype=torch.float32)]
    for trial in range(400):
        parts = [rng.choice(kinds[:rng.choice((1, 3, 5))])() for _ in range(rng.randint(1, 9))]
        got = joined(parts)
        wide = any(not p.dtype.is_floating_point or p.dtype.itemsize > 4 for p in parts)
        want = [float(v) for p in parts for v in p.reshape(-1).tolist()]
        assert got.dim() == 1 and got.tolist() == want, trial
        assert got.dtype == (torch.float64 if wide else torch.float32), trial
    assert failed == []
