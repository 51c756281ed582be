"""Parameter updates measured through the optimizer's own step hooks, and stale-gradient detection.

Around each ``optimizer.step()`` that follows a check, a pre-hook snapshots the parameters and a
post-hook measures ||Δθ|| per parameter, entirely on the device: nothing is read back until the
monitor's next check, whose single transfer carries these numbers too (or ``monitor.flush()``).

Two modes:

* ``"exact"`` keeps a copy of every parameter across the step (1x parameter memory, during the
  step only) and measures ||θ_after - θ_before|| exactly.
* ``"sample"`` (default) keeps a fixed, evenly strided sample of each tensor: extra memory is at
  most ``budget`` (2%) of parameter memory. The update norm is the sample's, scaled by
  sqrt(numel / samples). Whether a parameter changed at all is tested exactly on the sampled
  elements and, for the rest, by comparing float64 norms of the whole tensor before and after.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["UpdateTracker", "StepStats", "DELTA_MODES"]

DELTA_MODES = ("sample", "exact", "off")


def norms64(tensors: list[Tensor]) -> Tensor:
    """Float64 L2 norms of ``tensors`` as one 1-d tensor (one foreach kernel per device/dtype)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out = [None] * len(tensors)
    for idx in groups.values():
        members = [tensors[i] for i in idx]
        try:
            res = torch._foreach_norm(members, 2, dtype=torch.float64)
        except (RuntimeError, NotImplementedError, TypeError):
            res = [torch.linalg.vector_norm(m, dtype=torch.float64) for m in members]
        for i, r in zip(idx, res):
            out[i] = r
    device = tensors[0].device
    return torch.stack([o.to(device) for o in out])


def copies(tensors: list[Tensor]) -> list[Tensor]:
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list = [None] * len(tensors)
    for idx in groups.values():
        for i, c in zip(idx, torch._foreach_mul([tensors[i] for i in idx], 1)):
            out[i] = c
    return out


def differences(after: list[Tensor], before: list[Tensor]) -> list[Tensor]:
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(after):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out: list = [None] * len(after)
    for idx in groups.values():
        for i, d in zip(idx, torch._foreach_sub([after[i] for i in idx], [before[i] for i in idx])):
            out[i] = d
    return out


@dataclass
class StepStats:
    """One measured optimizer step, still on the device until the monitor fetches it."""

    check_step: int  # the check whose step this was
    indices: list[int]  # entry indices of the parameters this optimizer stepped
    packed: Tensor  # [update norm (n), param norm before (n), changed flag (n)], float64
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
        self._views: dict[int, tuple] = {}
        self._handles = []
        self._grad_hooks: dict[int, list] = {}
        self._seed = seed
        self._sample_scale: dict[int, float] = {}
        self._plan_samples()
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._pre))
            self._handles.append(opt.register_step_post_hook(self._post))

    # ---------------------------------------------------------------- sampling
    def _plan_samples(self) -> None:
        """Strides per tensor so that all samples together stay within ``budget`` of the elements.

        Water-filling: every tensor gets the same number of samples k (or all of itself when
        smaller), k as large as the budget allows; small tensors are thus copied whole and large
        ones sampled evenly.
        """
        sizes = [p.numel() for _, p in self.entries]
        allowed = max(1, int(self.budget * sum(sizes)))
        lo, hi = 1, max(sizes) if sizes else 1
        while lo < hi:  # largest k with sum(min(n, k)) <= allowed
            mid = (lo + hi + 1) // 2
            if sum(min(n, mid) for n in sizes) <= allowed:
                lo = mid
            else:
                hi = mid - 1
        self.per_tensor = lo
        gen = torch.Generator().manual_seed(self._seed)
        self._stride = []
        for n in sizes:
            k = max(1, min(n, lo))
            stride = max(1, -(-n // k))  # ceil: never more than k samples
            offset = int(torch.randint(0, stride, (1,), generator=gen)) if stride > 1 else 0
            count = len(range(offset, n, stride))
            self._stride.append((offset, stride, count))

    def extra_elements(self) -> int:
        """Elements held across a step in this mode (what the memory bound counts)."""
        if self.mode == "exact":
            return sum(p.numel() for _, p in self.entries)
        return sum(c for _, _, c in self._stride)

    def _view(self, i: int) -> Tensor:
        p = self.entries[i][1]
        cached = self._views.get(i)
        ptr = p.data_ptr()
        if cached is not None and cached[0] == ptr:
            return cached[1]
        offset, stride, _ = self._stride[i]
        flat = p.detach().reshape(-1)  # a view for contiguous parameters
        view = flat[offset::stride]
        self._views[i] = (ptr, view)
        return view

    # ------------------------------------------------------------------- hooks
    def _pre(self, opt, args, kwargs) -> None:
        self.steps_since_check += 1
        if self.armed_step is None or self.mode == "off":
            return
        idx = [self.index[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in self.index]
        if not idx:
            return
        params = [self.entries[i][1].detach() for i in idx]
        before = norms64(params)
        if self.mode == "exact":
            snap_src = params
        else:
            snap_src = [self._view(i) for i in idx]
        self._inflight[id(opt)] = (idx, before, copies(snap_src), snap_src)

    def _post(self, opt, args, kwargs) -> None:
        state = self._inflight.pop(id(opt), None)
        if state is not None:
            idx, before, snap, live = state
            after = norms64([self.entries[i][1].detach() for i in idx])
            dnorm = norms64(differences(live, snap))
            changed = ((after != before) | (dnorm > 0)).to(torch.float64)
            packed = torch.cat([dnorm, before, changed])
            self.pending.append(StepStats(self.armed_step, idx, packed))
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
        for g in opt.param_groups:
            for p in g["params"]:
                i = self.index.get(id(p))
                grad = p.grad
                if i is None or grad is None or not p.requires_grad:
                    continue
                fired = [False]

                def hook(incoming, p=p, i=i, ref=weakref.ref(grad), version=grad._version, fired=fired):
                    if not fired[0]:
                        fired[0] = True
                        current = p.grad
                        if current is not None and current is ref() and current._version == version:
                            self.stale.add(i)

                handles.append(p.register_hook(hook))
        self._grad_hooks[id(opt)] = handles

    def clear_grad_hooks(self) -> None:
        for handles in self._grad_hooks.values():
            for h in handles:
                h.remove()
        self._grad_hooks.clear()

    def take_stale(self) -> set[int]:
        out, self.stale = self.stale, set()
        return out

    def sample_scale(self, idx: list[int]) -> list[float]:
        if self.mode == "exact":
            return [1.0] * len(idx)
        out = []
        for i in idx:
            n = self.entries[i][1].numel()
            c = self._stride[i][2]
            out.append(math.sqrt(n / c) if c else 0.0)
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear_grad_hooks()
        self._inflight.clear()
        self._views.clear()
