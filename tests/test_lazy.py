"""Lazy (uninitialised) parameters: left out until their first forward, then judged; one whose
module never runs while its optimizer steps is named (META_PARAM with data["lazy"], in NO_GRAD words)."""

import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh
from conftest import naive_classify

torch.set_num_threads(1)


def _run(model, opt, steps, loss_fn, **options):
    mon = gh.GradHealth(model, opt, **options)
    reports, losses = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthInternalWarning)  # the monitor's own trouble: fails the test
        for i in range(steps):
            opt.zero_grad()
            loss = loss_fn(i)
            loss.backward()
            reports.append(mon.check(loss=loss))
            opt.step()
            losses.append(loss.item())
    mon.close()
    return reports, losses


def test_a_lazy_module_never_run_trains_the_rest_and_is_named_after_patience():
    torch.manual_seed(0)
    m = nn.ModuleDict({"used": nn.Linear(3, 2), "lazy": nn.LazyLinear(2)})
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    x, y = torch.randn(16, 3), torch.randn(16, 2)
    reports, losses = _run(m, opt, 5, lambda i: (m["used"](x) - y).pow(2).mean(), on_problem="ignore", grad_patience=3)
    assert losses[-1] < losses[0]  # it trains, with the monitor on
    assert nn.parameter.is_lazy(m["lazy"].weight)  # the premise: never materialised
    for r in reports[:3]:  # left out, and not named before grad_patience checks with a step between
        assert set(r.status) == {"used.weight", "used.bias"} and r.ok
    for r in reports[3:]:
        [f] = r.findings_of("META_PARAM")
        assert f.level == "error" and set(f.params) == {"lazy.weight", "lazy.bias"}
        assert "NO_GRAD" in f.message and "never ran" in f.message and f.data["status"] == "NO_GRAD" and f.data["lazy"]


def test_a_lazy_module_materialised_later_is_judged_from_that_step_on():
    torch.manual_seed(0)
    m = nn.ModuleDict({"used": nn.Linear(3, 2), "lazy": nn.LazyLinear(2)})
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    x, x5, y = torch.randn(16, 3), torch.randn(16, 5), torch.randn(16, 2)

    def loss_fn(i):
        out = m["used"](x)
        if i >= 2:
            out = out + m["lazy"](x5)
        return (out - y).pow(2).mean()

    reports, _ = _run(m, opt, 6, loss_fn, on_problem="raise", grad_patience=3, change_every=1)
    assert set(reports[1].status) == {"used.weight", "used.bias"}
    for r in reports[2:]:
        assert r.status == naive_classify(m, opt) or set(r.status) == set(dict(m.named_parameters()))
        assert all(s is gh.Status.OK for s in r.status.values()) and not r.findings_of("META_PARAM")
    assert reports[-1].grad_norm["lazy.weight"] > 0


def test_pyg_heteroconv_with_a_relation_no_batch_holds():
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.nn import HeteroConv, SAGEConv

    torch.manual_seed(0)
    conv = HeteroConv({("a", "to", "b"): SAGEConv((-1, -1), 4), ("b", "to", "a"): SAGEConv((-1, -1), 4),
                       ("a", "rare", "a"): SAGEConv((-1, -1), 4)}, aggr="sum")
    x = {"a": torch.randn(6, 3), "b": torch.randn(5, 2)}
    edges = {("a", "to", "b"): torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4]]),
             ("b", "to", "a"): torch.tensor([[0, 1, 2, 4], [5, 1, 0, 3]])}  # no ("a", "rare", "a") edges, ever
    target = {k: torch.randn(v.shape[0], 4) for k, v in x.items()}
    conv(x, edges)  # PyG's documented dummy forward: the relations in the batch materialise
    assert any(nn.parameter.is_lazy(p) for p in conv.parameters())  # the premise: the rare relation did not
    opt = torch.optim.Adam(conv.parameters(), lr=0.02)

    def loss_fn(i):
        out = conv(x, edges)
        return sum((out[k] - target[k]).pow(2).mean() for k in out)

    reports, losses = _run(conv, opt, 4, loss_fn, on_problem="ignore", grad_patience=2)
    assert losses[-1] < losses[0]
    named = set(reports[-1].findings_of("META_PARAM")[0].params)
    assert named and all("rare" in n for n in named) and pyg is not None
    # the materialised parameters are judged as the naive loop judges them (the rare relation's bias,
    # an ordinary parameter, really gets no gradient: NO_GRAD)
    naive = {n: s for n, s in naive_classify(conv, opt).items() if not nn.parameter.is_lazy(conv.get_parameter(n))}
    assert reports[-1].status == naive and naive["convs.<a___rare___a>.lin_l.bias"] is gh.Status.NO_GRAD
