"""The ``tensorboard`` section of ``gradhealth bench``: what the TensorBoardSink adds to a training
step, next to what the monitor alone adds, in one interleaved run; and the sink's own Python per
check, counted.

Timed: three copies of one model train side by side (the same weights and batches): no monitor,
the default monitor, the default monitor with a ``TensorBoardSink`` at its defaults (scalars every
10 checks, the gradient-flow picture every 50, event files on local disk). A round runs one block
of ``BLOCK`` whole steps (zero_grad, forward, backward, check, optimizer.step) of each, in an order
that rotates from round to round, then times the floor (one fused norm pass over every gradient,
read back to the host, right after a backward). A block is one period of the picture (its pictures
land at the last step of each block) and five of the scalars: the block's mean step counts them
all. Per round: the monitor's cost (its block's mean step minus the plain block's) and the sink's
(the sink's block minus the monitor's), in floors of that round; printed as the median over the
rounds and their range, by the clock and by the process's CPU time (on a shared machine the clock
moves with other people's work; CPU time much less), and the clock inside the sink's write methods
alone (its share of the step without the blocks' noise; the event writer's thread not in it). Target: the sink at most +0.5 floor over the
monitor alone, on every shape.

Counted: the bytecode instructions run inside the sink's methods (``write``, ``write_update``,
``write_clip``: every frame they enter, PIL's and numpy's Python included; ``sys.settrace`` opcode
events, the same count on any machine) per check over ``CHECKS`` checks of the 400-tensor model, after
``WARM``: the mean (its writes and pictures amortised) and the median (a healthy check that writes
nothing). ``tests/test_tensorboard_cost.py`` holds both.
"""

from __future__ import annotations

import copy
import shutil
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

from gradhealth.benchmarks.core import build_model, floor_pass
from gradhealth.benchmarks.counts import _instructions
from gradhealth.benchmarks.many import Wide
from gradhealth.integrations.tensorboard import TensorBoardSink
from gradhealth.monitor import GradHealth

__all__ = ["SHAPES", "ALL_SHAPES", "measure_sink", "sink_instructions", "main"]

BLOCK = 50  # whole steps per block: one picture period (heatmap_every), five scalar writes (every_n)
#: label -> (model factory, input width)
SHAPES = {
    "400 small tensors (width 64)": (lambda: build_model(100, 64), 64),
    "26M params, 400 tensors (width 512)": (lambda: build_model(100, 512), 512),
    "1,000 small tensors (Linear(8) side by side)": (lambda: Wide(1000), 8),
}
ALL_SHAPES = {
    **SHAPES,
    "84M params, 80 tensors (width 2048)": (lambda: build_model(20, 2048), 2048),
    "10,000 small tensors (Linear(8) side by side)": (lambda: Wide(10000), 8),
}
WARM, CHECKS = 150, 100  # the counted checks: two pictures, ten writes, one with update norms; after the
# first of each (the tag layouts, the picture's labels): a long run's steady state


def measure_sink(make_model, width: int, rounds: int, block: int = BLOCK, batch: int = 8) -> dict:
    """{"floor": median seconds of the floor, "step": median seconds of a plain step, "monitor" and
    "sink": each round's extra cost in floors (the monitor over the plain step, the sink over the
    monitor), by the clock; "monitor cpu" and "sink cpu": the same by the process's CPU time (every
    thread of it, the event writer's too; what other processes on a shared machine do moves it
    far less than the clock); "inside": the clock inside the sink's write methods per step (the
    event writer's thread not counted), in floors}."""
    torch.manual_seed(0)
    base = make_model()
    x = torch.randn(batch, width)
    with torch.no_grad():
        target = torch.randn_like(base(x))
    tmp = tempfile.mkdtemp(prefix="gradhealth_bench_tb_")
    runs = {}
    inside = [0.0]  # seconds inside the sink's write methods
    for name in ("plain", "monitor", "sink"):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        sinks = [_inside(TensorBoardSink(f"{tmp}/run"), inside)] if name == "sink" else []
        monitor = None if name == "plain" else GradHealth(model, opt, on_problem="ignore", sinks=sinks)
        runs[name] = (model, opt, monitor)

    def step(model, opt, monitor):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        if monitor is not None:
            monitor.check(loss=loss)
        opt.step()

    def timed_block(name) -> tuple[float, float]:
        model, opt, monitor = runs[name]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(block):
            step(model, opt, monitor)
        return (time.perf_counter() - t0) / block, (time.process_time() - c0) / block

    def floor() -> tuple[float, float]:
        model, opt, _ = runs["plain"]
        times, cpu = [], []
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), target).backward()
            t0, c0 = time.perf_counter(), time.process_time()
            floor_pass(model)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return statistics.median(times), statistics.median(cpu)

    out: dict = {"monitor": [], "sink": [], "monitor cpu": [], "sink cpu": [], "inside": [], "floor": [], "step": []}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in runs:  # warm-up: one block each (the sink's first picture at its last step)
                timed_block(name)
            order = list(runs)
            for r in range(rounds):
                inside[0] = 0.0
                t = {name: timed_block(name) for name in order[r % 3:] + order[:r % 3]}
                f = floor()
                out["inside"].append(inside[0] / block / f[0])
                for k, suffix in ((0, ""), (1, " cpu")):
                    out["monitor" + suffix].append((t["monitor"][k] - t["plain"][k]) / f[k])
                    out["sink" + suffix].append((t["sink"][k] - t["monitor"][k]) / f[k])
                out["floor"].append(f[0])
                out["step"].append(t["plain"][0])
    finally:
        for _, _, monitor in runs.values():
            if monitor is not None:
                monitor.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out["floor"], out["step"] = statistics.median(out["floor"]), statistics.median(out["step"])
    return out


