"""The Python the TensorBoardSink runs per check, counted, not timed: bytecode instructions executed
inside its write methods (``write``, ``write_update``, ``write_clip``: every frame they enter, PIL's
and numpy's Python included; ``sys.settrace`` opcode events, the same count on any machine), at its
defaults (scalars every 10 checks, the gradient-flow picture every 50), over 100 checks of a long
run's steady state (``benchmarks/tensorboard_sink.py``: after 150 checks, past the first update
norms' write and the first pictures): the mean (its writes and pictures amortised) and the median (a
check that writes nothing).

The bounds are the counts this code reached plus ``HEADROOM``; a change that adds more must lower
something else or raise a bound here, on purpose. Before this was held (same counter, same runs):
400 small tensors 2077 mean / 251 median, the LoRA shape 1769 / 284, the sick model (every report
written) 13983 / 10470. ``python -m gradhealth bench --sections tensorboard`` prints the mean next to
the timed cost of the sink in floors.
"""

from __future__ import annotations

import statistics

import pytest

from gradhealth import Status
from gradhealth.benchmarks.counts import _deep, _frozen_base
from gradhealth.benchmarks.tensorboard_sink import sink_instructions

pytestmark = pytest.mark.usefixtures("one_thread")

HEADROOM = 0.15  # a bound is the count reached, plus this share
#: shape -> (model factory, options of the count, mean reached, median reached)
REACHED = {
    "400 small tensors": (None, {}, 843, 250),
    "400 tensors, 396 frozen (LoRA)": (_frozen_base, {}, 743, 283),
    # 53 of 400 tensors ZERO_GRAD from the start: every report is written, the states' TEXT once
    "200x(Linear(64),Tanh): vanishing": (_deep, {"warm": 24, "checks": 16}, 3864, 2751),
}


@pytest.mark.parametrize("label", list(REACHED))
def test_the_sink_stays_within_its_instructions_per_check(label):
    make, options, mean, median = REACHED[label]
    counts, reports = sink_instructions(make, 64, **options) if make else sink_instructions(**options)
    steady = reports[-len(counts):]
    if label.endswith("vanishing"):  # the premise: a sick model, judged sick at every counted check
        assert all(not r.ok and Status.ZERO_GRAD in r.errors.values() for r in steady)
    else:  # the premise: healthy, training
        assert all(r.ok for r in steady)
        assert reports[-1].loss < reports[0].loss
    assert statistics.fmean(counts) <= mean * (1 + HEADROOM), (statistics.fmean(counts), mean)
    assert statistics.median(counts) <= median * (1 + HEADROOM), (statistics.median(counts), median)


def test_a_healthy_check_that_writes_nothing_costs_the_same_on_a_small_model():
    """The sink's work on a check that writes nothing does not grow with the parameters: the
    6-tensor MLP's median is the 400-tensor model's (a column of the picture copied in C)."""
    from torch import nn

    small, _ = sink_instructions(lambda: nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                                       nn.Linear(64, 4)), 64, warm=60, checks=20)
    large, _ = sink_instructions(lambda: _frozen_base().requires_grad_(True), 64, warm=60, checks=20)
    assert statistics.median(large) <= statistics.median(small) + 20, (statistics.median(large), statistics.median(small))
