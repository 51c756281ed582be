"""What the loss explains about the gradients (gradhealth/fitted.py): a GIN (PyTorch Geometric) on
graphs it fits, whose loss on some mini-batches is ~1e-6, is not VANISHING_GRAD; a collapse while
the loss stays where it was still is."""

from __future__ import annotations

import statistics
import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh
from gradhealth.findings import Finding
from gradhealth.fitted import WARMUP, LossFit


def rings(n: int, g: torch.Generator):
    from torch_geometric.data import Data

    out = []
    for _ in range(n):  # a ring of k nodes; the target is its size (sum pooling counts it exactly)
        k = int(torch.randint(3, 13, (1,), generator=g))
        src = torch.arange(k)
        edges = torch.stack([src, (src + 1) % k])
        out.append(Data(x=torch.ones(k, 1), edge_index=torch.cat([edges, edges.flip(0)], 1), y=torch.tensor([k / 10.0])))
    return out


class GIN(nn.Module):
    def __init__(self, hidden: int = 16):
        from torch_geometric.nn import GINConv

        super().__init__()
        self.conv1 = GINConv(nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, hidden)))
        self.conv2 = GINConv(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden)))
        self.head = nn.Linear(hidden, 1)

    def forward(self, data):
        from torch_geometric.nn import global_add_pool

        x = self.conv1(data.x, data.edge_index).relu()
        x = self.conv2(x, data.edge_index).relu()
        return self.head(global_add_pool(x, data.batch)).squeeze(-1)


def test_a_gin_on_graphs_it_fits_is_not_vanishing(one_thread):
    pytest.importorskip("torch_geometric")
    from torch_geometric.loader import DataLoader

    torch.manual_seed(0)
    loader = DataLoader(rings(64, torch.Generator().manual_seed(0)), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    model = GIN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    losses, reports = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthWarning)
        for _ in range(30):
            for data in loader:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(data), data.y)
                loss.backward()
                reports.append(mon.check(loss=loss))
                opt.step()
                losses.append(loss.item())
    assert statistics.mean(losses[-8:]) < 1e-3 * statistics.mean(losses[:8])  # premise: it fits
    assert sum(v < 5e-6 for v in losses) > 20  # premise: batches fitted almost exactly
    fitted = [f for r in reports for f in r.findings_of("VANISHING_GRAD")]
    assert fitted and all(f.level == "info" and "the batch is already fitted" in f.message for f in fitted)
    assert all(f.data["loss_ratio"] <= 0.1 for f in fitted)


def _collapse(ratio: float) -> Finding:
    return Finding("VANISHING_GRAD", "gradients collapsed", params=("conv1.nn.0",), level="warning", step=9,
                   data={"ratios": {"conv1.nn.0": ratio}})


@pytest.mark.parametrize("loss, grad_ratio, fitted", [
    (1.0, 1e-4, False),  # the loss where it was: a real collapse (dead ReLUs, a cut path)
    (2.0, 1e-4, False),  # the loss rose: a learning rate that blew the weights up
    (0.2, 1e-4, False),  # fell a little, the gradients 1000x more: not explained
    (0.05, 1e-4, True),  # an order of magnitude below the median: a fitted batch
    (2e-3, 1e-3, True),  # fell as far as the gradients did
    (None, 1e-4, False),  # no loss given: nothing to explain it with
])
def test_a_collapse_is_explained_only_by_a_loss_that_collapsed(loss, grad_ratio, fitted):
    fit = LossFit()
    for _ in range(WARMUP):
        fit.add(1.0)
    [f] = fit.vanishing([_collapse(grad_ratio)], loss, 9)
    assert (f.level == "info") is fitted and ("already fitted" in f.message) is fitted


def test_a_zero_loss_check_with_a_branch_this_batch_did_not_take_is_not_an_error():
    """A multimodal model whose image branch is skipped by text-only batches (a transient NO_GRAD the
    persistence rule tolerates), and tied rewards (advantages 0, the loss exactly 0) on one of those
    batches: nothing to learn, and the branch is no error there either."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.img, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x, use_img):
            h = self.a(x)
            return self.head(h + self.img(x) if use_img else h)

    m = M()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    mon = gh.GradHealth(m, opt, on_problem="raise")
    x, reports = torch.randn(8, 4), []
    for step in range(10):
        opt.zero_grad()
        adv = torch.zeros(8, 1) if step == 8 else torch.randn(8, 1)  # tied rewards at step 8
        loss = (m(x, use_img=step % 3 != 2) * adv).mean()
        loss.backward()
        reports.append(mon.check(loss=loss))
        opt.step()
    mon.close()
    r = reports[8]
    assert r.loss == 0.0 and r.status["img.weight"] is gh.Status.NO_GRAD  # premise: both at the same check
    assert r.ok and [f.kind for f in r.findings] == ["NOTHING_TO_LEARN"]
