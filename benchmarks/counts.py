"""The ``counts`` section of ``gradhealth bench``: what a check costs the host, counted rather than
timed (a count does not move with a shared machine's clock, and on a GPU every torch op is a kernel
launch that costs host time). For each shape, three ways to watch the gradients after backward:
the synchronous monitor (``lag=0``), the deferred one (``lag=1``) and the one number a user logs
instead (``clip_grad_norm_(...).item()``):

* ops per check: the torch ops dispatched inside ``check()`` (or the clip), counted with
  ``TorchDispatchMode``; the median over the checks after the first counted (the first builds the plans,
  and is printed apart), all after ``WARM`` checks (past the first checks' dense update norms);
* ops per step: the same plus the monitor's own ops in the optimizer step's hooks, the mean over
  ``steps`` steps (the periodic change test and update norms amortised as in a run);
* host reads per step: the reads of a tensor's values by the host inside ``check()`` (or the
  clip) and the monitor's step hooks, each a synchronisation on a GPU (the host waits for the
  device): a scalar read (``item``, ``bool()``) or ``Tensor.tolist()``, but for the deferred
  check's completed copy, which reads pinned host memory after its event; the mean over ``steps``;
* Python instructions per check: bytecode instructions executed inside ``check()`` (or the clip),
  counted with ``sys.settrace`` opcode events (``f_trace_opcodes``), the median and the mean over
  ``instructions`` checks after the ``steps`` (8: one period of the default change test, whose
  checks cost more); torch's C++ is not counted (``scripts/count_instructions.py`` counts machine
  instructions with valgrind).

Shapes: the small section's 6-tensor MLP and 2-block transformer, 100x (Linear(64), LayerNorm) (400
small tensors), and 200x (Linear(64, 64), Tanh): gradients that underflow fp32 squares, whose norms
need the exact re-check (the run someone turns the tool on for).
"""

from __future__ import annotations

import statistics
import sys

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COUNT_SHAPES", "count_shape", "bench_counts", "TolistWatch", "within"]


_READS = {"_local_scalar_dense", "item", "is_nonzero"}


def _ours(frame) -> bool:
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/optim/" in name:
            return False
        if "/gradhealth/" in name and "/benchmarks/" not in name and "/tests/" not in name:
            return True
        frame = frame.f_back
    return False


def within(frame, codes) -> bool:
    """Whether ``frame`` or one of its callers runs one of the code objects ``codes``."""
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


class TolistWatch(TorchDispatchMode):
    """A dispatch mode that also sees ``Tensor.tolist()``: a read of the values that dispatches
    nothing on the CPU (on a GPU, a blocking copy). :meth:`tolist_called` gets each caller's frame.
    (This bench's counts, ``tests/test_deferred.py``'s host reads, ``scripts/gpu_check.py``'s CPU
    stand-in for ``set_sync_debug_mode``.)"""

    def tolist_called(self, frame) -> None:
        pass

    def __enter__(self):
        tolist = torch.Tensor.tolist

        def watched(t):
            self.tolist_called(sys._getframe(1))
            return tolist(t)

        self._tolist, torch.Tensor.tolist = tolist, watched
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


class _Ops(TolistWatch):
    """Counts the ops dispatched by gradhealth's code, or (``everything``) every op, and the host
    reads among them (``reads``; ``Tensor.tolist()`` too, but for the deferred check's completed
    copy, which reads pinned memory after its event, long complete)."""

    def __init__(self, everything: bool = False):
        super().__init__()
        self.n, self.reads, self.everything = 0, 0, everything

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.everything or _ours(sys._getframe(1)):
            self.n += 1
            self.reads += func.__name__.split(".")[0] in _READS
        return func(*args, **(kwargs or {}))

    def tolist_called(self, frame) -> None:
        from gradhealth.check.deferred import Transfer

        if self.everything or _ours(frame):
            self.reads += not within(frame, {Transfer.values.__code__})


def _instructions(fn, per_code: dict | None = None) -> int:
    """Bytecode instructions ``fn()`` executes (every frame it enters), by ``sys.settrace`` opcode
    events; ``per_code``: also counted per code object (each function's own instructions)."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
            if per_code is not None:
                code = frame.f_code
                per_code[code] = per_code.get(code, 0) + 1
        return trace

    old = sys.gettrace()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(old)
    return count


def _deep():
    return nn.Sequential(*[m for _ in range(200) for m in (nn.Linear(64, 64), nn.Tanh())])


def _many():
    return nn.Sequential(*[m for _ in range(100) for m in (nn.Linear(64, 64), nn.LayerNorm(64))])


def _frozen_base():
    """A LoRA fine-tune's shape: 400 tensors, all but the last four frozen (outside the optimizer)."""
    model = _many()
    for p in list(model.parameters())[:-4]:
        p.requires_grad_(False)
    return model


