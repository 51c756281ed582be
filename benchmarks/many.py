"""The many-tensors section of ``gradhealth bench``: 1,000 and 10,000 small parameter tensors, the
check's median and mean over every step (the change test's steps included), with the time the
monitor's step hooks add to ``optimizer.step()`` measured against the same step without them."""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from gradhealth.benchmarks.core import floor_pass
from gradhealth.monitor import GradHealth

__all__ = ["Wide", "bench_many"]


class Wide(nn.Module):
    """``n`` parameter tensors: n/2 Linear(8, 8) side by side, their outputs summed."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n // 2))

    def forward(self, x):
        return torch.stack([layer(x) for layer in self.layers]).sum(0)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_many(rounds: int, sizes=(1000, 10000)) -> None:
    print("\nmany small tensors (SGD momentum, default monitor; per step, ms):")
    print(f"  {'tensors':>8}{'floor':>9}{'check med':>11}{'check mean':>12}{'hooks mean':>12}{'mean x floor':>14}")
    for n in sizes:
        torch.manual_seed(0)
        model = Wide(n)
        plain = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4, momentum=0.9)
        mon = GradHealth(model, opt, on_problem="ignore")
        x = torch.randn(4, 8)
        floor, check, step, bare = [], [], [], []
        steps = 8 * max(1, rounds // 2)  # a multiple of change_every: every kind of step counted
        for k in range(steps + 4):
            for m, o, which in ((model, opt, "monitored"), (plain, plain_opt, "plain")):  # interleaved
                o.zero_grad()
                m(x).square().mean().backward()
                if which == "monitored":
                    f = _timed(lambda: floor_pass(model))
                    c = _timed(mon.check)
                    s = _timed(o.step)
                    if k >= 4:
                        floor.append(f)
                        check.append(c)
                        step.append(s)
                else:
                    s = _timed(o.step)
                    if k >= 4:
                        bare.append(s)
        mon.close()
        fl, hooks = statistics.median(floor), statistics.mean(step) - statistics.mean(bare)
        total = statistics.mean(check) + max(0.0, hooks)
        print(f"  {n:>8}{fl * 1e3:>9.1f}{statistics.median(check) * 1e3:>11.1f}{statistics.mean(check) * 1e3:>12.1f}"
              f"{hooks * 1e3:>+12.1f}{total / fl:>14.2f}")
    print("  (hooks mean: monitored optimizer.step() minus the same step without the monitor, both means, interleaved;"
          " below 0 is noise, counted as 0 in the ratio)")
