"""Python numbers (plan indices, segment ids, scales) onto a device without a host synchronisation.

``torch.tensor(values, device=...)`` copies from pageable memory, and the host waits for it;
``repeat_interleave`` with repeats on the device reads them back to size its output. Built on the
host instead, where the numbers are known, and copied non-blocking from pinned memory (pinned only
where CUDA is), neither makes the host wait. ``tests/test_deferred.py`` flags a tensor made from
Python data, or an op whose output's size depends on the values, anywhere else in a check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["host_to", "host_segments"]


def host_to(values, device, dtype: torch.dtype = torch.long) -> Tensor:
    """Python numbers (plan indices, sizes, scales) as a tensor on ``device`` without a host
    synchronisation: built on the host, then copied non-blocking from pinned memory (a pageable
    copy, or ``torch.tensor(values, device=...)``, makes the host wait). The pinned block is kept
    by torch's caching host allocator until the copy has run."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def host_segments(sizes: Sequence[int], device) -> Tensor:
    """``[0]*sizes[0] + [1]*sizes[1] + ...`` (int32) on ``device``: each element's segment in a
    concatenation, built on the host where the sizes are known (``repeat_interleave`` with repeats on
    the device reads them back: a synchronisation) and moved by :func:`host_to`."""
    seg = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), torch.tensor(sizes, dtype=torch.long))
    return host_to(seg, device)
