"""``OpWatch``: the operation where a NaN or inf was born, wherever it runs (the loss, functional
code between modules), for one bounded traced step.

While it watches, anomaly mode records the forward stack of every autograd node, a function mode
sees every torch function of the forward (its output's autograd node then carries that stack), and
a dispatch mode sees every operation autograd runs in the backward (``_current_autograd_node``).
For each it keeps a 0-d device flag "finite inputs, non-finite output"; ``resolve`` reads all the
flags in one transfer and names the first such operation of the forward, else of the backward.
It is only used for bounded blocks (``trace_nonfinite``, ``replay_nonfinite``, the Lightning
replay): every operation pays a Python call while it watches.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import sysconfig

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["OpWatch", "graph_nodes", "source_of", "tensors_in"]

LIMIT = 200_000  # operations recorded at most (a runaway block keeps working, unrecorded)

#: torch's operations that write a value they are given rather than compute one: creation
#: (``empty``, ``full``, ``zeros``, the ``*_like`` and ``new_*`` families) and fills. A NaN/inf in
#: their output is a fresh allocation's contents or a constant put there on purpose (an inf sentinel,
#: a -inf attention mask), never a NaN born from the data; what a later operation makes of it is.
_WRITES = frozenset({"empty", "empty_strided", "empty_permuted", "full", "zeros", "ones", "scalar_tensor", "fill",
                     "fill_", "masked_fill", "masked_fill_", "index_fill", "index_fill_", "resize_", "set_"})


def writes_a_given_value(op: str) -> bool:
    """Is ``op`` (a torch function's name, or a dispatcher op such as ``aten.empty.memory_format``)
    one of :data:`_WRITES`?"""
    name = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 1 else op
    return name in _WRITES or name.endswith("_like") or name.startswith("new_")


def _floats(obj) -> list:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def _bad(tensors) -> torch.Tensor | None:
    """0-d device bool: any NaN or inf among ``tensors`` (min/max: no overflow of finite values)."""
    flags = [~torch.isfinite(torch.stack(list(torch.aminmax(t.detach())))).all() for t in tensors]
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack(flags).any()


class _Forward(TorchFunctionMode):
    def __init__(self, watch: OpWatch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.watch.note("forward", getattr(func, "__name__", str(func)), args, kwargs, out,
                        lambda: next((t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                                      and t.grad_fn is not None), None))
        return out


class _Backward(TorchDispatchMode):
    def __init__(self, watch: OpWatch):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        # an operation of the backward; a view (narrow, slice, view...) is skipped: it reads values its input
        # holds, so it never turns finite inputs into NaN/inf, and reading its input whole costs a pass over a
        # whole buffer (DeepSpeed narrows its 2 GB reduce buffer at every gradient)
        if node is not None and not getattr(func, "is_view", False):
            self.watch.note("backward", str(func), args, kwargs, out, lambda: node)
        return out


class OpWatch:
    def __init__(self):
        self.records: list[tuple] = []  # (flag, phase, op, node)
        self._modes: list = []
        self._anomaly = None
        self._paused = 0  # (another block's replay runs: what it does is not this block's)

    def start(self) -> OpWatch:
        if self._modes:
            return self
        self._anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        torch.autograd.set_detect_anomaly(True, check_nan=False)  # forward stacks on every node
        self._modes = [_Forward(self), _Backward(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def stop(self) -> None:
        for m in reversed(self._modes):
            m.__exit__(None, None, None)
        self._modes = []
        if self._anomaly is not None:
            torch.autograd.set_detect_anomaly(*self._anomaly)
            self._anomaly = None

    def note(self, phase: str, op: str, args, kwargs, out, node) -> None:
        if self._paused or len(self.records) >= LIMIT or op == "__get__" or writes_a_given_value(op):
            return  # (attribute reads, p.grad or .data, make nothing)
        outs = _floats(out)
        if not outs:
            return
        made = _bad(outs)
        given = _bad(_floats((args, kwargs or {})))
        flag = made if given is None else made & ~given.to(made.device)
        self.records.append((flag, phase, op, node()))

    def resolve(self) -> tuple[str, str, object] | None:
        """(phase, op, autograd node) of the first operation that turned finite inputs into a
        NaN/inf: in the forward if any, else in the backward; None if none did."""
        self.stop()
        if not self.records:
            return None
        device = self.records[0][0].device
        flags = torch.stack([r[0].to(device) for r in self.records]).tolist()
        hits = [r for r, f in zip(self.records, flags) if f]
        self.records = []
        for phase in ("forward", "backward"):
            for _, p, op, node in hits:
                if p == phase:
                    return p, op, node
        return None


def tensors_in(obj, limit: int = 16) -> list[torch.Tensor]:
    """The first ``limit`` tensors in a module's inputs or output (tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if type(obj) is tuple and all(isinstance(o, torch.Tensor) for o in obj):
        return list(obj[:limit])
    out: list[torch.Tensor] = []

    def walk(o):
        if len(out) >= limit:
            return
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):  # HF ModelOutput is an OrderedDict
            for x in o.values():
                walk(x)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name, None))
        elif isinstance(o, types.SimpleNamespace):
            for x in vars(o).values():
                walk(x)

    walk(obj)
    return out


def graph_nodes(roots, stop_at) -> list:
    stop = {id(t) for t in stop_at}
    seen, order, stack = set(), [], [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        var = getattr(node, "variable", None)
        if var is not None and id(var) in stop:
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return order


def source_of(node) -> str | None:
    """``file:line in function: code`` of the innermost user frame torch recorded for ``node``."""
    tb = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
    if not tb:
        return None
    lines = "".join(tb if isinstance(tb, list) else [str(tb)]).splitlines()
    skip = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"], "<frozen")
    here = os.path.dirname(os.path.abspath(__file__))  # gradhealth's own frames (not its demo's models)
    own = {os.path.join(here, f) for f in ("trace.py", "opwatch.py", "replay.py")} | {
        os.path.join(os.path.dirname(here), "monitor.py")}
    frames = []
    for k, ln in enumerate(lines):
        m = re.match(r'\s*File "(.*)", line (\d+), in (.*)', ln)
        if m:
            code = lines[k + 1].strip() if k + 1 < len(lines) and not lines[k + 1].lstrip().startswith("File ") else ""
            frames.append((m.group(1), m.group(2), m.group(3), code))
    user = [f for f in frames if not f[0].startswith(skip) and os.path.abspath(f[0]) not in own]
    pick = (user or frames)[-1] if frames else None
    if pick is None:
        return None
    path, line, func, code = pick
    return f"{path}:{line} in {func}" + (f": {code}" if code else "")
