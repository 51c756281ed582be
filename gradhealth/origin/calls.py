"""Where a NaN came from, named at the check that finds it, in the loop as a user writes it.

The forward watch's pre-hook (:class:`gradhealth.judge.guards.ForwardWatch`) keeps each call the loop makes into
the model with grad enabled until the next check: a reference to its inputs (no copy) and the CPU
random state before it (:class:`LoopCalls`). The model itself is watched from the start; its direct
children from the check after the first that saw no call of the model (RL code calls
``policy.q_net(obs)``, a GAN ``model.G(z)``; until then their calls cost the forward nothing), or
from the start when the model has no ``forward`` of its own. A child's call made inside the model's
forward is part of that call. A healthy check drops them: nothing is read, nothing is copied.

A check whose gradients hold NaN/inf, before ``optimizer.step()`` (the weights are still the ones
the forward used), :func:`origin`:

1. reads whether the kept inputs that are data (no ``grad_fn``: the batch, not an activation) are
   finite, in one transfer: a non-finite one names the batch and the module that received it;
2. else replays the calls under the NaN tracer (:class:`.trace.NonFiniteTracer`): each forward from
   its random state on its inputs (detached), then a backward from its outputs with unit output
   gradients through ``torch.autograd.grad`` (no ``.grad`` is written, no post-accumulate hook runs).
   Buffers, random states and what the monitor's own hooks saw are put back. The tracer names the
   module, the autograd operation and its source line; when no module made the NaN/inf (the loss,
   code between modules), the next failing step is traced operation by operation.

Not replayed (the tracer is armed for the next step instead, as before): a ``lag=1`` check (the
weights have moved by the time it completes; the batch is still named: its inputs are kept one
check longer), under torch.distributed (a replay's backward would reach the reducer's hooks), a
grad scaler or an engine that owns the step (DeepSpeed, fp16 wrappers). At most ``KEEP`` calls are
kept between two checks (the latest). Only the CPU random state is kept (reading a GPU's would cost
the healthy forward): on a GPU a replay draws new dropout masks, and the forward's autocast is not
repeated either; a NaN those make may not reproduce (then it is traced at the next failing step).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..base.errors import GradHealthInternalWarning
from ..base.findings import Finding, FindingKind
from ..base.hooks import guarded
from ..base.naming import ROOT
from .opwatch import tensors_in

__all__ = ["LoopCalls", "origin", "KEEP"]

#: at most this many calls are kept between two checks (the latest): micro-batches, a GAN's calls
KEEP = 16
_get_rng = torch.default_generator.get_state  # (the CPU generator: torch.random.get_rng_state without its Python frame)


class Call(NamedTuple):
    name: str  # the module's name in the model (ROOT: the model)
    module: nn.Module
    args: tuple
    kwargs: dict
    rng: Tensor  # the CPU random state before it


class LoopCalls:
    """The calls the loop made into the model since the last check (see the module docstring)."""

    def __init__(self, root: nn.Module, children: bool = True):
        self.root = root
        self.kept: list[tuple] = []  # (a Call's fields)
        self.inside = 0  # inside a kept call (a call it makes is part of it), or a replay
        self.may_extend = children  # (False: the watch's own entries are the children, a LightningModule's)
        self._handles: list = []
        self._said: set = set()
        if children and type(root).forward is nn.Module.forward:  # (a container: the loop calls its children)
            self._watch_children()

    def keep(self, name: str, module: nn.Module, args, kwargs) -> None:
        """A call with grad enabled (the caller checked): kept unless made inside the model's own
        forward or a replay (a plain tuple: :class:`Call`'s fields)."""
        if self.inside:
            return
        kept = self.kept
        if len(kept) >= KEEP:
            del kept[0]
        kept.append((name, module, args, kwargs, _get_rng()))

    def take(self) -> list[tuple]:
        """The calls since the last check, forgotten here. None kept while gradients were made: the
        loop calls the model's children, watched from now on."""
        kept, self.kept = self.kept, []
        if not kept and self.may_extend:
            self.may_extend = False
            self._watch_children()
        return kept

    def _watch_children(self) -> None:
        self.may_extend = False
        children = list(self.root.named_children())
        if not children:
            return
        root = self.root
        self._handles += [root.register_forward_pre_hook(self._enter),
                          root.register_forward_hook(self._leave, always_call=True)]
        for name, child in children:
            self._handles.append(child.register_forward_pre_hook(guarded(
                functools.partial(self._child, name), "forward pre-hook (the loop's calls)", self._said), with_kwargs=True))

    def _enter(self, module, args) -> None:
        self.inside += 1

    def _leave(self, module, args, output) -> None:
        if self.inside:
            self.inside -= 1

    def _child(self, name: str, module, args, kwargs) -> None:
        if torch.is_grad_enabled() and not self.inside:
            self.keep(name, module, args, kwargs)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.inside = 0


def _data(calls: list[Call]) -> list[tuple[int, str, Tensor]]:
    """(call index, argument, tensor) for each floating input that is data: made outside autograd
    (no ``grad_fn``) and not a parameter."""
    out = []
    for k, c in enumerate(calls):
        named = [(str(i), a) for i, a in enumerate(c.args)] + [(key, v) for key, v in c.kwargs.items()]
        for arg, value in named:
            for t in tensors_in(value):
                if t.grad_fn is None and t.is_floating_point() and t.numel() and not isinstance(t, nn.Parameter):
                    out.append((k, arg, t))
    return out


def _batch(calls: list[Call], step: int) -> Finding | None:
    """NONFINITE_ORIGIN naming the batch when a data input of a call holds NaN/inf (one transfer:
    min and max of each, where NaN and inf propagate and finite values stay finite)."""
    from ..measure.stats import fetch
    from .trace import BATCH_FIX, _bad_one

    data = _data(calls)
    flags = fetch([_bad_one(t).reshape(1) for _, _, t in data]) if data else []
    hit = next((d for d, bad in zip(data, flags) if bad), None)
    if hit is None:
        return None
    k, arg, _ = hit
    name = calls[k].name
    what = ("the model's input" if name == ROOT else f"the input of module {name!r}") + (
        f" (argument {arg})" if arg.isdigit() else f" ({arg}=)")
    return Finding(FindingKind.NONFINITE_ORIGIN, f"at step {step}, the batch itself holds NaN/inf: {what} was already "
                   f"non-finite when the loop called it, so the data is the cause, not the model. {BATCH_FIX}",
                   level="error", step=step,
                   data={"forward_origin": name, "backward_origin": None, "op": None, "source": None, "poisoned": False,
                         "input_nonfinite": True, "called": name, "replayed": False})


def _detached(value, leaves: list):
    if isinstance(value, Tensor):
        if value.is_floating_point() and value.requires_grad:
            leaf = value.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_detached(v, leaves) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _detached(v, leaves)) for k, v in value.items())
    return value


