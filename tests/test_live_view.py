"""A live view of the model: parameters added, replaced, re-assigned or converted after the
monitor was created are judged at the next check; lazy and complex parameters never crash."""

import math

import pytest
import torch
from torch import nn

import gradhealth as gh

S = gh.Status


def step(model, opt, mon, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    r = mon.check()
    opt.step()
    return r


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = None

    def forward(self, x):
        h = self.body(x)
        return self.head(h) if self.head is not None else h


def test_head_attached_after_the_monitor_is_judged():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    step(model, opt, mon, torch.randn(2, 4))
    model.head = nn.Linear(8, 2)  # attached after the monitor and the optimizer
    r = step(model, opt, mon, torch.randn(2, 4))
    assert r.status["head.weight"] is S.NOT_IN_OPTIMIZER and r.status["head.bias"] is S.NOT_IN_OPTIMIZER
    assert not r.ok
    opt.add_param_group({"params": model.head.parameters()})  # the repair
    r = step(model, opt, mon, torch.randn(2, 4))
    assert r.status["head.weight"] is S.OK and r.ok


def test_replaced_submodule_and_assign_load():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    step(model, opt, mon, torch.randn(2, 4))
    model[2] = nn.Linear(8, 2)  # replaced: the optimizer still holds the old one
    r = step(model, opt, mon, torch.randn(2, 4))
    assert set(r.status) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert r.problems == {"2.weight": S.NOT_IN_OPTIMIZER, "2.bias": S.NOT_IN_OPTIMIZER}
    assert r.grad_norm["2.weight"] == pytest.approx(model[2].weight.grad.double().norm().item(), rel=1e-6)
    # load_state_dict(assign=True) puts new tensors in: the optimizer holds none of them
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    r = step(model, opt, mon, torch.randn(2, 4))
    assert set(r.problems.values()) == {S.NOT_IN_OPTIMIZER} and len(r.problems) == 4


class Builds(nn.Module):
    """Builds modules in its forward, as real models do, without changing its own: Hugging Face's
    decoders run ``self.layers[:n]`` (a new ``ModuleList`` holding the model's layers: each one
    registered into it), and a helper module made and thrown away."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        nn.Sequential(nn.Identity()).register_parameter("scratch", nn.Parameter(torch.zeros(1)))
        return x


def _counting_views(monkeypatch):
    from gradhealth import monitor as monitor_module

    built = []

    class Counted(monitor_module.ParamView):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(monitor_module, "ParamView", Counted)
    return built


def test_modules_a_forward_builds_outside_the_model_do_not_rebuild_the_view(monkeypatch):
    """The view is rebuilt only for a registration on one of the model's modules: a container or a
    helper that a forward builds around the model's layers is not one (the view was rebuilt at
    every check of every such model before, 82k Python instructions a check on a tiny Llama)."""
    torch.manual_seed(0)
    model, seen = Builds(), []
    premise = torch.nn.modules.module.register_module_module_registration_hook(lambda *a: seen.append(a[0]))
    model(torch.randn(2, 4))
    premise.remove()
    assert seen and all(m is not model and m is not model.layers for m in seen)  # registrations, none into the model
    built = _counting_views(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    for _ in range(4):
        r = step(model, opt, mon, torch.randn(2, 4))
    assert built == [1]  # the monitor's own view, never rebuilt
    assert r.problems == {"layers.2.weight": S.NO_GRAD, "layers.2.bias": S.NO_GRAD}  # still judged as it is
    model.layers[2].register_parameter("gain", nn.Parameter(torch.ones(4)))  # a registration on the model's own
    r = step(model, opt, mon, torch.randn(2, 4))
    assert built == [1, 1] and r.status["layers.2.gain"] is S.NO_GRAD and r.in_optimizer["layers.2.gain"] is False


def test_a_module_built_apart_then_attached_is_judged_and_other_models_are_not_rebuilt(monkeypatch):
    torch.manual_seed(0)
    built = _counting_views(monkeypatch)
    a, b = Net(), nn.Sequential(nn.Linear(4, 2))
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    mon_a, mon_b = gh.GradHealth(a, opt_a, on_problem="ignore"), gh.GradHealth(b, opt_b, on_problem="ignore")
    step(a, opt_a, mon_a, torch.randn(2, 4))
    step(b, opt_b, mon_b, torch.randn(2, 4))
    head = nn.Sequential()
    head.add_module("proj", nn.Linear(8, 2))  # registrations in a module of neither model
    head.proj.register_parameter("extra", nn.Parameter(torch.zeros(2)))
    step(a, opt_a, mon_a, torch.randn(2, 4))
    assert built == [1, 1]
    a.head = head  # attached: a registration on model a's own root
    r = step(a, opt_a, mon_a, torch.randn(2, 4))
    step(b, opt_b, mon_b, torch.randn(2, 4))
    assert built == [1, 1, 1]  # a's view rebuilt, b's not
    assert {n for n in r.status if n.startswith("head.")} == {"head.proj.weight", "head.proj.bias", "head.proj.extra"}
    assert r.status["head.proj.weight"] is S.NOT_IN_OPTIMIZER


@pytest.mark.parametrize("how", ["insert", "_modules"])
def test_a_layer_placed_without_a_registration_of_the_models_is_judged(how):
    """``Sequential.insert`` and a replacer that writes ``_modules`` (as quantisation integrations
    do) put a new layer in without a registration hook on any module of the model; the layer was
    built since the last check (its own parameters registered into it), so it is looked for and found."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    step(model, opt, mon, torch.randn(3, 4))
    new = nn.Linear(4, 4)
    if how == "insert":
        model.insert(1, new)
    else:
        model._modules["0"] = new  # (the first layer swapped in place)
    r = step(model, opt, mon, torch.randn(3, 4))
    assert list(r.status) == [n for n, _ in model.named_parameters()]
    assert r.grad_norm[f"{1 if how == 'insert' else 0}.weight"] == pytest.approx(new.weight.grad.norm().item(), rel=1e-6)
    assert r.problems == {f"{1 if how == 'insert' else 0}.{k}": S.NOT_IN_OPTIMIZER for k in ("weight", "bias")}


