"""The DDP wrapper as a check needs it: is this backward inside ``no_sync`` or between an engine's
accumulation boundaries (``Ranks``), and the communication hook that notes each rank's gradients
before the all-reduce, to name the rank where a NaN came from (``RankOrigin``). The collectives
themselves are :mod:`gradhealth.base.distributed`; what a check packs and reduces is
:mod:`.crossrank`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..base.distributed import active, collective_device, fsdp1_sharded, rank, world_size
from ..base.hooks import guarded
from ..model import accumulation
from ..model.wrappers import ddp_of, unwrap

__all__ = ["RankOrigin", "Ranks"]


def _first_grad_tensor(output, depth: int = 3):
    """The first tensor that requires grad in a module's output (a tensor, or one in a tuple, list or
    mapping, a few levels deep), else None."""
    if isinstance(output, Tensor):
        return output if output.requires_grad else None
    if depth and isinstance(output, (tuple, list, dict)):
        for item in output.values() if isinstance(output, dict) else output:
            got = _first_grad_tensor(item, depth - 1)
            if got is not None:
                return got
    return None


class RankOrigin:
    """A DDP communication hook that notes each parameter's local gradient norm before the
    all-reduce (one fused norm per bucket, no sync), then runs DDP's default all-reduce.

    DDP cannot unregister a comm hook: after the monitor closes, it only forwards.
    """

    def __init__(self, ddp_model):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self._allreduce = allreduce_hook
        self.local: dict[int, Tensor] = {}
        self.enabled = True
        self.said: set = set()
        ddp_model.register_comm_hook(self, RankOrigin._hook)
        self.ran = False  # the hook ran since the last check
        #: backwards since the last check through a training forward of the wrapped module that DDP
        #: was to reduce (a forward whose output holds no tensor to hook: counted at the forward)
        self.forwards = 0
        self._ddp = ddp_model
        self._handle = ddp_model.module.register_forward_hook(guarded(self._forward, "DDP forward hook"))
        self._backward = guarded(self._backward_ran, "DDP output hook")

    def _forward(self, module, args, output) -> None:
        if torch.is_grad_enabled() and module.training and self._ddp.require_backward_grad_sync:
            out = _first_grad_tensor(output)
            if out is None:
                self.forwards += 1
            else:  # (counted when a backward goes through it: a forward without one reduces nothing, e.g.
                out.register_hook(self._backward)  # Lightning's SWA recomputing batch-norm statistics)

    def _backward_ran(self, grad) -> None:
        self.forwards += 1

    def unsynced(self) -> bool:
        """A backward went through a training forward DDP was to reduce since the last check, and
        DDP's communication never ran (its hooks lost, or the forward bypassed the wrapper); counts
        restart."""
        out = self.forwards > 0 and not self.ran
        self.forwards, self.ran = 0, False
        return out

    @staticmethod
    def _hook(state: RankOrigin, bucket):
        state.ran = True
        if state.enabled:
            guarded(state._note, "DDP communication hook", state.said)(bucket)  # (the all-reduce runs whatever happens)
        return state._allreduce(None, bucket)

    def _note(self, bucket) -> None:
        grads = bucket.gradients()
        if grads:
            norms = torch._foreach_norm(grads)
            for p, n in zip(bucket.parameters(), norms):
                self.local[id(p)] = n

    def take(self, params: list[Tensor], reduced: list[float | None]) -> tuple[list[float], list[float]] | None:
        """Per parameter: (non-finite before all-reduce, all-zero before all-reduce) as 0/1.
        ``reduced``: the check's own norms of the reduced gradients (scaled: they never overflow).
        The hook's plain 2-norm is inf for finite elements too large to square (1e20 in float32,
        a few hundred in float16): an inf is an inf element only where the reduced gradient is
        non-finite too (DDP averages: an inf element stays inf, finite ones stay finite); a NaN
        norm always is one. (A max-norm would tell at once, but costs 4x the 2-norm on the CPU.)"""
        snap = self.snapshot(params)
        return self.judge(snap, snap[1].tolist() if snap is not None and snap[1] is not None else [], reduced)

    def snapshot(self, params: list[Tensor]) -> tuple[list[bool], Tensor | None] | None:
        """The hook's norms of ``params`` as one device tensor (which had one), taken now; read it
        with the check's transfer (a deferred check) or at once (:meth:`take`)."""
        if not self.local:
            return None
        vals = [self.local.get(id(p)) for p in params]
        present = [v for v in vals if v is not None]
        self.local = {}
        return [v is not None for v in vals], torch.stack(present) if present else None

    def judge(self, snap, fetched: list[float], reduced: list[float | None]) -> tuple[list[float], list[float]] | None:
        """:meth:`take` from a :meth:`snapshot` and its values read back."""
        if snap is None:
            return None
        it = iter(fetched)
        vals = snap[0]
        bad, zero = [], []
        for v, after in zip(vals, reduced):
            x = next(it) if v else 0.0
            overflow = x == math.inf and after is not None and math.isfinite(after)
            bad.append(0.0 if math.isfinite(x) or overflow else 1.0)
            zero.append(1.0 if x == 0.0 else 0.0)
        return bad, zero


