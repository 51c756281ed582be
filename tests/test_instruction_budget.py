"""The Python a healthy steady-state check runs on the small models RL and small-model users train
(the 6-tensor MLP, the small CNN, the 2-block transformer, Stable-Baselines3's default DQN and PPO
policies), counted, not timed: bytecode instructions executed inside ``check()`` (``sys.settrace``
opcode events: the same count at every run, whatever the machine's load), the median and the
mean over 16 checks (two periods of the change test) after 24 (past the norm history's warm-up of
20), synchronous and deferred, next to the one number a user logs instead
(``clip_grad_norm_(params, inf).item()``) counted the same way.

The bounds are the counts this code reached plus headroom (``HEADROOM``: a later change that adds a
little is not a failure here; one that adds more must lower something else or raise the bound on
purpose, in this file, where a reviewer sees it). Where the check is within 1.5x the one number
(the issue's goal) the test holds that too. ``python -m gradhealth bench --sections models`` prints
the same counts with whole-step times.
"""

from __future__ import annotations

import pytest
import torch

from gradhealth.benchmarks.models import MODELS, count_model

pytestmark = pytest.mark.usefixtures("one_thread")

SYNC, DEFERRED, ONE = "synchronous", "deferred (lag=1)", "one number"
#: room for small later additions (a forward pre-hook's bookkeeping, an update-norm cadence: ~60)
HEADROOM = 100
#: instructions per check reached on this code: (synchronous median, its mean over two periods of the
#: change test, deferred median, its mean); a bound is one of these + HEADROOM. The one number:
#: 1304 on the MLP and the CNN, 2444 on the transformer, 1364 on DQN's, 1646 on PPO's. (A healthy
#: steady-state check takes the fast path, `gradhealth.check.steady` and `gradhealth.check.quiet`; the means hold
#: the periodic checks that take the full path: update norms, the change test, the medians' refresh.)
REACHED = {
    "6-tensor MLP": (1760, 1903, 1785, 1936),
    "small CNN (8x3x32x32)": (1760, 1903, 1785, 1936),
    "2-block transformer": (1760, 1938, 1785, 1972),
    "SB3 DQN policy (CartPole)": (1968, 2111, 2011, 2162),
    "SB3 PPO policy (CartPole)": (1813, 1966, 1834, 1996),
}
#: the models whose usual check (the median) is within 1.5x the one number, synchronous and deferred:
#: every one (reached: 1.35x / 1.37x on the MLP and the CNN, 0.72x / 0.73x on the transformer, 1.44x /
#: 1.47x on DQN's, 1.10x / 1.11x on PPO's). DQN's deferred check has 35 instructions of room: its target
#: network's six tensors, judged at every check, cost ~200 instructions the MLP's check has not (the
#: copies' finding, the gradients that are elsewhere, the selection of the optimizer it judges), and in
#: the deferred mode the copies' version and storage marks are compared at every check, where the
#: synchronous one has seen SB3's write through ``.data`` by their values and stops looking
WITHIN_ONE_AND_A_HALF = set(REACHED)
#: the deferred check's instructions over the synchronous one's, at most (reached: +21 to +43 on the
#: median, +30 to +51 on the mean; the goal, 0, is not). A plain deferred check is fused
#: (``quiet.later``: the launch, the transfer, the setup, the arming and the witnesses in one function),
#: and what is in flight is that function's generator, suspended after the launch with its locals, which
#: the next check resumes to complete it (a steady report, else the full path's); on the CPU its numbers
#: are read where they are (no Transfer). What is left is what a check split over two calls costs:
#: ``Deferred.check`` and the generator's two resumptions, the discarded-gradients test and the setup
#: taken at launch, the arming there. Lowered from 530 (reached then: 466 to 506), then 270 (216 to 250),
#: then 180 (124 to 165), then 160 (102 to 137)
DEFERRED_EXTRA = 60


def test_every_model_of_the_bench_is_held():
    assert set(REACHED) == set(MODELS), "a model added to the bench needs its bound here"


@pytest.mark.parametrize("label", list(MODELS))
def test_a_healthy_check_stays_within_its_instructions(label):
    runs: dict = {}
    counts = count_model(label, checks=16, warm=24, runs_out=runs)
    for variant, run in runs.items():  # the premise: a healthy run, training, judged healthy
        first, last = run.losses[0].item(), run.losses[-1].item()
        assert last < first, (variant, first, last)
        if run.monitor is not None:
            report = run.monitor.last_report
            assert report.ok and not [f for f in report.findings if f.level != "info"], report.findings
            assert report.step >= 24 + 32 - 2  # (a report of the steady state, the deferred one's included)
    got = (counts[SYNC]["check"], counts[SYNC]["check_mean"], counts[DEFERRED]["check"], counts[DEFERRED]["check_mean"])
    for what, n, reached in zip(("synchronous median", "synchronous mean", "deferred median", "deferred mean"),
                                got, REACHED[label]):
        assert n <= reached + HEADROOM, f"{label}: {what} {n:.0f} instructions a check (bound {reached} + {HEADROOM})"
    sync, deferred, one = counts[SYNC]["check"], counts[DEFERRED]["check"], counts[ONE]["check"]
    assert deferred <= sync + DEFERRED_EXTRA, f"{label}: deferred {deferred:.0f} against synchronous {sync:.0f}"
    assert counts[DEFERRED]["check_mean"] <= counts[SYNC]["check_mean"] + DEFERRED_EXTRA
    if label in WITHIN_ONE_AND_A_HALF:
        assert max(sync, deferred) <= 1.5 * one, f"{label}: {sync:.0f} / {deferred:.0f} against the one number's {one:.0f}"
    # the counter counts: the one number's own Python (torch's clip_grad_norm_) is there, and so is the
    # check's (on the transformer's 26 tensors the steady check now runs less than the one number)
    assert 500 < one and 500 < sync


def test_the_count_is_the_same_at_every_run():
    a = count_model("6-tensor MLP", checks=8, warm=24)
    b = count_model("6-tensor MLP", checks=8, warm=24)
    # the median check's count (the number the bounds hold) is exact from run to run, whatever ran before
    # in the process (count_model collects garbage before it counts and not while it counts: a collection
    # inside a check ran an earlier run's finalizers, a WeakSet's removals, there); the mean and a whole
    # step's count vary by a few instructions (a module's first import, autograd's caches in the model's
    # own forward and backward): within 1%
    assert {k: v["check"] for k, v in a.items()} == {k: v["check"] for k, v in b.items()}
    assert all(abs(a[k][m] - b[k][m]) <= 0.01 * a[k][m] for k in a for m in ("check_mean", "step"))
    assert torch.get_num_threads() == 1