class Slices(nn.Module):
    """Runs its layers through a slice of them, as Hugging Face decoders do."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for layer in self.layers[: len(self.layers)]:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)), Slices],
                         ids=["sequential", "slices"])
def test_a_layer_deleted_without_a_hook_leaves_the_view(make):
    """``del model[1]`` fires no registration hook: the check after it still judges the deleted
    layer (its gradient left from the last step: in no optimizer now), and its problems' names are
    looked up at the next check and found gone; the view is rebuilt from then on (before: the
    deleted layer named at every check)."""
    torch.manual_seed(0)
    model = make()
    layers = model if isinstance(model, nn.Sequential) else model.layers
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    x = torch.randn(2, 4)
    for _ in range(3):
        assert step(model, opt, mon, x).ok
    del layers[1]
    opt.param_groups[0]["params"] = list(model.parameters())
    reports = [step(model, opt, mon, x) for _ in range(12)]
    real = [n for n, _ in model.named_parameters()]
    prefix = "" if layers is model else "layers."
    assert len(real) == len(reports[0].status) - 2 and set(reports[0].problems) == {f"{prefix}1.weight", f"{prefix}1.bias"}
    assert all(list(r.status) == real and r.ok and not r.findings for r in reports[1:]), reports[1].status


class Branches(nn.Module):
    """One of four branches at each step, picked at random (an expert idle now and then): the
    NO_GRAD set changes from check to check."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(4, 1) for _ in range(4))
        self.g = torch.Generator().manual_seed(3)

    def forward(self, x):
        return self.branches[int(torch.randint(0, 4, (1,), generator=self.g))](x)


def test_problems_that_come_and_go_are_looked_up_once_each(monkeypatch):
    """A parameter without a gradient is looked up in the model the first time it is one: branches
    idle at random (every check a new set of NO_GRAD names) never rebuild the view."""
    torch.manual_seed(0)
    model = Branches()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    built = _counting_views(monkeypatch)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    seen = set()
    for _ in range(16):
        r = step(model, opt, mon, torch.randn(2, 4))
        seen.add(frozenset(r.problems))
    assert len(seen) >= 3 and built == [1]  # (the premise: the sets changed)


