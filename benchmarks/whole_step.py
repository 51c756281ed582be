"""The whole-step section of ``gradhealth bench``: what a user pays, a whole training step
(zero_grad, forward, backward, check, optimizer.step) timed with and without the monitor.

Every variant trains its own copy of the same model (same weights, same batches) with its own
optimizer. A round runs a block of plain steps, a block of one monitored variant, plain again, the
next variant, and so on (the variants' order rotating from round to round); a variant's cost in a
round is its block minus the mean of the two plain blocks around it, so a machine that drifts
between blocks (a noisy neighbour) cancels out. The table gives the mean of these costs (block
means: they count the periodic steps, the update norms every ``update_every`` checks and the change
test every ``change_every``) and their median (block medians), as milliseconds, as a share of the
plain step and in floors (one fused norm pass over every gradient read back to the host, timed right
after a backward, where the check runs).
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

from gradhealth.benchmarks.core import SHAPES, build_model, floor_pass
from gradhealth.benchmarks.many import Wide
from gradhealth.monitor import GradHealth

__all__ = ["PARTS", "VARIANTS", "bench_whole_step", "measure"]

#: the default monitor with one part off: what each part's verdicts cost ("stale witnesses off" has
#: no option: :func:`measure` removes them)
PARTS = {
    "forward watch off": {"watch_forward": False},
    "update tracking off": {"deltas": "off"},
    "history off": {"history": False},
    "stale witnesses off": {},
}
#: name -> monitor options (None: no monitor at all); "stale witnesses off" and the sink are set up below
VARIANTS = {
    "plain step": None,
    "default monitor": {},
    **PARTS,
    "+ TensorBoardSink": {},
    "every_n_steps=10": {"every_n_steps": 10},
    "plain + torch's clip": None,
    "monitor + shared clip": {},
}
#: the clipping pair: clip_grad_norm_ after the backward (torch's, reading every gradient for the norm
#: and again to scale), against the default monitor and its clip with the check's norms; max_norm is
#: small enough that both scale every step
CLIPS = {"plain + torch's clip": "torch", "monitor + shared clip": "shared"}
MAX_NORM = 1e-3


def _sink(tmp: str):
    try:
        from gradhealth.integrations.tensorboard import TensorBoardSink
    except ImportError:
        return None
    return TensorBoardSink(tmp)


def _no_witnesses(monitor: GradHealth) -> None:
    """No option turns the stale-gradient witnesses off (they are the missing-zero_grad verdict):
    the bench removes them to show what they cost."""
    monitor.tracker.witness.close()
    monitor.tracker.witness.arm = lambda *a, **k: None


#: the parts of a step that ``measure(..., phases=True)`` times apart
PHASES = ("zero_grad", "forward", "backward", "check", "step")


def measure(make_model, batch: torch.Tensor, rounds: int, steps: int, variants=VARIANTS,
            clips=None, phases: bool = False) -> dict[str, dict[str, float]]:
    """Per variant: ``mean`` and ``median`` seconds of a whole step, ``extra_mean`` and
    ``extra_median`` (what it costs above the plain step, from the sandwiches below) and ``floor``
    (seconds of one fused norm pass, measured in the plain run). Returns ``{variant: {...}}``.

    Each round runs ``steps`` steps of the plain variant, then of one monitored variant, then plain
    again, and so on (P V1 P V2 ... Vn P, the variants' order rotating from round to round): a
    variant's cost in a round is its block minus the mean of the two plain blocks around it, so a
    machine that slows down or speeds up between blocks cancels out. ``clips``: variant -> "torch"
    (torch's clip after the backward), "shared" (the monitor's) or "item" (torch's clip and its
    total read on the host: the one number a user logs); default :data:`CLIPS`. ``phases``: each
    variant also gets ``phases``, the median seconds of each part of its steps (:data:`PHASES`:
    ``check`` is the check and the clip, the rest the user's own calls, our hooks inside them)."""
    clips = CLIPS if clips is None else clips
    torch.manual_seed(0)
    base = make_model()
    tmp = tempfile.mkdtemp(prefix="gradhealth_bench_")
    runs = {}
    for name, options in variants.items():
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        monitor = None
        if options is not None:
            kw = dict(options)
            if name == "+ TensorBoardSink":
                sink = _sink(tmp)
                if sink is None:
                    continue
                kw["sinks"] = [sink]
            monitor = GradHealth(model, opt, on_problem="ignore", **kw)
            if name == "stale witnesses off":
                _no_witnesses(monitor)
        runs[name] = (model, opt, monitor, [], clips.get(name))
    parts: dict[str, list[list[float]]] = {name: [[] for _ in PHASES] for name in runs}
    floors: list[float] = []
    with torch.no_grad():
        target = torch.randn_like(base(batch))  # a regression target: every layer gets a gradient

    def step(model, opt, monitor, times, clip=None, timed_floor=False, split=None):
        clock = time.perf_counter
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        t1 = clock() if split is not None else 0.0
        loss = nn.functional.mse_loss(model(batch), target)
        t2 = clock() if split is not None else 0.0
        loss.backward()
        t3 = clock() if split is not None else 0.0
        if monitor is not None:
            monitor.check(loss=loss)
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        elif clip == "shared":
            monitor.clip_grad_norm_(MAX_NORM)
        elif clip == "item":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        t4 = clock() if split is not None else 0.0
        opt.step()
        t5 = clock()
        times.append(t5 - t0)
        if split is not None:
            for part, a, b in zip(split, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                part.append(b - a)
        if timed_floor:  # one fused norm pass, where the check would run (after a backward)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(batch), target).backward()
            t1 = time.perf_counter()
            floor_pass(model)
            floors.append(time.perf_counter() - t1)

    def block(name) -> tuple[float, float]:
        model, opt, monitor, times, clip = runs[name]
        mine: list[float] = []
        split = parts[name] if phases else None
        for _ in range(steps):
            step(model, opt, monitor, mine, clip, split=split)
        times += mine
        return statistics.fmean(mine), statistics.median(mine)

    extra: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model, opt, monitor, times, clip in runs.values():  # warm-up: every code path once
            for _ in range(max(3, steps)):
                step(model, opt, monitor, [], clip)
        others = [name for name in runs if name != "plain step"]
        for r in range(rounds):
            before = block("plain step")
            for name in others[r % len(others):] + others[:r % len(others)]:
                mine = block(name)
                after = block("plain step")
                extra[name].append(tuple(m - (b + a) / 2 for m, b, a in zip(mine, before, after)))
                before = after
            model, opt, _, _, _ = runs["plain step"]
            step(model, opt, None, [], timed_floor=True)
    out = {}
    for name, (_, _, _, t, _) in runs.items():
        diffs = extra[name] or [(0.0, 0.0)]
        out[name] = {"mean": statistics.fmean(t), "median": statistics.median(t),
                     "extra_mean": statistics.fmean(d[0] for d in diffs),
                     "extra_median": statistics.median(d[1] for d in diffs)}
        if phases:
            out[name]["phases"] = {k: statistics.median(v) for k, v in zip(PHASES, parts[name])}
    for model, opt, monitor, _, _ in runs.values():
        if monitor is not None:
            monitor.close()
    shutil.rmtree(tmp, ignore_errors=True)
    floor = statistics.median(floors)
    for row in out.values():
        row["floor"] = floor
    return out


def _print(label: str, res: dict[str, dict[str, float]], batch: int = 8) -> None:
    plain = res["plain step"]
    floor = plain["floor"]
    print(f"\nthe whole training step on {label} (SGD momentum, batch {batch}; floor {floor * 1e3:.3f} ms; "
          f"plain step mean {plain['mean'] * 1e3:.2f} ms, median {plain['median'] * 1e3:.2f} ms; the floor "
          f"alone is {100 * floor / plain['median']:.1f}% of the step); above the plain blocks around it:")
    print(f"  {'':<22}{'mean +ms':>9}{'% step':>8}{'floors':>8}   {'median +ms':>10}{'% step':>8}{'floors':>8}")
    for name, row in res.items():
        if name == "plain step":
            continue
        cells = []
        for key, width in (("mean", 9), ("median", 10)):
            extra = row[f"extra_{key}"]
            cells.append(f"{extra * 1e3:>+{width}.2f}{100 * extra / plain[key]:>+7.1f}%{extra / floor:>+8.2f}")
        print(f"  {name:<22}" + "   ".join(cells))
    torch_clip, shared = res.get("plain + torch's clip"), res.get("monitor + shared clip")
    if torch_clip and shared:
        pair = [(shared[f"extra_{k}"] - torch_clip[f"extra_{k}"]) for k in ("mean", "median")]
        print(f"  clipping pair: the full diagnosis and the shared clip cost {pair[0] * 1e3:+.2f} ms ({pair[0] / floor:+.2f} "
              f"floors) mean, {pair[1] * 1e3:+.2f} ms ({pair[1] / floor:+.2f} floors) median over torch's clip alone "
              "(target: at most +0.5 floor)")


TARGETS = ("plain step", "default monitor", "plain + torch's clip", "monitor + shared clip")


def bench_whole_step(rounds: int, shapes=None, many=(1000, 10000), batch: int = 8, targets: bool = False) -> dict:
    """Print the whole-step table for the chosen bench shapes and the many-tensors models. Above
    batch 8 only the plain step, the default monitor and ``every_n_steps=10`` are timed (a step
    that computes is long; the parts' rows are read at batch 8)."""
    print("\nwhat the user pays: a whole training step with and without the monitor, each part off in turn "
          "(interleaved; targets: default <= 10% / 1.5 floors on the small shape, <= 2% on the large ones)")
    variants = VARIANTS if batch <= 8 else {k: VARIANTS[k] for k in ("plain step", "default monitor", "every_n_steps=10",
                                                                      "plain + torch's clip", "monitor + shared clip")}
    if targets:
        variants = {k: VARIANTS[k] for k in TARGETS}
    results = {}
    items = list(SHAPES.items()) if shapes is None else shapes
    for label, (blocks, width) in items:
        small = width <= 64  # large shapes: one step per turn, more rounds (a step is long and noisy)
        res = measure(lambda: build_model(blocks, width), torch.randn(batch, width), max(3, rounds) * (2 if small else 3),
                      10 if small else 1, variants)
        _print(label, res, batch)
        results[label] = res
    for n in many:
        label = f"{n:,} small tensors ({n // 2} Linear(8) side by side)"
        res = measure(lambda: Wide(n), torch.randn(batch, 8), max(3, 2 * rounds if n <= 1000 else rounds), 10 if n <= 1000 else 1,
                      variants)
        _print(label, res, batch)
        results[label] = res
    return results
