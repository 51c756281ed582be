"""gradhealth/model/wrappers.py: a wrapper is seen through only when it is one (it owns no parameter, holds
them all, and exists to distribute or compile the user's model), decided by what it does; a user's
holder of ``self.module`` (Composer's ComposerClassifier, a LightningModule, a hand-written one) keeps
its own names; a name pattern the user gives matches with a wrapper's or holder's prefix or without."""

import warnings

import pytest
import torch
from torch import nn

import gradhealth as gh
from conftest import free_port

NET = ["0.weight", "0.bias", "2.weight", "2.bias"]
HELD = [f"module.{n}" for n in NET]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


class Holder(nn.Module):
    """A hand-written holder: the user's network as ``self.module``, the loss beside it."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


class ClassifierShape(nn.Module):
    """Composer's ``ComposerClassifier`` as far as names go (composer cannot be imported here: it
    imports torchvision): ``self.module``, the loss function as ``self._loss_fn``, torchmetrics'
    metrics as children without parameters, ``forward(batch)`` and ``loss(outputs, batch)``."""

    def __init__(self, module, num_classes=3):
        super().__init__()
        from torchmetrics import MetricCollection
        from torchmetrics.classification import MulticlassAccuracy

        self.module = module
        self._loss_fn = nn.functional.cross_entropy
        self.num_classes = num_classes
        self.train_metrics = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_metrics = MetricCollection([MulticlassAccuracy(num_classes=num_classes, average="micro")])

    def forward(self, batch):
        inputs, _ = batch
        return self.module(inputs)

    def loss(self, outputs, batch):
        _, targets = batch
        return self._loss_fn(outputs, targets)


def _data(steps=24):
    g = torch.Generator().manual_seed(1)
    proj = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        out.append((x, (x @ proj).argmax(1)))
    return out


def _fit(model, forward, params, expect_frozen, on_problem="raise", steps=24):
    """The loop Composer's Trainer runs (zero_grad, forward, loss, backward, the check before the
    step): (losses, reports)."""
    opt = torch.optim.Adam(params, lr=0.05)
    mon = gh.GradHealth(model, opt, on_problem=on_problem, expect_frozen=expect_frozen)
    losses, reports = [], []
    for batch in _data(steps):
        opt.zero_grad(set_to_none=True)
        loss = forward(batch)
        loss.backward()
        reports.append(mon.check(loss))
        opt.step()
        losses.append(loss.item())
    mon.close()
    return losses, reports


def _holder(kind):
    """(model, a function of the batch giving the loss, the user's network)."""
    net = _net()
    net[0].requires_grad_(False)  # the frozen layer that expect_frozen names
    if kind == "hand-written":
        model = Holder(net)
        return model, lambda b: nn.functional.cross_entropy(model(b[0]), b[1]), net
    if kind == "composer-classifier":
        model = ClassifierShape(net)
        return model, lambda b: model.loss(model(b), b), net
    if kind == "compiled holder":  # torch.compile around the holder: seen through down to the holder
        held = Holder(net)
        model = torch.compile(held, backend="eager")
        return model, lambda b: nn.functional.cross_entropy(model(b[0]), b[1]), net
    if kind == "dataparallel of a holder":  # DataParallel distributes; the holder it holds keeps its names
        model = nn.DataParallel(Holder(net))
        return model, lambda b: nn.functional.cross_entropy(model(b[0]), b[1]), net
    raise AssertionError(kind)


HOLDERS = ["hand-written", "composer-classifier", "compiled holder", "dataparallel of a holder"]


@pytest.mark.parametrize("kind", HOLDERS)
def test_a_holder_of_self_module_keeps_its_names_and_either_spelling_of_expect_frozen_is_silent(kind, one_thread):
    """The names are the holder's own (``module.0.weight``, as its ``named_parameters()`` writes
    them); ``expect_frozen`` written as those names, or without the holder's prefix, is silent under
    raise on a run that learns; one that leaves the frozen layer out is still an error, in the
    holder's names."""
    for spelling in (["module.0.*"], ["0.*"]):
        model, forward, net = _holder(kind)
        params = [p for p in net.parameters() if p.requires_grad]
        assert gh.GradHealth(model).parameter_names == HELD
        losses, reports = _fit(model, forward, params, spelling)
        assert sum(losses[-4:]) < 0.8 * sum(losses[:4])  # the premise: it learns
        assert all(r.ok and not r.findings_of("UNEXPECTED_FROZEN") for r in reports), spelling
        assert list(reports[0].status) == HELD and reports[0].status["module.0.weight"] is gh.Status.FROZEN
    model, forward, net = _holder(kind)
    _, reports = _fit(model, forward, [p for p in net.parameters() if p.requires_grad], ["2.*"], on_problem="ignore", steps=2)
    [f] = reports[0].findings_of("UNEXPECTED_FROZEN")
    assert f.level == "error" and f.params == ("module.0.weight", "module.0.bias")


def test_a_lightning_module_that_stores_self_module_under_the_real_trainer(tmp_path, one_thread):
    """A LightningModule holding ``self.module``: the callback's reports and ``expect_frozen`` use
    the module's own names; a frozen first layer listed either way is silent under raise, and it
    learns; left out, it is named and stops the fit."""
    import lightning.pytorch as pl

    from gradhealth.demos.lightning_parts import SyntheticData
    from gradhealth.integrations.lightning import GradHealthCallback

    class Held(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            self.module[0].requires_grad_(False)
            self.losses = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.module(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.05)

    def fit(expect_frozen, on_problem="raise"):
        reports = []

        class Keep:
            def write(self, report):
                reports.append(report)

        module = Held()
        names = [n for n, _ in module.named_parameters()]
        trainer = pl.Trainer(max_steps=16, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=0, default_root_dir=tmp_path,
                             callbacks=[GradHealthCallback(on_problem=on_problem, expect_frozen=expect_frozen,
                                                           sinks=[Keep()], log=False)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, SyntheticData(n_batches=16))
        return module, names, reports

    for spelling in (["module.0.*"], ["0.*"]):
        module, names, reports = fit(spelling)
        assert names == ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]
        assert sum(module.losses[-4:]) < 0.8 * sum(module.losses[:4])  # the premise: it learns
        assert len(reports) == 16 and all(r.ok for r in reports)
        assert list(reports[0].status) == names
    with pytest.raises(gh.GradHealthError, match=r"UNEXPECTED_FROZEN.*module\.0\.\*"):
        fit(["module.2.*"])


# ------------------------------------------------------------------ wrappers, seen through
class _Gloo:
    """A one-rank gloo group for the test's duration (DistributedDataParallel needs one)."""

    def __enter__(self):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()


def _wrapped(kind, net):
    """(the object the monitor gets, the module that runs forward, the names of the parameters as
    the given object's ``named_parameters()`` writes them, the names reported)."""
    if kind == "compile":
        m = torch.compile(net, backend="eager")
        return m, m, [f"_orig_mod.{n}" for n in NET], NET
    if kind == "dataparallel":
        m = nn.DataParallel(net)
        return m, m, [f"module.{n}" for n in NET], NET
    if kind == "dataparallel of compiled":
        m = nn.DataParallel(torch.compile(net, backend="eager"))
        return m, m, [f"module._orig_mod.{n}" for n in NET], NET
    if kind == "ddp":
        m = nn.parallel.DistributedDataParallel(net)
        return m, m, [f"module.{n}" for n in NET], NET
    if kind == "ddp of a holder":
        m = nn.parallel.DistributedDataParallel(Holder(net))
        return m, m, [f"module.module.{n}" for n in NET], HELD
    if kind == "fabric":
        import lightning as L

        m = L.Fabric(accelerator="cpu", devices=1).setup_module(net)
        return m, m, [f"_forward_module.{n}" for n in NET], NET
    if kind == "fabric of a holder":
        import lightning as L

        m = L.Fabric(accelerator="cpu", devices=1).setup_module(Holder(net))
        return m, m, [f"_forward_module.module.{n}" for n in NET], HELD
    if kind == "megatron ddp":  # gradients in main_grad (tests/test_idioms_steps.py's port)
        from test_idioms_steps import MegatronDDP

        m = MegatronDDP(net)
        return m, m, [f"module.{n}" for n in NET], NET
    raise AssertionError(kind)


WRAPPERS = ["compile", "dataparallel", "dataparallel of compiled", "ddp", "ddp of a holder", "fabric",
            "fabric of a holder", "megatron ddp"]


@pytest.mark.parametrize("kind", WRAPPERS)
def test_wrappers_are_seen_through_and_a_pattern_matches_with_their_prefix_or_without(kind, one_thread):
    """Under each wrapper (and a holder under one) the reported names are the user's; ``expect_frozen``
    written with the names the wrapper's ``named_parameters()`` gives, or as reported, is silent
    under raise; a pattern that leaves the frozen layer out is an error either way."""
    import contextlib

    with _Gloo() if kind.startswith("ddp") else contextlib.nullcontext():
        for frozen in ("given", "reported", "wrong"):
            net = _net()
            net[0].requires_grad_(False)
            given, run, given_names, reported = _wrapped(kind, net)
            assert [n for n, _ in given.named_parameters()] == given_names  # the premise: the wrapper's spelling
            pattern = {"given": given_names[0].replace("weight", "*"), "reported": reported[0].replace("weight", "*"),
                       "wrong": reported[2].replace("weight", "*")}[frozen]
            opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.2)
            if kind == "megatron ddp":
                from test_idioms_steps import FP32Optimizer

                opt = FP32Optimizer(opt)
            mon = gh.GradHealth(given, opt, on_problem="ignore" if frozen == "wrong" else "raise", expect_frozen=[pattern])
            assert mon.parameter_names == reported
            for batch in _data(3):
                opt.zero_grad()
                if kind == "megatron ddp":
                    given.zero_grad_buffer()
                nn.functional.cross_entropy(run(batch[0]), batch[1]).backward()
                r = mon.check()
                opt.step()
            mon.close()
            assert list(r.status) == reported
            if frozen == "wrong":
                [f] = r.findings_of("UNEXPECTED_FROZEN")
                assert f.level == "error" and f.params == tuple(reported[:2])
            else:
                assert r.ok and not r.findings, (pattern, r.findings)


def test_respell_adds_each_wrappers_prefix_or_leaves_it_out():
    from gradhealth.model.wrappers import respell

    net = _net()
    dp = nn.DataParallel(torch.compile(net, backend="eager"))
    assert set(respell(dp, ("module._orig_mod.0.*", "module.2.*"))) >= {"0.*", "2.*"}
    held = Holder(Holder(net))
    assert set(respell(held, ("0.*",))) >= {"module.module.0.*", "module.0.*"}
    assert respell(net, ("0.*",)) == ("0.*",)  # a plain model: the patterns as given
    assert respell(held, {"0.weight": 1}) == {"0.weight": 1, "module.0.weight": 1, "module.module.0.weight": 1}
    assert respell(held, None) is None


class Bank(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, 4) * 0.1)


