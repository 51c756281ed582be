"""The exact re-check (``stats.exact_norms``, ``stats.exact_pieces``): exact where a float32 sum
of squares lies (1e20s, 1e-30s; float64 1e-200s and 1e200s), for every dtype, sparse gradients
included; a constant number of torch ops per (device, dtype) group whatever the tensor count; and
remembered by the plan, so a vanishing model pays the re-check (and its second transfer) once."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradhealth.measure import stats

pytestmark = pytest.mark.usefixtures("one_thread")


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def reference(t: torch.Tensor) -> float:
    """The naive loop on the host: ``math.hypot`` over the values as float64 (it scales internally:
    no under- or overflow), NaN where any value is NaN (the contract: nan if it holds a NaN)."""
    t = t.to_dense() if t.layout is not torch.strided else t
    values = t.detach().to(torch.float64).reshape(-1).tolist()
    if any(v != v for v in values):
        return math.nan
    return math.hypot(*values) if values else 0.0


def close(a: float, b: float) -> bool:
    return (a != a and b != b) or a == b or math.isclose(a, b, rel_tol=1e-12)


def situations():
    out = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tiny = {torch.float16: 1e-7, torch.bfloat16: 1e-30, torch.float32: 1e-30, torch.float64: 1e-200}[dtype]
        huge = {torch.float16: 6e4, torch.bfloat16: 1e30, torch.float32: 1e20, torch.float64: 1e200}[dtype]
        out += [torch.full((1000,), huge, dtype=dtype), torch.full((7, 3), tiny, dtype=dtype),
                torch.zeros(5, dtype=dtype), torch.tensor([1.0, math.inf, 2.0], dtype=dtype),
                torch.tensor([math.nan, math.inf], dtype=dtype), torch.randn(4, 4).to(dtype)]
    i = torch.tensor([[0, 2, 2]])
    out.append(torch.sparse_coo_tensor(i, torch.tensor([1e-30, 1e-30, 3e-30]), (4,)))  # duplicates summed
    return out


def test_exact_norms_are_exact_for_every_dtype_and_edge():
    tensors = situations()
    views = [stats.dense_view(t) for t in tensors]
    got = stats.exact_norms(views)
    for t, v in zip(tensors, got):
        assert close(v, reference(t)), (t.dtype, t.layout, v, reference(t))
    thousand = got[0 + 12]  # (float32: a thousand 1e20s)
    assert tensors[12].dtype == torch.float32 and math.isclose(thousand, float(torch.tensor(1e20)) * math.sqrt(1000), rel_tol=1e-12)
    assert all(v > 0 for t, v in zip(tensors, got) if t.dtype != torch.float16 and reference(t) > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_re_check_is_a_constant_number_of_ops(dtype):
    """Not a kernel chain per tensor: the ops for 1000 suspects are those for 10."""
    def ops(n):
        tensors = [torch.full((16,), 1e-30 if dtype != torch.float64 else 1e-200, dtype=dtype) for _ in range(n)]
        with Ops() as mode:
            values = stats.exact_norms(tensors)
        assert all(close(v, reference(t)) for v, t in zip(values, tensors))
        return mode.n
    assert ops(1000) == ops(10) <= 20


def test_the_plan_remembers_the_tensors_that_needed_it(monkeypatch):
    """A vanishing model: the first read re-checks (a second transfer), later reads with the same plan
    norm those tensors exactly in the first launch: one transfer, the same exact values."""
    fetches = []
    fetch = stats.fetch
    monkeypatch.setattr(stats, "fetch", lambda parts: fetches.append(1) or fetch(parts))
    grads = [torch.full((64, 64), 1e-30) for _ in range(100)] + [torch.randn(64) for _ in range(3)]
    norms, _, plan = stats.grad_norms(grads)
    assert len(fetches) == 2 and plan.exact == frozenset(range(100))
    fetches.clear()
    with Ops() as mode:
        norms2, _, plan2 = stats.grad_norms(grads, plan=plan)
    assert len(fetches) == 1 and plan2 is plan and mode.n <= 8, (fetches, mode.n)
    assert norms2[:100] == norms[:100] and all(close(v, reference(g)) for v, g in zip(norms2[:100], grads))
    assert all(math.isclose(v, reference(g), rel_tol=1e-6) for v, g in zip(norms2[100:], grads[100:]))


def test_a_deferred_launch_is_exact_in_one_kernel_per_group():
    """``later``: every norm exact at launch (no max |g| pass, nothing left to re-check)."""
    grads = [torch.full((64,), 1e-30), torch.full((1000,), 1e20), torch.zeros(3), torch.randn(5, 5)]
    with Ops() as mode:
        launched = stats.Launched(grads, later=True)
    names = mode.n
    norms, _ = launched.resolve(launched.norms_part().tolist())
    assert all(close(v, reference(g)) for v, g in zip(norms, grads)), norms
    assert names <= 2  # one fused float64-accumulating norm, one stack