def _inside(sink: TensorBoardSink, seconds: list) -> TensorBoardSink:
    """``sink``, its write methods timed into ``seconds[0]`` (the Publisher calls the instance's attributes)."""
    for method in ("write", "write_update", "write_clip"):
        def timed(report, _fn=getattr(sink, method)):
            t0 = time.perf_counter()
            try:
                _fn(report)
            finally:
                seconds[0] += time.perf_counter() - t0
        setattr(sink, method, timed)
    return sink


def sink_instructions(make_model=lambda: build_model(100, 64), width: int = 64, checks: int = CHECKS,
                      warm: int = WARM, **sink_options) -> tuple[list[int], list]:
    """The bytecode instructions the sink's methods ran at each of ``checks`` checks after ``warm``
    (the default monitor, a healthy run), and the monitor's reports."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(8, width)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    tmp = tempfile.mkdtemp(prefix="gradhealth_count_tb_")
    sink = TensorBoardSink(tmp, **sink_options)
    counted = [0]
    for method in ("write", "write_update", "write_clip"):
        def through(report, _fn=getattr(sink, method)):
            counted[0] += _instructions(lambda: _fn(report))
        setattr(sink, method, through)  # (the Publisher calls the instance's attribute)
    per_check, reports = [], []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            monitor = GradHealth(model, opt, on_problem="ignore", sinks=[sink])
            for i in range(warm + checks):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x), target)
                loss.backward()
                counted[0] = 0
                reports.append(monitor.check(loss=loss))
                opt.step()  # (a step's update norms reach the sink through its hook)
                if i >= warm:
                    per_check.append(counted[0])
            monitor.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return per_check, reports


def main(rounds: int = 5, shapes=None) -> dict:
    counts, _ = sink_instructions()
    print(f"\nTensorBoardSink at its defaults: the sink's own Python per check on 400 small tensors, counted (the "
          f"instructions inside its write methods, {CHECKS} checks after {WARM}): mean {statistics.fmean(counts):.0f} "
          f"(its writes and pictures amortised), median {statistics.median(counts):.0f} (a check that writes nothing)")
    print(f"what the sink adds to a whole training step, next to the monitor alone (interleaved blocks of {BLOCK} steps, "
          f"SGD momentum, batch 8; {rounds} rounds; per round in floors; target: the sink <= +0.5 floor over the monitor)")
    print(f"  {'':<46}{'':>18}   {'by the clock':<44}{'by CPU time (all our threads)':<44}{'inside the sink':<22}")
    print(f"  {'shape':<46}{'floor ms':>9}{'step ms':>9}   " + f"{'monitor +floors':<22}{'sink +floors':<22}" * 2
          + f"{'floors':<22}")
    out = {}
    for label, (make, width) in (shapes or SHAPES).items():
        res = measure_sink(make, width, rounds)
        cells = []
        for key in ("monitor", "sink", "monitor cpu", "sink cpu", "inside"):
            v = res[key]
            cells.append(f"{statistics.median(v):+.2f} ({min(v):+.2f}..{max(v):+.2f})")
        print(f"  {label:<46}{res['floor'] * 1e3:>9.3f}{res['step'] * 1e3:>9.2f}   " + "".join(f"{c:<22}" for c in cells))
        out[label] = res
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="the TensorBoardSink's cost next to the monitor's")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--all", action="store_true", help="also the 84M-parameter model and 10,000 small tensors")
    a = ap.parse_args()
    torch.set_num_threads(1)
    main(a.rounds, ALL_SHAPES if a.all else None)