class Ranks:
    """The monitor's view of ``torch.distributed``: whether it is on, who we are, the collective's
    device, whether every gradient is a shard (FSDP1), and the DDP wrapper with its hooks.

    The DDP wrapper is the one passed, one in the chain of wrappers the monitor was given, or one
    that refers to the user's module (:func:`gradhealth.model.wrappers.ddp_of`); a monitor made before the wrapper
    exists (``fabric.setup`` after it) looks again at the model's first training forward, which runs
    inside the wrapper. That forward hook also notes whether DDP reduces the coming backward (DDP
    decides it there, from ``require_backward_grad_sync``): a check after ``no_sync()`` (Fabric's
    ``no_backward_sync``) has ended still sees local gradients.

    Whether an optimizer step ran on gradients DDP did not reduce is read after the step, from the
    last training forward before it: a step that takes a closure (Lightning's, LBFGS) runs its
    forward and backward inside ``step()``, after the step's pre-hooks, so only then is it known
    what the step consumed (Lightning runs the first micro-batches of a window under ``no_sync()``
    and the last one, inside ``step()``, reduced)."""

    def __init__(self, model, ddp_model=None, rank_origin: bool = True, optimizers=()):
        from torch import nn

        self.active = active()
        self.world = world_size()
        self.rank = rank()
        # FSDP1 (FullyShardedDataParallel, use_orig_params=True) hands each rank a flat slice of
        # every gradient, whatever its shape: all of them count as shards
        self.all_sharded = self.active and fsdp1_sharded(model)
        self.device = collective_device() if self.active else None
        self._host_group = None
        if ddp_model is not None and not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
            raise TypeError(f"ddp_model must be a torch.nn.parallel.DistributedDataParallel; got {type(ddp_model).__name__}")
        self.nosync_step = False  # an optimizer step ran on gradients DDP did not reduce
        self.synced_step = False  # an optimizer step ran on gradients DDP reduced (the loop synchronises)
        self.forward_synced = True  # DDP reduces the backward of the last training forward
        self._optimizers, self._rank_origin = list(optimizers), rank_origin
        self._step_hooks: list = []
        self.ddp, self.origin = None, None
        self._watch = None
        # an engine that owns its accumulation (DeepSpeed's, on one process too): checks between its boundaries wait
        self.accumulation = accumulation.watch(model)
        if not self.active:
            return
        found = ddp_model if ddp_model is not None else ddp_of(model)
        if found is not None:
            self._attach(found)
        # (every training forward: is the coming backward reduced; without a wrapper yet, look again once)
        self._watch = unwrap(model).register_forward_pre_hook(guarded(self._forward, "DDP forward pre-hook"))
        self._looked = found is not None

    def _forward(self, module, args) -> None:
        if not torch.is_grad_enabled():
            return
        if self.ddp is None and not self._looked:
            self._looked = True
            found = ddp_of(module)
            if found is not None:
                self._attach(found)
        if self.ddp is not None:
            self.forward_synced = bool(self.ddp.require_backward_grad_sync)

    def _attach(self, ddp) -> None:
        import warnings

        from ..base.errors import GradHealthInternalWarning

        self.ddp = ddp
        self.watch_steps(self._optimizers)
        if self._rank_origin:
            try:
                self.origin = RankOrigin(ddp)
            except Exception as exc:  # e.g. the model already has a comm hook
                warnings.warn(f"gradhealth: no rank-origin hook on the DDP model ({exc}); NaN is not traced to a rank",
                              GradHealthInternalWarning, stacklevel=4)

    def watch_steps(self, optimizers) -> None:
        """Note an optimizer step taken on gradients DDP did not reduce: the backward of the last
        training forward before the step's end ran without DDP's reduction (that forward ran inside
        ``no_sync()`` or with ``require_backward_grad_sync`` False). Read after the step, so a
        closure's forward counts; whether ``no_sync()`` is still open around the step itself does
        not matter (the gradients were reduced at their backward, or not)."""
        if self.ddp is None or not self.active:
            return

        def after(opt, args, kwargs) -> None:
            if self.forward_synced:
                self.synced_step = True
            else:
                self.nosync_step = True

        self._step_hooks = [opt.register_step_post_hook(guarded(after, "DDP step post-hook")) for opt in optimizers]

    def take_nosync_step(self) -> bool:
        out, self.nosync_step = self.nosync_step, False
        return out

    def never_synced(self) -> bool:
        """The loop stepped on gradients DDP did not reduce, and no step so far on reduced ones: a
        check inside ``no_sync()`` now waits for a synchronising micro-step the loop does not have
        (its last micro-step is under ``no_sync()`` too), so it is made at once. Every rank running
        that loop decides so at the same call (a loop that synchronises on some ranks only already
        stalls DDP's own all-reduce on the others)."""
        return self.nosync_step and not self.synced_step

    def in_no_sync(self) -> bool:
        """The gradients are local and partial: inside DDP's ``no_sync()``, or after a backward that
        ran so (the check after Fabric's ``no_backward_sync`` block); the synchronising step is
        checked."""
        return self.ddp is not None and not (self.ddp.require_backward_grad_sync and self.forward_synced)

    def defers(self) -> bool:
        """A check now waits for the one that ends the window: inside ``no_sync()`` (unless the loop
        never synchronises: :meth:`never_synced`), or between an engine's accumulation boundaries."""
        return (self.in_no_sync() and not self.never_synced()) or self.between_boundaries()

    def between_boundaries(self) -> bool:
        """The last backward is a part of an engine's accumulation window (:mod:`gradhealth.model.accumulation`)."""
        return self.accumulation is not None and self.accumulation.between()

    def host_group(self):
        """A gloo group of the same ranks, for a collective on numbers already on the host (a
        deferred check's: through NCCL they would travel to the device and back, a synchronisation).
        The default group when it is gloo; else made once, at a check every rank makes together."""
        if self._host_group is None:
            self._host_group = (torch.distributed.group.WORLD if self.device.type == "cpu"
                                else torch.distributed.new_group(backend="gloo"))
        return self._host_group

    def close(self) -> None:
        if self.accumulation is not None:
            self.accumulation.close()
            self.accumulation = None
        for h in self._step_hooks:
            h.remove()
        self._step_hooks = []
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        if self.origin is not None:
            self.origin.enabled = False  # DDP cannot unregister a comm hook: it only forwards now
            self.origin._handle.remove()
