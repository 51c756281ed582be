"""The callback's overhead on a real ``Trainer.fit``: interleaved runs with and without it."""

from __future__ import annotations

import logging
import statistics
import time
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradhealth.integrations.lightning import GradHealthCallback


def lightning_grad_norm(model: nn.Module) -> dict[str, float]:
    """Lightning's own per-parameter grad-norm utility, read to the host as a user would."""
    from lightning.pytorch.utilities import grad_norm

    return {k: float(v) for k, v in grad_norm(model, 2).items()}


class _Model(pl.LightningModule):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _Timer(pl.Callback):
    def __init__(self):
        self.times: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, *a):
        self._t = time.perf_counter()

    def on_train_batch_end(self, *a):
        self.times.append(time.perf_counter() - self._t)


class _Clock:
    """Time spent inside gradhealth during a fit: the callback's hooks and the monitor's own."""

    def __init__(self):
        self.total = 0.0

    def wrap(self, obj, name):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total += time.perf_counter() - t

        setattr(obj, name, timed)


class _Instrument(pl.Callback):
    """Wraps the gradhealth callback's hooks, and its monitor's, in a clock once the monitor exists."""

    def __init__(self, target: GradHealthCallback, clock: _Clock):
        self.target, self.clock = target, clock

    def on_train_start(self, trainer, pl_module):
        mon = self.target.monitor
        for name in ("measure", "publish", "diagnose_loss"):
            self.clock.wrap(mon, name)
        tracker = mon.tracker
        if tracker is not None:  # re-register the optimizer step hooks through the clock
            for h in tracker._handles:
                h.remove()
            self.clock.wrap(tracker, "_post")
            tracker._handles = [o.register_step_post_hook(tracker._post) for o in mon.optimizers]


def _fit(steps: int, data, width: int, depth: int, callback, clock: _Clock | None = None) -> float:
    torch.manual_seed(0)
    timer = _Timer()
    extra = [callback, _Instrument(callback, clock)] if callback and clock else ([callback] if callback else [])
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer] + extra)
    trainer.fit(_Model(width, depth), DataLoader(data, batch_size=data.tensors[0].shape[0] // steps))
    return statistics.median(timer.times[3:])  # the first steps warm up allocators


def main(rounds: int = 5, steps: int = 20, width: int = 1536, depth: int = 4, batch: int = 512) -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    data = TensorDataset(torch.randn(batch * steps, width))
    n_params = depth * (width * width + width)
    times, inside = measure_overhead(
        lambda cb, clock: _fit(steps, data, width, depth, cb, clock),
        lambda every: GradHealthCallback(every_n_steps=every, log=False), rounds, steps)
    print_overhead(f"GradHealthCallback on Trainer.fit: {n_params / 1e6:.1f}M-parameter MLP, batch {batch}, AdamW, CPU, "
                   f"median step over {rounds} interleaved runs:", times, inside)


def measure_overhead(run, make, rounds: int, steps: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Interleaved runs without the callback, checking every step and every 10th step
    (``run(callback or None, clock or None)`` returns the median step time; ``make(every)``
    builds a callback), then the time inside gradhealth's code per step, measured by a clock."""
    configs = {"without": None, "every step": 1, "every_n_steps=10": 10}
    times: dict[str, list[float]] = {k: [] for k in configs}
    inside: dict[str, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(rounds):
            for name, every in configs.items():
                times[name].append(run(None if every is None else make(every), None))
        for name, every in (("every step", 1), ("every_n_steps=10", 10)):
            clock = _Clock()
            run(make(every), clock)
            inside[name] = clock.total / steps
    return times, inside


def print_overhead(title: str, times: dict[str, list[float]], inside: dict[str, float]) -> None:
    """A callback's cost side by side: step times without it and with it, and the time spent
    inside gradhealth's own code as a share of a step (shared by the framework benchmarks)."""
    base = statistics.median(times["without"])
    print(f"\n{title}")
    print(f"  without the callback {base * 1e3:.1f} ms/step")
    for name in inside:
        t = statistics.median(times[name])
        print(f"  {name:<18} {t * 1e3:.1f} ms/step ({100 * (t / base - 1):+.1f}% wall clock); time inside gradhealth's "
              f"code {inside[name] * 1e3:.2f} ms/step = {100 * inside[name] / base:.2f}% of a step")
    print("  (wall-clock differences below the machine's noise, a few %, are not meaningful; the time inside")
    print("   gradhealth's code is measured directly: the check, the update measurement, the loss check)")