def _small(name):
    from gradhealth.benchmarks.small import SMALL

    return SMALL[name]


#: label -> (model factory, batch factory)
COUNT_SHAPES = {
    "6-tensor MLP": lambda: _small("6-tensor MLP"),
    "2-block transformer": lambda: _small("2-block transformer (8x16x64)"),
    "400 small tensors": lambda: (_many, lambda: torch.randn(8, 64)),
    "200x(Linear(64),Tanh): vanishing": lambda: (_deep, lambda: torch.randn(8, 64)),
    "400 tensors, 396 frozen (LoRA)": lambda: (_frozen_base, lambda: torch.randn(8, 64)),
}
VARIANTS = ("synchronous", "deferred (lag=1)", "clip_grad_norm_().item()")


WARM = 64  # checks before counting: update norms are measured at checks 0, 1, 2, 4, ... 32 (then every
# update_every), so the counts are a long run's steady state, after those


def count_shape(label: str, steps: int = 9, instructions: int = 8) -> dict[str, dict[str, float]]:
    """{variant: {"first": ops at the first check, "check": median ops per check, "step": mean ops
    per step with the hooks, "py": median and "py_mean": mean Python instructions per check, over
    ``instructions`` checks after the ``steps``}} for one shape."""
    import gradhealth as gh

    make, batch = COUNT_SHAPES[label]()
    out = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model, x = make(), batch()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
        clip = variant.startswith("clip")
        monitor = None if clip else gh.GradHealth(model, opt, on_problem="ignore", lag=int(variant.startswith("deferred")))
        params = [p for p in model.parameters() if p.requires_grad]  # (what clip_grad_norm_ is given)
        act = (lambda: torch.nn.utils.clip_grad_norm_(params, 1e9).item()) if clip else monitor.check
        checks, whole, py, reads = [], [], [], []
        for _ in range(WARM if not clip else 0):  # (past the first checks' dense update norms: a long run's checks)
            opt.zero_grad(set_to_none=True)
            model(x).float().pow(2).mean().backward()
            act()
            opt.step()
        for step in range(steps + instructions):
            opt.zero_grad(set_to_none=True)
            model(x).float().pow(2).mean().backward()
            if step >= steps:  # then the instructions, on checks of their own
                py.append(_instructions(act))
                opt.step()
                continue
            with _Ops(everything=clip) as ops:
                act()
                n = ops.n
                opt.step()
            checks.append(n)
            whole.append(n if clip else ops.n)  # (the clip has no hooks; the optimizer's ops are not the monitor's)
            reads.append(ops.reads)
        if monitor is not None:
            monitor.close()
        out[variant] = {"tensors": sum(1 for _ in model.parameters()), "first": checks[0], "check": statistics.median(checks[1:]),
                        "step": sum(whole[1:]) / len(whole[1:]), "reads": sum(reads[1:]) / len(reads[1:]),
                        "py": statistics.median(py) if py else float("nan"),
                        "py_mean": statistics.mean(py) if py else float("nan")}
    return out


def bench_counts(steps: int = 9, shapes=None) -> dict:
    print("\nwhat a check costs the host, counted: torch ops dispatched (TorchDispatchMode; on a GPU each is a kernel "
          "launch) and Python bytecode instructions (sys.settrace opcode events), per check after the first; "
          "'+hooks': the mean per step with the monitor's optimizer-step hooks (periodic tests amortised); "
          "'syncs': host reads of tensor values per step, hooks included (on a GPU each makes the host wait)")
    print(f"  {'shape':<34}{'tensors':>8}  {'variant':<26}{'first':>7}{'ops/check':>11}{'+hooks':>8}{'syncs':>7}"
          f"{'py instr/check':>16}{'(mean of 8)':>13}")
    out = {}
    for label in shapes or COUNT_SHAPES:
        res = count_shape(label, steps, 8 if steps >= 9 else 1)
        for variant, r in res.items():
            print(f"  {label:<34}{r['tensors']:>8}  {variant:<26}{r['first']:>7}{r['check']:>11.0f}{r['step']:>8.1f}"
                  f"{r['reads']:>7.1f}{r['py']:>16.0f}{r['py_mean']:>13.0f}")
        out[label] = res
    return out