def _replay(model: nn.Module, calls: list[Call], tracker, said: set):
    """The calls again under the tracer (see the module docstring); everything put back. Returns
    the resolved tracer and whether the replay's own gradients held NaN/inf (it reproduced)."""
    from .snapshot import rng_state, set_rng_state
    from .trace import NonFiniteTracer, _flags

    modules = {id(c.module): c.module for c in calls}
    buffers = {id(b): (b, b.detach().clone()) for m in modules.values() for b in m.buffers()}
    witnesses = [s for w in tracker.witness._watch.values() for (_, s, _) in w.values()] if tracker is not None else []
    armed = [s[0] for s in witnesses]
    now = rng_state()
    tracer, grads = NonFiniteTracer(model), []
    tracer._said = said  # (a hook's failure said once per monitor)
    try:
        for s in witnesses:  # (the stale-gradient hooks: a replay's gradient is no loop's backward)
            s[0] = False
        tracer.arm(ops=False)
        with torch.enable_grad(), tracer.alone():
            for c in calls:
                torch.random.set_rng_state(c.rng)
                leaves: list[Tensor] = []
                args, kwargs = _detached(c.args, leaves), _detached(c.kwargs, leaves)
                outs = [t for t in tensors_in(c.module(*args, **kwargs), 64) if t.requires_grad and t.is_floating_point()]
                inputs = leaves + [p for p in c.module.parameters() if p.requires_grad]
                if outs and inputs:
                    grads += torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs], allow_unused=True)
        tracer.resolve()
        return tracer, any(_flags([g for g in grads if g is not None]))
    finally:
        tracer.disarm()
        for s, a in zip(witnesses, armed):
            s[0] = a
        with torch.no_grad():
            for b, v in buffers.values():
                b.copy_(v)
        set_rng_state(now)


def origin(m, kept: list[tuple], step: int, replay: bool) -> Finding | None:
    """Where the NaN/inf of monitor ``m``'s check ``step`` came from, from the loop's ``calls``: the
    batch, or (``replay``) the module, operation and line of a replay; None when they name nothing
    (the monitor's tracer is armed for the next step then, operation by operation after a replay)."""
    calls = [Call(name, module, args, kwargs or {}, rng) for name, module, args, kwargs, rng in kept]
    if not calls:
        return None
    found = _batch(calls, step)
    if found is not None or not replay:
        return found
    carry, watch = m.carry, m._watch
    saved = carry.forward, carry.output_grad, carry.eval_backward, carry.router
    lc = watch.calls if watch is not None else None
    if lc is not None:
        lc.inside += 1  # (the replay's own calls are not the loop's)
    try:
        tracer, reproduced = _replay(m.model, calls, m.tracker, carry.trace_said)
    except Exception as exc:
        warnings.warn(f"gradhealth: the replay of step {step}'s calls failed ({type(exc).__name__}: {exc}); the "
                      "next step is traced instead, training continues unchanged", GradHealthInternalWarning, stacklevel=4)
        return None
    finally:
        carry.forward, carry.output_grad, carry.eval_backward, carry.router = saved
        if lc is not None:
            lc.inside -= 1
    from .replay import origin_finding

    if not reproduced or tracer.forward_origin is None and tracer.backward_origin is None:
        carry.trace_ops = True  # no module made it: the next failing step is traced operation by operation
        return Finding(FindingKind.NONFINITE_ORIGIN, f"replayed at step {step} (the model's calls of that step): no "
                       "module produced the NaN/inf (their own gradients stay finite), so it is born outside them (the loss, functional code between "
                       "modules); the next failing step is traced operation by operation to name the operation and its "
                       "source line", level="info", step=step, data={"replayed": True})
    return origin_finding(tracer, step, f"replayed at step {step} (the model's calls of that step, before "
                                        "optimizer.step()): ", level="error", replayed=True)
