"""A fuzz corpus: the monitor over unusual modules and optimizers, a few healthy steps each under
on_problem="raise". Nothing may be raised into the loop, no false finding may appear, and every
case the monitor cannot support is a clear error at construction."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import gradhealth as gh
from conftest import naive_classify

torch.set_num_threads(1)


class PlainOptimizer:
    """An optimizer that is not torch's: only param_groups and step (and zero_grad)."""

    def __init__(self, params, lr):
        self.param_groups = [{"params": list(params), "lr": lr}]

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.sub_(g["lr"] * p.grad)

    def zero_grad(self, set_to_none=True):
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None


class IntState(nn.Module):
    """Integer and bool buffers and parameters beside the trainable weights."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("keep", torch.ones(4, dtype=torch.bool))
        self.ids = nn.Parameter(torch.arange(3), requires_grad=False)
        self.flags = nn.Parameter(torch.tensor([True, False]), requires_grad=False)

    def forward(self, x):
        self.count += 1
        return self.lin(x * self.keep)


class ComplexLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 1, dtype=torch.cfloat) * 0.1)
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return (x.to(torch.cfloat) @ self.w).real + self.b


class Tied(nn.Module):
    """An embedding tied to the output layer, and one block used twice."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.block(torch.tanh(self.block(self.emb(x))))))


class SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.emb(x)).squeeze(-1)


class Qat(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
        self.fc1, self.relu, self.fc2 = nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def _regression(batch=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _mse(model):
    x, y = _regression()
    return lambda i: (model(x) - y).pow(2).mean()


def case_lazy():
    model = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01), _mse(model), {}


def case_int_and_bool():
    model = IntState()
    opt = torch.optim.SGD([model.lin.weight, model.lin.bias], lr=0.05)
    return model, opt, _mse(model), {"expect_frozen": []}  # nothing is frozen on purpose: the integers cannot train


def case_complex():
    model = ComplexLinear()
    return model, torch.optim.Adam(model.parameters(), lr=0.02), _mse(model), {}


def case_sparse():
    model = SparseModel()
    ids = torch.arange(20) % 20
    y = torch.linspace(-1, 1, 20)
    opts = [torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.05),
            torch.optim.Adam(model.head.parameters(), lr=0.05)]
    return model, opts, lambda i: (model(ids) - y).pow(2).mean(), {}


def _param(kind):
    def build():
        lin = nn.Linear(16, 16)
        lin = {"weight_norm": parametrizations.weight_norm, "spectral_norm": parametrizations.spectral_norm,
               "orthogonal": parametrizations.orthogonal}[kind](lin)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), lin, nn.Tanh(), nn.Linear(16, 1))
        return model, torch.optim.Adam(model.parameters(), lr=0.01), _mse(model), {}

    return build


def case_tied():
    model = Tied()
    x = torch.arange(10)
    return model, torch.optim.Adam(model.parameters(), lr=0.02), lambda i: nn.functional.cross_entropy(model(x), x), {}


def case_replaced_weight():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _regression()

    def loss(i):
        if i == 2:  # a weight replaced mid-run, and handed to the optimizer
            model[2].weight = nn.Parameter(model[2].weight.detach().clone())
            opt.add_param_group({"params": [model[2].weight]})
        return (model(x) - y).pow(2).mean()

    return model, opt, loss, {}


def case_qat():
    model = Qat()
    model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
    model = torch.ao.quantization.prepare_qat(model.train())
    return model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), _mse(model), {}


def case_fastai_optimizer():
    pytest.importorskip("fastai")
    from fastai.optimizer import Adam

    model = mlp()
    return model, Adam(list(model.parameters()), lr=0.01), _mse(model), {}


def case_plain_optimizer():
    model = mlp()
    return model, PlainOptimizer(model.parameters(), lr=0.05), _mse(model), {}


CASES = {
    "lazy": case_lazy, "int_and_bool": case_int_and_bool, "complex": case_complex, "sparse": case_sparse,
    "weight_norm": _param("weight_norm"), "spectral_norm": _param("spectral_norm"), "orthogonal": _param("orthogonal"),
    "tied_and_shared": case_tied, "replaced_weight": case_replaced_weight, "qat": case_qat,
    "fastai_optimizer": case_fastai_optimizer, "plain_optimizer": case_plain_optimizer,
}


@pytest.mark.parametrize("build", CASES.values(), ids=CASES.keys())
def test_healthy_steps_raise_nothing(build):
    torch.manual_seed(0)
    model, opt, loss_fn, options = build()
    opts = opt if isinstance(opt, list) else [opt]
    losses, reports = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", gh.GradHealthInternalWarning)  # the monitor's own trouble fails the test
        warnings.simplefilter("error", gh.GradHealthWarning)
        mon = gh.GradHealth(model, opt, on_problem="raise", change_every=1, **options)
        for i in range(6):
            for o in opts:
                o.zero_grad()
            loss = loss_fn(i)
            loss.backward()
            reports.append(mon.check(loss=loss))
            naive = naive_classify(model, opts)
            assert {n: s for n, s in naive.items() if n in reports[-1].status} == reports[-1].status
            for o in opts:
                o.step()
            losses.append(loss.item())
        mon.flush()
        mon.close()
    assert losses[-1] < losses[0]  # healthy: it trains
    assert all(r.ok and not r.problems and not [f for f in r.findings if f.level != "info"] for r in reports)


def test_a_model_on_the_meta_device_is_refused_at_construction():
    with torch.device("meta"):
        model = mlp()
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        gh.GradHealth(model)


class NoGroups:
    """A framework's optimizer with no torch-style param_groups (as Keras's)."""

    def __init__(self, model):
        self.variables = list(model.parameters())

    def apply(self, grads):
        pass


class NoStep:
    def __init__(self, model):
        self.param_groups = [{"params": list(model.parameters()), "lr": 0.1}]


class Slotted:
    __slots__ = ("param_groups",)

    def __init__(self, model):
        self.param_groups = [{"params": list(model.parameters()), "lr": 0.1}]

    def step(self):
        pass


@pytest.mark.parametrize("make,why", [(NoGroups, "no torch-style param_groups"), (NoStep, "no torch-style param_groups"),
                                      (Slotted, "cannot be weakly referenced")], ids=["no_groups", "no_step", "slotted"])
def test_an_optimizer_that_cannot_be_watched_is_refused_at_construction(make, why):
    model = mlp()
    with pytest.raises(TypeError, match=why) as info:
        gh.GradHealth(model, make(model))
    assert "gh.GradHealth(model)" in str(info.value) and make.__name__ in str(info.value)


def test_a_plain_optimizers_step_is_wrapped_only_while_a_monitor_holds_it():
    model = mlp()
    opt = PlainOptimizer(model.parameters(), lr=0.05)
    gh.classify(model, opt)
    assert "step" not in vars(opt)  # a stateless classify leaves it untouched
    mon = gh.GradHealth(model, opt)
    assert "step" in vars(opt)  # wrapped: the monitor's step hooks run around it
    mon.close()
    assert "step" not in vars(opt)  # put back
