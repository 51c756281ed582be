"""Parameter updates measured through the optimizer's own step hooks, and stale-gradient detection.

Each check snapshots the parameters of the optimizers it judged, and the optimizer's own step
post-hook measures ||Δθ|| per parameter after the step, entirely on the device: nothing is read
back until the monitor's next check, whose single transfer carries these numbers too (or
``monitor.flush()``). The snapshot is taken at the check rather than in a step pre-hook because
trainers that run forward and backward inside ``optimizer.step(closure)`` (Lightning) call the
pre-hook before the check; between a check and its step the parameters do not change.

Two modes:

* ``"exact"`` keeps a copy of every parameter across the step (1x parameter memory, during the
  step only) and measures ||θ_after - θ_before|| exactly.
* ``"sample"`` (default) keeps a fixed sample of each tensor (evenly spaced blocks): extra memory is at
  most ``budget`` (2%) of parameter memory. The update norm (and the parameter norm of the
  ratio) is the sample's, scaled by sqrt(numel / samples). Whether a parameter changed at all is
  tested exactly on the sampled elements and, for the rest, by comparing the whole tensor's L1
  norm before and after (a change confined to unsampled elements and too small to move that
  float32 sum can be missed: below ~1e-7 of the tensor's L1 norm).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .distributed import to_local
from .naming import spread
from .stats import foreach_norms, plan_groups

__all__ = ["UpdateTracker", "StepStats", "WITNESSES"]

#: gradients watched per optimizer for STALE_GRAD and skipped steps: zero_grad clears all of an
#: optimizer's gradients together, so a few, spread over the parameter list, tell the same as all
WITNESSES = 8


def _grouped(tensors: list[Tensor]) -> list[list[int]]:
    return [idx for _, _, idx in plan_groups(tensors)]


def _apply(op, groups: list[list[int]], tensors: list[Tensor], other=None) -> list[Tensor]:
    """A foreach ``op`` per (device, dtype) group, results back in the original order."""
    out: list = [None] * len(tensors)
    for idx in groups:
        args = [tensors[i] for i in idx]
        res = op(args, other if not isinstance(other, list) else [other[i] for i in idx])
        for i, r in zip(idx, res):
            out[i] = r
    return out


def _norms(tensors: list[Tensor], groups: list[list[int]]) -> Tensor:
    """L2 norms as one 1-d float64 tensor, one foreach kernel per (device, dtype) group."""
    out: list = [None] * len(tensors)
    for idx in groups:
        for i, r in zip(idx, foreach_norms([tensors[i] for i in idx])):
            out[i] = r
    device = tensors[0].device
    return torch.stack([o.to(device=device, dtype=torch.float64) for o in out])


@dataclass
class _OptPlan:
    ids: list[int]
    idx: list[int]
    params: list[Tensor]
    views: list[Tensor]
    ptrs: list[int]
    groups: list[list[int]]


@dataclass
class StepStats:
    """One measured optimizer step, still on the device until the monitor fetches it."""

    indices: list[int]  # entry indices of the parameters this optimizer stepped
    packed: Tensor  # [update norm of the sample (n), param norm before (n), changed flag (n)], float64
    values: list[float] = field(default_factory=list)

    def unpack(self, scale: list[float]):
        n = len(self.indices)
        v = self.values
        upd = [v[k] * scale[k] for k in range(n)]
        before = v[n : 2 * n]
        changed = [bool(x) for x in v[2 * n : 3 * n]]
        return upd, before, changed


class UpdateTracker:
    """Installs step pre/post hooks on each optimizer; measures the steps that follow a check."""

    def __init__(self, entries, optimizers, mode: str = "sample", budget: float = 0.02, seed: int = 0):
        self.entries = entries
        self.mode = mode
        self.budget = budget
        self.index = {id(p): i for i, (_, p) in enumerate(entries)}
        self.armed_step: int | None = None
        self.steps_since_check = 0
        self.pending: list[StepStats] = []
        self.stale: set[int] = set()
        self._inflight: dict[int, tuple] = {}
        self._plans: dict[int, _OptPlan] = {}
        self._after: dict[int, tuple] = {}  # per optimizer: versions and whole-tensor norms last read
        self._snaps: dict[int, tuple] = {}  # per optimizer: versions and the sample last copied
        self._handles = []
        self._grad_hooks: dict[int, list] = {}
        self._seed = seed
        self._plan_samples()
        for opt in optimizers:  # the snapshot is taken at the check (see arm), the measurement after the step
            self._handles.append(opt.register_step_post_hook(self._post))

    # ---------------------------------------------------------------- sampling
    BLOCK = 4  # contiguous elements per sampled block: copies run at memory speed, unlike gathers

    def _plan_samples(self) -> None:
        """Which elements of each tensor to keep across a step, within ``budget`` of all elements.

        Water-filling: every tensor gets the same allowance k (or all of itself when smaller), k as
        large as the budget allows, so small tensors are copied whole and large ones sampled. A
        sample is ``k // BLOCK`` blocks of ``BLOCK`` contiguous elements, evenly spaced with a period
        coprime to the last dimension (so the blocks walk across columns instead of repeating the
        same ones) and a seeded random offset.
        """
        locals_ = [to_local(p.detach()) for _, p in self.entries]  # shards of sharded parameters
        sizes = [t.numel() for t in locals_]
        self._numel = sizes
        allowed = max(1, int(self.budget * sum(sizes)))
        lo, hi = 1, max(sizes) if sizes else 1
        while lo < hi:  # largest k with sum(min(n, k)) <= allowed
            mid = (lo + hi + 1) // 2
            if sum(min(n, mid) for n in sizes) <= allowed:
                lo = mid
            else:
                hi = mid - 1
        gen = torch.Generator().manual_seed(self._seed)
        self._layout = []  # per entry: None (whole tensor) or (offset, blocks, period, block)
        for p, n in zip(locals_, sizes):
            k = max(1, min(n, lo))
            if k >= n:
                self._layout.append(None)
                continue
            block = min(self.BLOCK, k)
            blocks = max(1, k // block)
            period = n // blocks
            last = p.shape[-1] if p.dim() else 1
            while period > block and math.gcd(period, last) != 1:
                period -= 1
            slack = n - blocks * period
            offset = int(torch.randint(0, min(period - block, slack) + 1, (1,), generator=gen))
            self._layout.append((offset, blocks, period, block))

    def _count(self, i: int) -> int:
        lay = self._layout[i]
        return self._numel[i] if lay is None else lay[1] * lay[3]

    def extra_elements(self) -> int:
        """Elements held across a step in this mode (what the memory bound counts)."""
        if self.mode == "exact":
            return sum(self._numel)
        return sum(self._count(i) for i in range(len(self.entries)))

    def _sample_view(self, p: Tensor, i: int) -> Tensor:
        flat = p.detach().reshape(-1)  # a view for contiguous parameters
        lay = self._layout[i]
        if lay is None:
            return flat
        offset, blocks, period, block = lay
        return flat[offset : offset + blocks * period].view(blocks, period)[:, :block]

    # ------------------------------------------------------------------- hooks
    def _plan(self, opt) -> _OptPlan | None:
        """The optimizer's monitored parameters, their sample views and (device, dtype) groups,
        cached while its param_groups and the parameters' storage stay the same."""
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        plan = self._plans.get(id(opt))
        if plan is not None and plan.ids == ids and all(
            plan.params[k].data_ptr() == plan.ptrs[k] for k in {0, len(plan.params) // 2, len(plan.params) - 1}
        ):  # spot check: model.to()/half() replace every parameter's storage at once
            return plan
        idx = [self.index[i] for i in ids if i in self.index]
        if not idx:
            return None
        # local shards of DTensor parameters (FSDP2): a DTensor op here would hide a collective
        params = [to_local(self.entries[i][1].detach()) for i in idx]
        views = params if self.mode == "exact" else [self._sample_view(p, i) for p, i in zip(params, idx)]
        plan = _OptPlan(ids, idx, params, views, [p.data_ptr() for p in params], _grouped(params))
        self._plans[id(opt)] = plan
        return plan

    def arm(self, step: int, optimizers) -> None:
        """Snapshot the parameters of ``optimizers`` for the step that follows check ``step``.

        Taken at the check, not in the optimizer's pre-hook: trainers that run the forward and
        backward inside ``optimizer.step(closure)`` (Lightning) call the pre-hook before the
        check, and the parameters do not change between a check and its step.
        """
        self.armed_step = step
        self.steps_since_check = 0
        self._inflight.clear()
        if self.mode == "off":
            return
        for opt in optimizers:
            plan = self._plan(opt)
            if plan is None:
                continue
            # Whole-tensor norms (||θ|| and the change test) and the sample. Parameters carry a
            # version counter that every in-place change bumps: while the versions are those of
            # the last read (the previous step's post-hook, or an earlier check with no step in
            # between), the numbers are reused instead of read again.
            versions = [p._version for p in plan.params]
            cached = self._after.get(id(opt))
            if cached is not None and cached[0] == versions:
                before = cached[1]
            else:
                before = _norms(plan.params, plan.groups)
                self._after[id(opt)] = (versions, before)
            kept = self._snaps.get(id(opt)) if self.mode == "sample" else None
            if kept is not None and kept[0] == versions:
                snap = kept[1]
            else:
                snap = _apply(torch._foreach_mul, plan.groups, plan.views, 1)
                if self.mode == "sample":  # (never the exact mode's full copy: it lives only across a step)
                    self._snaps[id(opt)] = (versions, snap)
            self._inflight[id(opt)] = (plan, before, snap, step)

    def disarm(self) -> None:
        self.armed_step = None
        self._inflight.clear()

    def _post(self, opt, args, kwargs) -> None:
        self.steps_since_check += 1
        state = self._inflight.pop(id(opt), None)
        if state is not None:
            plan, before, snap, step = state
            diff = _apply(torch._foreach_sub, plan.groups, plan.views, snap)
            dnorm = _norms(diff, plan.groups)
            changed = dnorm > 0
            if self.mode != "exact":
                after = _norms(plan.params, plan.groups)
                self._after[id(opt)] = ([p._version for p in plan.params], after)
                self._snaps.pop(id(opt), None)
                changed = changed | (after != before)
            packed = torch.cat([dnorm, before, changed.to(torch.float64)])
            self.pending.append(StepStats(plan.idx, packed))
        if self.armed_step is not None:
            self._arm_stale(opt)

    # ------------------------------------------------------------ stale grads
    def _arm_stale(self, opt) -> None:
        """After a step, watch each consumed gradient: if the next backward finds it untouched
        (same tensor, same version: neither set to None nor zeroed), it is being added onto.

        The hooks only record Python state; the monitor removes them at its next check.
        """
        for h in self._grad_hooks.pop(id(opt), ()):
            h.remove()
        handles = []
        plan = self._plan(opt)
        idx = [i for i in (plan.idx if plan else []) if self.entries[i][1].grad is not None and self.entries[i][1].requires_grad]
        for i in spread(idx, WITNESSES):
            p = self.entries[i][1]
            grad = p.grad
            fired = [False]

            def hook(incoming, p=p, ref=weakref.ref(grad), version=grad._version, fired=fired, key=id(opt)):
                if not fired[0]:
                    fired[0] = True
                    current = p.grad
                    if current is not None and current is ref() and current._version == version:
                        self.stale.add(key)

            handles.append(p.register_hook(hook))
        self._grad_hooks[id(opt)] = handles

    def clear_grad_hooks(self) -> None:
        for handles in self._grad_hooks.values():
            for h in handles:
                h.remove()
        self._grad_hooks.clear()

    def take_stale(self) -> set[int]:
        """Entry indices of the parameters (with gradients) of every optimizer found stale."""
        found, self.stale = self.stale, set()
        out: set[int] = set()
        for opt_id in found:
            plan = self._plans.get(opt_id)
            if plan is not None:
                out |= {i for i in plan.idx if self.entries[i][1].grad is not None}
        return out

    def sample_scale(self, idx: list[int]) -> list[float]:
        """sqrt(numel / sampled) per entry: scales a sample's norm to the tensor's."""
        if self.mode == "exact":
            return [1.0] * len(idx)
        return [math.sqrt(self._numel[i] / self._count(i)) for i in idx]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear_grad_hooks()
        self._inflight.clear()
        self._plans.clear()
        self._after.clear()
        self._snaps.clear()