def test_a_real_decoder_that_slices_its_layers_is_viewed_once(monkeypatch):
    """A tiny Llama (random weights) under a LoRA adapter: its forward slices its layers at every
    call; the view is built once and a check costs the Python of a small model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from gradhealth.benchmarks.counts import _instructions

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                        vocab_size=100, max_position_embeddings=64))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    built = _counting_views(monkeypatch)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    g, losses, costs = torch.Generator().manual_seed(1), [], []
    ids = torch.randint(0, 100, (4, 12), generator=g)
    for i in range(12):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        costs.append(_instructions(lambda: mon.check(loss=loss)) if i >= 4 else (mon.check(loss=loss), 0)[1])
        opt.step()
        losses.append(loss.item())
    mon.close()
    assert losses[-1] < losses[0] and mon.last_report.ok  # (healthy: it learns, nothing said)
    assert built == [1]
    assert max(costs) <= 8000, costs  # (a 6-tensor MLP's check: ~3.5k)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD([model[0].weight, model[0].bias, model[1].weight], lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    assert step(model, opt, mon, torch.randn(2, 4)).status["1.bias"] is S.NOT_IN_OPTIMIZER
    opt.param_groups[0]["params"][2] = model[1].bias  # same length, another tensor
    r = step(model, opt, mon, torch.randn(2, 4))
    assert r.status["1.bias"] is S.OK and r.status["1.weight"] is S.NOT_IN_OPTIMIZER


def test_one_middle_layer_to_float64():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    step(model, opt, mon, torch.randn(2, 4))
    model[2].double()
    model[2].register_forward_pre_hook(lambda m, a: (a[0].double(),))
    model[4].register_forward_pre_hook(lambda m, a: (a[0].float(),))
    for _ in range(3):
        r = step(model, opt, mon, torch.randn(2, 4))
        assert r.ok
        assert r.grad_norm["2.weight"] == pytest.approx(model[2].weight.grad.norm().item(), rel=1e-12)


def test_lazy_parameters_are_left_out_until_materialised(caplog):
    import logging

    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    with caplog.at_level(logging.INFO, logger="gradhealth"):
        mon = gh.GradHealth(model, on_problem="ignore")  # before the first forward: no crash
    assert any("left out until their first forward: 0.weight, 0.bias" in r.getMessage() for r in caplog.records)
    model(torch.randn(2, 4)).sum().backward()
    r = mon.check()
    assert set(r.status) == {"0.weight", "0.bias", "2.weight", "2.bias"} and r.ok
    assert r.grad_norm["0.weight"] == pytest.approx(model[0].weight.grad.double().norm().item(), rel=1e-6)
    assert gh.classify(nn.Sequential(nn.LazyLinear(3))) == {}


def test_complex_parameters():
    torch.manual_seed(0)

    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))
            self.v = nn.Parameter(torch.randn(4, dtype=torch.complex128))

        def forward(self, x):
            return (x * self.w).abs().sum() + (x.to(torch.complex128) * self.v).real.sum()

    model = Spectral()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = gh.GradHealth(model, opt, on_problem="raise", update_every=1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4)).backward()
        r = mon.check()
        opt.step()
    mon.flush()
    for name, p in model.named_parameters():
        assert r.grad_norm[name] == pytest.approx(torch.linalg.vector_norm(p.grad).item(), rel=1e-6)
    model.w.grad = torch.tensor([1, complex(0, math.inf), 0, 0], dtype=torch.complex64)
    assert gh.classify(model)["w"] is S.NON_FINITE_GRAD
    model.w.grad = torch.zeros(4, dtype=torch.complex64)
    assert gh.classify(model)["w"] is S.ZERO_GRAD


def test_a_failing_look_at_the_model_never_breaks_the_run(monkeypatch):
    """The deletion look-up and the newcomers' walk run before the check's own guard: a model that
    cannot be walked or looked up now is judged as it is, and the run goes on."""
    from gradhealth.model import params

    def boom(*_args):
        raise RuntimeError("planted")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1))  # (the last one never runs: NO_GRAD)
    model.forward = lambda x: model[1](model[0](x))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    step(model, opt, mon, torch.randn(2, 4))
    monkeypatch.setattr(params.ModelChanges, "_verify", boom)
    monkeypatch.setattr(params, "_module_ids", boom)
    nn.Linear(4, 4)  # (a newcomer: the walk that looks for it fails)
    for _ in range(3):
        r = step(model, opt, mon, torch.randn(2, 4))
    assert r is not None and r.problems == {"2.weight": S.NO_GRAD, "2.bias": S.NO_GRAD}
