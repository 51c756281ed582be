"""gh.classify against the naive per-parameter oracle, and norms against float64 vector_norm."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import gradhealth as gh
from conftest import naive_classify, reference_norm, same_float

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SITUATIONS = ["none", "normal", "zeros", "negzeros", "huge", "tiny", "nan", "inf", "neginf", "huge_and_inf", "one_nonzero"]


def make_grad(shape, dtype, situation, seed):
    gen = torch.Generator().manual_seed(seed)
    if situation == "normal":
        return torch.randn(shape, generator=gen).to(dtype)
    if situation == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if situation == "negzeros":
        return torch.full(shape, -0.0, dtype=dtype)
    if situation == "huge":
        return torch.full(shape, 1e20, dtype=torch.float64).to(dtype)  # inf in fp16: the oracle sees that too
    if situation == "tiny":
        return torch.full(shape, 1e-30, dtype=torch.float64).to(dtype)  # 0 in fp16
    g = torch.randn(shape, generator=gen).to(dtype)
    flat = g.view(-1)
    if situation == "nan":
        flat[seed % flat.numel()] = math.nan
    elif situation == "inf":
        flat[seed % flat.numel()] = math.inf
    elif situation == "neginf":
        flat[seed % flat.numel()] = -math.inf
    elif situation == "huge_and_inf":
        g = torch.full(shape, 1e20, dtype=torch.float64).to(dtype)
        g.view(-1)[0] = math.inf
    elif situation == "one_nonzero":
        g = torch.zeros(shape, dtype=dtype)
        g.view(-1)[seed % g.numel()] = 1e-30 if dtype != torch.float16 else 1e-7
    return g


def make_sparse_grad(shape, dtype, situation, seed):
    """An uncoalesced COO gradient (duplicate rows) whose dense sum matches the situation."""
    rows, cols = shape
    dense = make_grad(shape, dtype, situation, seed)
    # split every row into two halves that sum back to it, listed twice -> duplicates to coalesce
    idx = torch.tensor([list(range(rows)) * 2])
    half = dense / 2 if situation not in ("nan", "inf", "neginf", "huge_and_inf") else dense
    other = dense - half if situation not in ("nan", "inf", "neginf", "huge_and_inf") else torch.zeros_like(dense)
    vals = torch.cat([half, other])
    return torch.sparse_coo_tensor(idx, vals, shape)


param_spec = st.fixed_dictionaries(
    {
        "shape": st.sampled_from([(3,), (2, 3), (4, 5), (1,), (2, 2, 2)]),
        "dtype": st.sampled_from(DTYPES),
        "requires_grad": st.booleans(),
        "situation": st.sampled_from(SITUATIONS),
        "in_optimizer": st.booleans(),
        "sparse": st.booleans(),
        "nest": st.integers(0, 2),
    }
)


def build(specs, seed):
    root = nn.Module()
    params = []
    for i, spec in enumerate(specs):
        owner = root
        for depth in range(spec["nest"]):
            key = f"m{depth}"
            if not hasattr(owner, key):
                owner.add_module(key, nn.Module())
            owner = getattr(owner, key)
        p = nn.Parameter(torch.zeros(spec["shape"], dtype=spec["dtype"]), requires_grad=spec["requires_grad"])
        owner.register_parameter(f"p{i}", p)
        if spec["situation"] != "none":
            sparse = spec["sparse"] and len(spec["shape"]) == 2 and spec["dtype"] in (torch.float32, torch.float64)
            maker = make_sparse_grad if sparse else make_grad
            p.grad = maker(spec["shape"], spec["dtype"], spec["situation"], seed + i)
        params.append((p, spec["in_optimizer"]))
    return root, params


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(param_spec, min_size=1, max_size=8), seed=st.integers(0, 10_000), with_opt=st.booleans())
def test_classify_matches_naive_oracle(specs, seed, with_opt):
    model, params = build(specs, seed)
    opt = None
    if with_opt:
        chosen = [p for p, inside in params if inside]
        opt = torch.optim.SGD(chosen or [nn.Parameter(torch.zeros(1))], lr=0.1)
    assert gh.classify(model, opt) == naive_classify(model, opt)

    monitor = gh.GradHealth(model, opt, on_problem="ignore")
    report = monitor.check()
    assert report.status == naive_classify(model, opt)
    names_with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert set(report.grad_norm) == names_with_grad
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert same_float(report.grad_norm[name], reference_norm(p.grad)), name
    grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for _, p in model.named_parameters() if p.grad is not None]
    if grads:
        ref_total = torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in grads])).item()
        assert same_float(report.total_grad_norm, ref_total)


@pytest.mark.parametrize("dtype", DTYPES)
def test_edges_are_exact(dtype):
    model = nn.Module()
    model.big = nn.Parameter(torch.zeros(1000, dtype=dtype))
    model.small = nn.Parameter(torch.zeros(10, dtype=dtype))
    model.negzero = nn.Parameter(torch.zeros(3, dtype=dtype))
    big = 1e20 if dtype != torch.float16 else 6e4
    small = 1e-30 if dtype != torch.float16 else 1e-7
    model.big.grad = torch.full((1000,), big, dtype=dtype)
    model.small.grad = torch.full((10,), small, dtype=dtype)
    model.negzero.grad = torch.full((3,), -0.0, dtype=dtype)
    report = gh.GradHealth(model, on_problem="ignore").check()
    assert report.status["big"] is gh.Status.OK
    assert report.status["small"] is gh.Status.OK
    assert report.status["negzero"] is gh.Status.ZERO_GRAD
    stored_big = model.big.grad[0].double().item()
    stored_small = model.small.grad[0].double().item()
    assert math.isclose(report.grad_norm["big"], stored_big * math.sqrt(1000), rel_tol=1e-6)
    assert math.isclose(report.grad_norm["small"], stored_small * math.sqrt(10), rel_tol=1e-6)
    assert report.grad_norm["negzero"] == 0.0


def test_thousand_1e20s_norm_is_3_2e21_not_inf():
    model = nn.Linear(1000, 1, bias=False)
    model.weight.grad = torch.full_like(model.weight, 1e20)
    report = gh.GradHealth(model, on_problem="ignore").check()
    assert report.status["weight"] is gh.Status.OK
    assert math.isclose(report.grad_norm["weight"], 3.1622776e21, rel_tol=1e-6)
    assert math.isclose(report.total_grad_norm, 3.1622776e21, rel_tol=1e-6)


def test_float64_extremes_beyond_double_squares():
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    model.b = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    model.a.grad = torch.full((4,), 1e300, dtype=torch.float64)
    model.b.grad = torch.full((4,), 1e-300, dtype=torch.float64)
    r = gh.GradHealth(model, on_problem="ignore").check()
    assert r.status == {"a": gh.Status.OK, "b": gh.Status.OK}
    assert math.isclose(r.grad_norm["a"], 2e300, rel_tol=1e-12)
    assert math.isclose(r.grad_norm["b"], 2e-300, rel_tol=1e-12)


def test_sparse_embedding_real_backward():
    emb = nn.Embedding(10, 4, sparse=True)
    dense = nn.Linear(4, 1)
    model = nn.Sequential(emb, dense)
    idx = torch.tensor([1, 1, 3])
    model(idx).sum().backward()
    assert emb.weight.grad.is_sparse
    opt = [torch.optim.SparseAdam(emb.parameters()), torch.optim.SGD(dense.parameters(), lr=0.1)]
    assert gh.classify(model, opt) == naive_classify(model, opt) == {
        "0.weight": gh.Status.OK, "1.weight": gh.Status.OK, "1.bias": gh.Status.OK}
    r = gh.GradHealth(model, opt).check()
    assert same_float(r.grad_norm["0.weight"], reference_norm(emb.weight.grad))


def test_sparse_duplicates_cancel_to_zero():
    p = nn.Parameter(torch.zeros(3, 2))
    m = nn.Module()
    m.w = p
    p.grad = torch.sparse_coo_tensor([[0, 0]], torch.tensor([[1.0, 2.0], [-1.0, -2.0]]), (3, 2))
    assert gh.classify(m) == {"w": gh.Status.ZERO_GRAD} == naive_classify(m)


def test_tied_parameters_reported_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.out = nn.Linear(3, 5, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(self.emb(x))

    m = Tied()
    m(torch.tensor([0, 1])).sum().backward()
    status = gh.classify(m)
    assert list(status) == ["emb.weight"]
    assert status["emb.weight"] is gh.Status.OK


def test_several_optimizers(mlp):
    opt_a = torch.optim.SGD(mlp.encoder.parameters(), lr=0.1)
    opt_b = torch.optim.Adam(mlp.head.parameters())
    mlp(torch.randn(4, 8)).sum().backward()
    assert set(gh.classify(mlp, [opt_a, opt_b]).values()) == {gh.Status.OK}
    only_a = gh.classify(mlp, [opt_a])
    assert only_a["head.weight"] is gh.Status.NOT_IN_OPTIMIZER
    assert only_a["encoder.0.weight"] is gh.Status.OK


def test_compile_wrapper_reports_inner_names(mlp):
    compiled = torch.compile(mlp)
    assert list(gh.classify(compiled)) == [n for n, _ in mlp.named_parameters()]


def test_ddp_wrapper_reports_inner_names(mlp, tmp_path):
    import torch.distributed as dist

    from conftest import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(mlp)
        ddp(torch.randn(3, 8)).sum().backward()
        status = gh.classify(ddp)
        assert list(status) == [n for n, _ in mlp.named_parameters()]
        assert set(status.values()) == {gh.Status.OK}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "model, exc, words",
    [
        ("not a model", TypeError, "model must be a torch.nn.Module; got str"),
        (lambda x: x, TypeError, "a function was passed"),
        (nn.ReLU(), ValueError, "has no parameters"),
    ],
)
def test_bad_model(model, exc, words):
    with pytest.raises(exc, match=words):
        gh.classify(model)
    with pytest.raises(exc, match=words):
        gh.GradHealth(model)


def test_optimizer_given_as_model():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)
    with pytest.raises(TypeError, match="an optimizer was passed where the model belongs"):
        gh.GradHealth(opt)


@pytest.mark.parametrize("bad, where", [(nn.Linear(2, 2), "optimizer must be"), ([object()], r"optimizer\[0\] must be"), ("sgd", "optimizer must be")])
def test_bad_optimizer(bad, where):
    with pytest.raises(TypeError, match=where):
        gh.GradHealth(nn.Linear(2, 2), bad)


def test_meta_parameters():
    with torch.device("meta"):
        m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'weight' is on the meta device.*to_empty"):
        gh.GradHealth(m)


def test_cpu_kernels_match_float64_reference():
    """On the CPU, small tensors of one shape are normed stacked and larger contiguous ones as rows
    (see stats._batches): every norm still matches float64 (four dtypes, transposed views, 1e20s,
    1e-30s, zeros, NaN, inf, a tensor that fits neither path), and a list whose shapes changed is
    planned again when its stack or view fails, never given a wrong norm."""
    from gradhealth.measure import stats

    tensors = []
    reps = -(-3 * stats.STACK_MIN // (2 * len(SITUATIONS[1:])))  # (two in three are small: STACK_MIN of them a dtype)
    for d, dtype in enumerate(DTYPES):
        for k, situation in enumerate(SITUATIONS[1:] * reps):
            shape = [(7,), (16, 16), (96, 256)][k % 3]
            g = make_grad(shape, dtype, situation, 100 * d + k)
            tensors.append(g.t() if g.dim() == 2 and k % 4 == 1 else g)  # some transposed views
        tensors.append(torch.randn(stats.STACK_NUMEL + 1).to(dtype))  # odd and large: neither path
    assert not all(t.is_contiguous() for t in tensors)
    norms, _, plan = stats.grad_norms(tensors)
    fresh = stats.NormPlan(tensors)  # (the plan returned has learned the exact ones: see below)
    kinds = [(kind, len(idx)) for _, batches in fresh.batches for kind, _, idx in batches]
    assert {k for k, _ in kinds} == {"stack", "rows", "each"} and all(n >= 2 for k, n in kinds if k == "stack")
    # the tensors whose fused norm came back 0 or inf (1e20s, 1e-30s, zeros, inf) are normed exactly from now on
    assert plan.exact and all(t.numel() for i in plan.exact for t in [tensors[i]])
    assert [kind for _, batches in plan.batches for kind, _, _ in batches].count("exact") == len(DTYPES)
    few = stats.NormPlan([torch.randn(7) for _ in range(stats.STACK_MIN - 1)])  # a small model: one foreach
    assert [kind for _, batches in few.batches for kind, _, _ in batches] == ["each"]
    for t, v in zip(tensors, norms):
        assert same_float(v, reference_norm(t)), (t.dtype, t.shape, t.is_contiguous())
    changed = [torch.randn(16, 16), *tensors[1:]]  # a (7,) slot now holds a (16, 16)
    rows_at = next(i for i, t in enumerate(tensors) if t.shape == (96, 256) and t.is_contiguous())
    changed[rows_at] = torch.randn(24577)  # a tensor reduced as rows now divides into none
    assert tensors[0].shape == (7,) and fresh.fits(changed)  # (shapes are not keyed)
    norms2, _, plan2 = stats.grad_norms(changed, plan=fresh)
    assert plan2 is not fresh
    for t, v in zip(changed, norms2):
        assert same_float(v, reference_norm(t)), (t.dtype, t.shape)


def test_stacks_are_chunked_within_their_memory_bound():
    """Many small tensors of one shape are stacked in chunks of at most STACK_ELEMENTS elements
    (the stack is a copy), and every norm still matches float64."""
    from gradhealth.measure import stats

    tensors = [torch.randn(stats.STACK_NUMEL) for _ in range(2 * stats.STACK_ELEMENTS // stats.STACK_NUMEL + 1)]
    norms, _, plan = stats.grad_norms(tensors)
    chunks = [idx for _, batches in plan.batches for kind, _, idx in batches if kind == "stack"]
    assert len(chunks) == 3 and max(len(c) for c in chunks) * stats.STACK_NUMEL <= stats.STACK_ELEMENTS
    assert sorted(i for c in chunks for i in c) == list(range(len(tensors)))
    for t, v in zip(tensors, norms):
        assert same_float(v, reference_norm(t))
