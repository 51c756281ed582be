"""Where a NaN or inf was born: the module (forward and backward) and the autograd operation.

``trace_nonfinite(model)`` arms hooks for one forward+backward and resolves them, with a single
device-to-host transfer, when the block exits:

* forward: the first module (in completion order, so the deepest) whose output is non-finite;
* backward: the deepest module that received finite gradients at its outputs and passed
  non-finite ones to its inputs or parameters: the ``torch.where``-over-an-overflow and
  mask-after-divide cases, whose forward is clean;
* inside that module, the autograd operation where it happened (``DivBackward0``, ...) and, where
  torch recorded it, the forward source line. This is found by re-running that one module's forward
  and backward (unit upstream gradient, buffers restored, ``.grad`` untouched) with anomaly-mode
  stack recording on; the training step itself runs without anomaly mode.

Unlike ``torch.autograd.detect_anomaly``, inf counts as well as NaN, and during the step the hooks
only keep references (each module's inputs, outputs and their gradients, about one extra copy of
the activations until the block exits); all are judged together at the end, one fused max-abs
reduction per (device, dtype) and one transfer. No hook exists outside the block.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..base.hooks import guarded
from ..base.naming import ROOT
from ..model.params import check_model
from ..model.wrappers import user_modules
from .opwatch import graph_nodes as _graph_nodes, source_of as _source, tensors_in as _tensors

__all__ = ["NonFiniteTracer", "trace_nonfinite", "REPAIRS"]

_ARMED: weakref.WeakSet = weakref.WeakSet()  # every armed tracer (:meth:`NonFiniteTracer.alone`)

REPAIRS = (
    "mask or clamp *before* the dangerous operation (gh.safe_div, gh.safe_log, gh.safe_sqrt, "
    "gh.safe_where: the 'double where'), not after it; guard the domain of log/sqrt/division; "
    "for fp16, an overflow (compute that part in fp32 or lower the scale); and where the composed "
    "function has a finite derivative but autodiff passes through a singular step (exp(log(x)) or "
    "sqrt(x**2) at 0, a norm at 0), rewrite the expression or give it its own backward "
    "(torch.autograd.Function)"
)

#: what to do about a batch that holds NaN/inf
BATCH_FIX = ("Find the samples with (~torch.isfinite(x)).flatten(1).any(1).nonzero() on the inputs, and look at the data "
             "pipeline (a normalisation by a zero std, a log of 0 in preprocessing, a corrupt record); skip or repair "
             "such batches")


def _bad_one(t: Tensor) -> Tensor:
    # min and max in one reduction: NaN propagates into both, +inf into the max, -inf into the
    # min, and finite values stay finite however large (a sum could overflow). Several times
    # cheaper than isfinite(t).all(), which materialises a boolean tensor.
    lo, hi = torch.aminmax(t.detach())
    return ~torch.isfinite(torch.stack([lo, hi])).all()


def _bad(tensors) -> Tensor | None:
    """A 0-d device bool: does any floating tensor hold a NaN or inf? (no host sync)"""
    flags = [_bad_one(t) for t in tensors if t is not None and t.is_floating_point() and t.numel()]
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack(flags).any()


class _Event(NamedTuple):
    module: str
    kind: str  # "fwd" | "inp" | "out" | "in" | "param"
    tensor: Tensor  # judged at resolve time, all together


def _flags(tensors: list[Tensor]) -> list[bool]:
    """Which tensors hold a NaN or inf, with one fused L2 reduction per (device, dtype) and one
    transfer; a non-finite L2 norm can also be an overflow of finite values, so those few tensors
    are looked at again exactly (min and max: NaN propagates, finite values stay finite)."""
    if not tensors:
        return []
    from ..base.distributed import to_local
    from ..measure.stats import fetch, pack_norms

    tensors = [to_local(t) for t in tensors]  # (tensor parallelism: each rank judges what it holds)

    with torch.no_grad():
        packed, perm, _ = pack_norms(tensors)
    values = fetch([packed])
    out = [False] * len(tensors)
    suspects = [perm[k] for k, v in enumerate(values) if not math.isfinite(v)]
    if suspects:
        exact = fetch([_bad_one(tensors[i]).reshape(1) for i in suspects])
        for i, v in zip(suspects, exact):
            out[i] = bool(v)
    return out


class NonFiniteTracer:
    """Hooks for one traced step; see the module docstring. Results are final after ``resolve()``."""

    def __init__(self, model: nn.Module):
        self.root = check_model(model)
        self.forward_origin: str | None = None
        self.backward_origin: str | None = None
        self.backward_op: str | None = None
        self.op_source: str | None = None
        #: where a NaN/inf was born outside any module: (phase, operation, forward source line)
        self.outside: tuple[str, str, str | None] | None = None
        self._ops = None
        self.watched_ops = False  # armed with the op watch
        #: the model's own input (the batch) held NaN/inf
        self.input_nonfinite = False
        #: the forward origin, when its own parameters are already NaN/inf
        self.nonfinite_weights: tuple[str, ...] = ()
        self._handles: list = []
        self._events: list[_Event] = []
        self._inputs: dict[str, tuple] = {}
        self._watched: dict[int, tuple] = {}
        self._armed = False
        self._said: set = set()  # (each hook's own failure said once: :func:`gradhealth.base.hooks.guarded`)
        self._paused = 0  # (:meth:`alone`)

    def __repr__(self) -> str:
        parts = [f"armed={self._armed}", f"forward_origin={self.forward_origin!r}", f"backward_origin={self.backward_origin!r}"]
        if self.backward_op:
            parts.append(f"op={self.backward_op!r}")
        if self.outside:
            parts.append(f"outside={self.outside[1]!r}")
        if self.input_nonfinite:
            parts.append("input_nonfinite=True")
        return f"NonFiniteTracer({', '.join(parts)})"

    # ----------------------------------------------------------------- arming
    def arm(self, ops: bool = False) -> NonFiniteTracer:
        """Install the hooks. ``ops=True`` also watches every operation (`gradhealth.origin.opwatch`) to name
        the one where a NaN was born outside any module: only for a bounded block (it makes every
        operation pay a Python call until ``resolve`` or ``disarm``)."""
        if self._armed:
            return self
        self._armed = True
        _ARMED.add(self)
        self.watched_ops = ops
        if ops:
            from .opwatch import OpWatch

            self._ops = OpWatch().start()
        self._events.clear()
        self._inputs.clear()
        for name, module in user_modules(self.root).items():  # (the user's names, under wrappers inside the model)
            name = name or ROOT
            self._handles.append(module.register_forward_hook(guarded(self._post(name), "NaN tracer's forward hook",
                                                                      self._said), with_kwargs=True))
            for p in module.parameters(recurse=False):
                if p.requires_grad:
                    self._handles.append(p.register_hook(guarded(self._grad_hook([(name, "param")]),
                                                                 "NaN tracer's gradient hook", self._said)))
        return self

    def disarm(self) -> None:
        if self._ops is not None:
            self._ops.stop()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._watched.clear()
        self._armed = False
        _ARMED.discard(self)

    @contextlib.contextmanager
    def alone(self):
        """Inside the block only this tracer records: every other armed one (the monitor's, armed
        for the next step) is paused, so a replay neither feeds nor arms another step's trace."""
        others = [t for t in list(_ARMED) if t is not self]
        paused = others + [t._ops for t in others if t._ops is not None]  # (the tracers' hooks, their op watches)
        for t in paused:
            t._paused += 1
        try:
            yield self
        finally:
            for t in paused:
                t._paused -= 1

    def pause(self) -> None:
        """Stop recording until [resolve][gradhealth.NonFiniteTracer.resolve], keeping what was recorded (its one step seen)."""
        self._paused += 1
        if self._ops is not None:
            self._ops._paused += 1

    @property
    def armed(self) -> bool:
        return self._armed

    def _grad_hook(self, pairs: list[tuple[str, str]]):
        def hook(grad):
            if not self._paused and grad is not None and grad.is_floating_point() and grad.numel():
                for name, kind in pairs:
                    self._events.append(_Event(name, kind, grad))

        return hook

    def _watch(self, t: Tensor, name: str, kind: str) -> None:
        """Ask for ``t``'s gradient: one hook per tensor, however many modules it connects."""
        entry = self._watched.get(id(t))
        if entry is None or entry[0] is not t:
            pairs: list[tuple[str, str]] = []
            self._watched[id(t)] = (t, pairs)
            t.register_hook(guarded(self._grad_hook(pairs), "NaN tracer's gradient hook", self._said))
        else:
            pairs = entry[1]
        pairs.append((name, kind))

    def _post(self, name: str):
        # One hook per module, after its forward: it sees the inputs too, which halves the hook
        # overhead of a pre-hook + post-hook pair.
        def hook(module, args, kwargs, output):
            if self._paused:
                return
            self._inputs[name] = (args, kwargs)
            grad_on = torch.is_grad_enabled()
            events = self._events
            for t in _tensors(args if not kwargs else (args, kwargs)):
                if t.is_floating_point() and t.numel():
                    events.append(_Event(name, "inp", t))
                    if grad_on and t.requires_grad:
                        self._watch(t, name, "in")
            for t in _tensors(output):
                if t.is_floating_point() and t.numel():
                    events.append(_Event(name, "fwd", t))
                    if grad_on and t.requires_grad:
                        self._watch(t, name, "out")
            if module is self.root:
                self._watched.clear()  # the forward is over; the backward hooks keep what they need

        return hook

    # -------------------------------------------------------------- resolving
    def resolve(self) -> NonFiniteTracer:
        """Read every recorded flag in one transfer and name the origins."""
        ops, self._ops = self._ops, None
        self.disarm()
        if ops is not None:
            hit = ops.resolve()
            if hit is not None:
                phase, op, node = hit
                self.outside = (phase, node.name() if node is not None and phase == "backward" else op,
                                _source(node) if node is not None else None)
        events = self._events
        unique: dict[int, int] = {}
        tensors: list[Tensor] = []
        for e in events:  # a tensor that is one module's output and the next one's input: once
            if id(e.tensor) not in unique:
                unique[id(e.tensor)] = len(tensors)
                tensors.append(e.tensor)
        flags = _flags(tensors)
        values = [flags[unique[id(e.tensor)]] for e in events]
        fwd = [e.module for e, v in zip(events, values) if e.kind == "fwd" and v]
        self.forward_origin = fwd[0] if fwd else None
        self.nonfinite_weights = ()
        if self.forward_origin is not None:
            own = _bad(list(self._module(self.forward_origin).parameters(recurse=False)))
            if own is not None and bool(own):
                self.nonfinite_weights = (self.forward_origin,)

        # A module fed non-finite values in its forward passes them on in backward too: a
        # consequence of a forward origin, never a backward origin.
        fed_bad = {e.module for e, v in zip(events, values) if e.kind == "inp" and v}
        self.input_nonfinite = ROOT in fed_bad  # the batch itself
        out_bad: dict[str, bool] = {}
        in_bad: dict[str, int] = {}  # module -> first event index with a non-finite input/param grad
        for k, (e, v) in enumerate(zip(events, values)):
            if e.kind == "out":
                out_bad[e.module] = out_bad.get(e.module, False) or bool(v)
                if v and e.module != ROOT:
                    # gradients reaching a child's output were made by its parent's own code
                    parent = e.module.rpartition(".")[0] or ROOT
                    in_bad.setdefault(parent, k)
            elif e.kind in ("in", "param") and v and e.module not in in_bad:
                in_bad[e.module] = k
        # A module qualifies when its output gradients were all finite (or it had no output
        # gradient at all but is a parameter owner inside the path) and it produced non-finite ones.
        qualifies = [m for m in in_bad if m not in fed_bad and not out_bad.get(m, False) and (m in out_bad or m == ROOT)]
        deepest = [m for m in qualifies if not any(o != m and (m == ROOT or o.startswith(m + ".")) for o in qualifies)]
        deepest.sort(key=lambda m: in_bad[m])
        self.backward_origin = deepest[0] if deepest else None
        if self.backward_origin is not None:
            self._find_op(self.backward_origin)
        self._inputs.clear()
        self._events = []
        return self

    def _module(self, name: str) -> nn.Module:
        return self.root if name == ROOT else self.root.get_submodule(name)

    def _find_op(self, name: str) -> None:
        """Re-run the origin module alone, with anomaly-mode stacks, to name the operation."""
        captured = self._inputs.get(name)
        if captured is None:
            return
        module = self._module(name)
        args, kwargs = captured
        buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
        rng = torch.random.get_rng_state()
        found: list[tuple[str, str | None]] = []
        try:
            leaves = []

            def detach(o):
                if isinstance(o, Tensor):
                    if o.is_floating_point():
                        leaf = o.detach().requires_grad_(True)
                        leaves.append(leaf)
                        return leaf
                    return o
                if isinstance(o, (list, tuple)):
                    return type(o)(detach(x) for x in o)
                if isinstance(o, dict):
                    return {k: detach(v) for k, v in o.items()}
                return o

            args2, kwargs2 = detach(args), detach(kwargs)
            params = [p for p in module.parameters() if p.requires_grad]
            with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=False):
                outs = [t for t in _tensors(module(*args2, **kwargs2)) if t.requires_grad]
                if not outs:
                    return
                nodes = _graph_nodes([o.grad_fn for o in outs], stop_at=leaves + params)
                handles = []
                records: list[tuple] = []
                for node in nodes:
                    handles.append(node.register_hook(lambda gi, go, node=node: records.append((node, _bad(go), _bad(gi)))))
                try:
                    torch.autograd.grad(outs, leaves + params, [torch.ones_like(o) for o in outs], allow_unused=True)
                finally:
                    for h in handles:
                        h.remove()
            flags = [(n, a, b) for n, a, b in records if b is not None]
            if flags:
                vals = torch.stack([torch.stack([a if a is not None else torch.zeros((), dtype=torch.bool, device=b.device), b]) for _, a, b in flags]).tolist()
                for (node, _, _), (went_in_bad, came_out_bad) in zip(flags, vals):
                    if came_out_bad and not went_in_bad:
                        found.append((node.name(), _source(node)))
                        break
        except Exception:  # best effort: the module-level answer stands without it
            return
        finally:
            torch.random.set_rng_state(rng)
            with torch.no_grad():
                for k, b in module.named_buffers():
                    if k in buffers:
                        b.copy_(buffers[k])
        if found:
            self.backward_op, self.op_source = found[0]

    def explain(self) -> str:
        """What the origins mean and the usual repairs, in words."""
        if self.forward_origin is None and self.backward_origin is None:
            if self.outside is not None:
                phase, op, source = self.outside
                return (f"no module produced it: the NaN/inf was born outside the model's modules (the loss or "
                        f"functional code), in the {phase} at {op}" + (f" (forward: {source})" if source else "")
                        + ". Usual repairs: " + REPAIRS + ".")
            return ("no module produced a NaN or inf in this step (it may have come from outside the model, e.g. the "
                    "loss: run the failing step inside gh.trace_nonfinite(model), or gh.replay_nonfinite, to name the "
                    "operation and its line)")
        parts = []
        if self.forward_origin is not None and self.forward_origin in self.nonfinite_weights:
            return (
                f"the weights of module {self.forward_origin!r} are already NaN/inf: an earlier optimizer.step() "
                "applied non-finite gradients, so every later step is poisoned and the true origin is in that "
                "earlier step. Keep such a step's gradients out of the weights (the step guard: skip_nonfinite=True on "
                "the monitor or either callback; in a plain loop, optimizer.step() only if report.grads_finite), "
                "reload the last good checkpoint, and trace that batch again with gh.trace_nonfinite(model)"
            )
        if self.forward_origin is not None and self.input_nonfinite:
            return (
                f"the batch itself holds NaN/inf: module {self.forward_origin!r} was the first to receive it, and the "
                "model's input was already non-finite, so the data is the cause, not the model. " + BATCH_FIX)
        if self.forward_origin is not None:
            parts.append(f"the forward first produced a non-finite output in module {self.forward_origin!r}")
        if self.backward_origin is not None:
            where = f"module {self.backward_origin!r}"
            if self.backward_op:
                where += f", at {self.backward_op}"
                if self.op_source:
                    where += f" (forward: {self.op_source})"
            clean = " although its forward output was finite" if self.forward_origin is None else ""
            parts.append(f"backward turned finite gradients into NaN/inf inside {where}{clean}")
        return "; ".join(parts) + ". Usual repairs: " + REPAIRS + "."


@contextlib.contextmanager
def trace_nonfinite(model: nn.Module):
    """Arm a [NonFiniteTracer][gradhealth.NonFiniteTracer] for the forward and backward run inside the block."""
    tracer = NonFiniteTracer(model).arm(ops=True)
    try:
        yield tracer
    finally:
        tracer.resolve()
