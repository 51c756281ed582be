"""Plain-loop runs for the dashboards: the demo's ``Net`` on its synthetic task, 60 steps, a
``TensorBoardSink`` at its defaults; one run healthy, one with the head left out of the optimizer.
``scripts/screenshot-dashboard`` and the dashboard tests look at them beside the Lightning demo's."""

from __future__ import annotations

import os

import torch
from torch import nn

from gradhealth.monitor import GradHealth
from gradhealth.integrations.tensorboard import TensorBoardSink
from gradhealth.demos.plain import Net, synthetic_batches

#: run name -> (the monitor's options, the parameters its planted problem puts in trouble: the
#: head's weight and bias); the third run measures updates every 10 checks (default: 100)
RUNS = {"plain_healthy": ({}, 0), "plain_head_not_in_optimizer": ({}, 2),
        "plain_updates_every_10": ({"update_every": 10}, 0)}


def plain_run(logdir: str, name: str, steps: int = 60) -> list[float]:
    """One run of ``RUNS`` under ``logdir/name``; returns its losses."""
    torch.manual_seed(0)
    model = Net()
    params = model.encoder.parameters() if name == "plain_head_not_in_optimizer" else model.parameters()
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    sink = TensorBoardSink(os.path.join(logdir, name))
    with GradHealth(model, opt, sinks=[sink], on_problem="ignore", **RUNS[name][0]) as monitor:
        for x, y in synthetic_batches(steps):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            monitor.check(loss=loss)
            opt.step()
            losses.append(loss.item())
    return losses


def plain_runs(logdir: str, steps: int = 60) -> dict[str, list[float]]:
    return {name: plain_run(logdir, name, steps) for name in RUNS}


if __name__ == "__main__":
    import sys

    plain_runs(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 60)