class MoE(nn.Module):
    """Four experts stacked in one tensor, under a name the automatic search does not look at."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(4, 4)
        self.bank = Bank()

    def forward(self, x):
        gate = self.router(x).softmax(-1)
        return torch.einsum("be,eio,bi->bo", gate, self.bank.w, x)


@pytest.mark.parametrize("spelling", ["module.bank.w", "bank.w"])
@pytest.mark.parametrize("kind", ["holder", "dataparallel"])
def test_experts_declared_in_either_spelling_are_the_same_stack(kind, spelling, one_thread):
    model = Holder(MoE()) if kind == "holder" else nn.DataParallel(MoE())
    reported = "module.bank" if kind == "holder" else "bank"
    mon = gh.GradHealth(model, experts={spelling: 0}, on_problem="raise")
    model(torch.randn(8, 4)).square().mean().backward()
    r = mon.check()
    mon.close()
    assert sorted(r.expert_status) == [f"{reported}[{i}]" for i in range(4)]


@pytest.mark.parametrize("spelling", [["module.0.*"], ["0.*"]])
def test_assert_trains_takes_either_spelling(spelling):
    from gradhealth.testing import assert_trains

    net = _net()
    net[0].requires_grad_(False)
    model = Holder(net)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    batch = _data(1)[0]
    status = assert_trains(model, opt, nn.functional.cross_entropy, batch, expect_frozen=spelling)
    assert list(status) == HELD
    with pytest.raises(AssertionError, match=r"module\.0\.weight: FROZEN"):
        assert_trains(model, opt, nn.functional.cross_entropy, batch, expect_frozen=["2.*"])
