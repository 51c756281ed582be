"""Loops whose one call does backward, unscale, clip and step (timm's ``NativeScaler`` and its
``train_one_epoch``), checked right after the call: the norms are the gradients' own (a grad
scaler's are not unscaled twice), and a step the monitor saw is no ``NOT_UPDATED``."""

import copy

import pytest
import torch
from torch import nn

import gradhealth as gh


class NativeScaler:
    """timm/utils/cuda.py's ``NativeScaler``, ported (the device is a parameter there too)."""

    state_dict_key = "amp_scaler"

    def __init__(self, device="cpu"):
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False,
                 need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients of optimizer's assigned params in-place
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()


class ModelEma:
    """timm's ``ModelEmaV3`` in short: a deep copy, ``lerp`` towards the model after each update."""

    def __init__(self, model, decay=0.9):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model, step=None):
        for e, m in zip(self.module.parameters(), model.parameters()):
            e.lerp_(m, 1.0 - self.decay)


def train_one_epoch(use_scaler, accum_steps=2, clip_grad=1.0, lr=1e-2, batches=16):
    """timm's train.py ``train_one_epoch`` (accumulation, the one-call step, zero_grad after the
    update, the EMA), the check right after the backward call. Returns per batch: (need_update,
    the oracle norm of .grad, the report)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss_scaler = NativeScaler() if use_scaler else None
    monitor = gh.GradHealth(model, optimizer, scaler=loss_scaler._scaler if loss_scaler else None, on_problem="raise")
    model_ema = ModelEma(model)  # (made after the monitor: its hooks are deep-copied too)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    last_idx, num_updates, out, losses = batches - 1, 0, [], []
    for batch_idx in range(batches):
        x = torch.randn(16, 8, generator=g)
        last_batch = batch_idx == last_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(x)
            loss = nn.functional.mse_loss(output.float(), x @ w)
        if accum_steps > 1:
            loss /= accum_steps
        if loss_scaler is not None:
            loss_scaler(loss, optimizer, clip_grad=clip_grad, parameters=model.parameters(), need_update=need_update)
        else:
            loss.backward()
            if need_update:
                if clip_grad is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
                optimizer.step()
        oracle = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()])).item()
        report = monitor.check(loss)  # right after the one call
        out.append((need_update, oracle, report))
        if not need_update:
            continue
        num_updates += 1
        optimizer.zero_grad()
        model_ema.update(model, step=num_updates)
        losses.append(loss.item())
        with torch.no_grad():
            model_ema.module(x)  # (timm validates the EMA in eval mode: no training forward)
    monitor.close()
    return out, losses, (loss_scaler._scaler.get_scale() if loss_scaler else None)


@pytest.mark.parametrize("use_scaler", [True, False], ids=["native_scaler", "bf16"])
def test_timm_one_call_step_is_silent_and_its_norms_are_the_gradients_own(use_scaler, one_thread):
    out, losses, scale = train_one_epoch(use_scaler)
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3])  # the healthy control learns
    assert all(r.ok and not [f for f in r.findings if f.level != "info"] for _, _, r in out)
    for need_update, oracle, r in out:
        if need_update:  # after the step: the gradients as they are (unscaled and clipped by the call)
            assert r.total_grad_norm == pytest.approx(oracle, rel=1e-5)
            assert oracle <= 1.0 + 1e-5  # the premise: the call clipped them
        else:  # an accumulating call left them scaled: the check unscales them once
            expected = oracle / scale if use_scaler else oracle
            assert r.total_grad_norm == pytest.approx(expected, rel=1e-5)
    if use_scaler:  # the premise: a scale that would have divided the norms a second time
        assert scale >= 2.0 ** 10


@pytest.mark.parametrize("use_scaler", [True, False], ids=["native_scaler", "bf16"])
def test_timm_one_call_step_with_lr_zero_is_named(use_scaler, one_thread):
    with pytest.raises(gh.GradHealthError, match="NOT_UPDATED") as caught:
        train_one_epoch(use_scaler, lr=0.0)
    # the third update (batches 1, 3, 5): lr 0 at the first two in every group is a warm-up's start
    assert caught.value.report.step == 5


# ------------------------------------------------------------------ optimizer in backward
class OptimizerInBackward(torch.optim.Optimizer):
    """torchtune's ``OptimizerInBackward`` (torchtune/modules/optim.py), ported: one optimizer per
    parameter, stepped by a post-accumulate-grad hook that then zeroes (frees) its gradient; the
    wrapper's own ``param_groups`` hold every parameter and its ``step()`` does nothing."""

    def __init__(self, params, optimizer_cls, **optimizer_kwargs):
        params = list(params)  # Make a copy of params
        self._optimizers = {}
        self._param_to_index = {}
        for idx, p in enumerate(params):
            self._param_to_index[p] = idx
            if p.requires_grad:
                self._optimizers[idx] = optimizer_cls([p], **optimizer_kwargs)
                p.register_post_accumulate_grad_hook(lambda param=p: self._step_and_clear(param))
        super().__init__(params, optimizer_kwargs)

    def _step_and_clear(self, param):
        idx = self._param_to_index[param]
        self._optimizers[idx].step()
        self._optimizers[idx].zero_grad()

    def step(self, closure=None):
        if closure is not None:
            raise RuntimeError("OptimizerInBackward does not support closures.")

    def zero_grad(self, set_to_none=True):
        for opt in self._optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)


def in_backward(kind, bug=None, lr=1e-2, steps=8, batches=None):
    """torch's tutorial ("How to save memory by fusing the optimizer step into the backward pass")
    or torchtune's wrapper, the check after each ``loss.backward()``. ``bug``: ``frozen`` (layer 0),
    ``no_optimizer`` (the last bias gets no in-backward optimizer), ``nan`` (a NaN batch at step 4).
    ``kind="plain"``: the twin with an ordinary Adam step after the check."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if bug == "frozen":
        model[0].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    plain = None
    if kind == "tutorial":
        optimizer_dict = {p: torch.optim.Adam([p], lr=lr, foreach=False)
                          for p in trainable if not (bug == "no_optimizer" and p is model[2].bias)}

        def optimizer_hook(parameter) -> None:
            optimizer_dict[parameter].step()
            optimizer_dict[parameter].zero_grad()

        for p in optimizer_dict:
            p.register_post_accumulate_grad_hook(optimizer_hook)
        given = list(optimizer_dict.values())
    elif kind == "torchtune":
        given = OptimizerInBackward(model.parameters(), torch.optim.Adam, lr=lr, foreach=False)
    else:
        given = plain = torch.optim.Adam(trainable, lr=lr, foreach=False)
    monitor = gh.GradHealth(model, given, on_problem="ignore" if bug else "raise", expect_frozen=["0.*"] if bug == "frozen" else None)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    reports, losses = [], []
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        if bug == "nan" and step == 4:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(model(x), x @ w)
        loss.backward()  # (the in-backward steps run here)
        reports.append(monitor.check(loss))
        if plain is not None:
            plain.step()
            plain.zero_grad()
        losses.append(loss.item())
    monitor.close()
    return reports, losses, model


@pytest.mark.parametrize("kind", ["tutorial", "torchtune"])
def test_optimizer_in_backward_is_silent_with_the_norms_of_a_plain_twin(kind, one_thread):
    reports, losses, model = in_backward(kind)
    assert all(p.grad is None for p in model.parameters())  # the premise: nothing is left in .grad
    twin, twin_losses, _ = in_backward("plain")
    assert losses == pytest.approx(twin_losses, rel=1e-5) and losses[-1] < 0.5 * losses[0]  # the same run, learning
    for r, t in zip(reports, twin):
        assert r.ok and list(r.status.values()) == [gh.Status.OK] * 4
        assert r.grad_norm == pytest.approx(t.grad_norm, rel=1e-5)
        assert not [f for f in r.findings if f.level != "info"]
    assert reports[1].update_norm  # the steps inside the backward are measured, in the check that follows them


def test_optimizer_in_backward_bugs_are_named_as_in_a_plain_loop(one_thread):
    reports, _, _ = in_backward("tutorial", bug="no_optimizer")
    assert reports[0].problems == {"2.bias": gh.Status.NOT_IN_OPTIMIZER}
    reports, _, model = in_backward("tutorial", bug="frozen")
    assert not model[0].weight.requires_grad  # the premise
    assert [f.params for f in reports[0].findings if f.kind == "UNEXPECTED_FROZEN"] == []  # (expected: 0.*)
    assert reports[0].status["0.weight"] is gh.Status.FROZEN and reports[0].status["2.weight"] is gh.Status.OK
    reports, _, _ = in_backward("torchtune", bug="nan")
    assert reports[3].ok and reports[4].problems and set(reports[4].problems.values()) == {gh.Status.NON_FINITE_GRAD}
    reports, _, _ = in_backward("tutorial", lr=0.0, bug="lr0")
    kinds = [[(f.kind, f.level) for f in r.findings if f.kind == "NOT_UPDATED"] for r in reports]
    assert ("NOT_UPDATED", "error") in kinds[2] or ("NOT_UPDATED", "error") in kinds[3]


# ------------------------------------------------------------------ gradients in main_grad
class MegatronDDP(nn.Module):
    """Megatron-Core's ``DistributedDataParallel`` as far as the monitor sees it, ported (one
    process): a contiguous fp32 gradient buffer, each trainable parameter's ``main_grad`` a view of
    it, a hook on the parameter's gradient accumulator that adds ``param.grad`` into it and frees
    ``param.grad``, and ``zero_grad_buffer()`` at the start of each iteration."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.grad_data = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
        self.grad_accs = []
        offset = 0
        for param in params:
            param.main_grad = self.grad_data[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()
            param_tmp = param.expand_as(param)  # (Megatron's way to the gradient accumulator)
            grad_acc = param_tmp.grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._make_param_hook(param))
            self.grad_accs.append(grad_acc)

    def _make_param_hook(self, param):
        def param_hook(*unused):
            if param.grad is not None:
                param.main_grad.add_(param.grad.data)
            param.grad = None

        return param_hook

    def zero_grad_buffer(self):
        self.grad_data.zero_()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class FP32Optimizer:
    """Megatron-Core's ``FP32Optimizer`` in short: the gradients it applies are ``main_grad``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                param.grad = None

    def step(self):
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad"):
                    param.grad = param.main_grad
        self.optimizer.step()


def megatron_run(bug=None, steps=8):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if bug == "frozen":
        net[0].requires_grad_(False)
    model = MegatronDDP(net)
    params = [p for p in net.parameters() if p.requires_grad and not (bug == "out" and p is net[2].bias)]
    optimizer = FP32Optimizer(torch.optim.Adam(params, lr=1e-2))
    monitor = gh.GradHealth(model, optimizer, on_problem="ignore" if bug else "raise",
                            expect_frozen=[] if bug == "frozen" else None)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    reports, losses, oracle = [], [], []
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x @ w)
        loss.backward()
        oracle.append({n: p.main_grad.double().norm().item() for n, p in net.named_parameters() if p.requires_grad})
        reports.append(monitor.check(loss))
        optimizer.step()
        losses.append(loss.item())
    monitor.close()
    return reports, losses, oracle, net


def test_gradients_in_main_grad_are_judged_there():
    reports, losses, oracle, net = megatron_run()
    assert all(p.grad is None or p.grad is p.main_grad for p in net.parameters())  # the premise: .grad freed
    assert losses[-1] < 0.5 * losses[0]
    for r, o in zip(reports, oracle):
        assert r.ok and not [f for f in r.findings if f.level != "info"]
        assert list(r.grad_norm) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert r.grad_norm == pytest.approx(o, rel=1e-6)
    assert reports[0].update_norm  # the step that applied main_grad is measured (into the report of its check)


def test_main_grad_bugs_are_named():
    reports, _, _, _ = megatron_run("out")
    assert reports[0].problems == {"2.bias": gh.Status.NOT_IN_OPTIMIZER}
    reports, _, _, net = megatron_run("frozen")
    assert not hasattr(net[0].weight, "main_grad")  # the premise: Megatron's buffer skips frozen parameters
    [f] = reports[0].findings_of("UNEXPECTED_FROZEN")
    assert f.params == ("0.weight", "0.bias")
    assert reports[0].status["2.weight"] is gh.Status.OK


# ------------------------------------------------------------------ the manual's blocks (docs/loops.md), as written
def _readme_blocks():
    import os
    import re

    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "loops.md")).read()
    part = text.split("**One call does backward, clip and step**", 1)[1].split("## Recipes for the loops people copy", 1)[0]
    return re.findall(r"```python\n(.*?)```", part, re.S)


def _namespace(model, **kw):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    xs = [torch.randn(16, 8, generator=g) for _ in range(12)]
    return {"gh": gh, "torch": torch, "model": model, "loader": [(x, x @ w) for x in xs],
            "loss_fn": lambda out, target: nn.functional.mse_loss(out.float(), target), **kw}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _loss_on(model, ns):
    with torch.no_grad():
        return sum(ns["loss_fn"](model(x), y).item() for x, y in ns["loader"])


def test_the_manual_blocks_for_steps_that_are_not_backward_check_step_run_as_written(one_thread):
    one_call, pre_hook, in_backward, main_grad = _readme_blocks()
    # timm's loop, checked after the call
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ns = _namespace(model, optimizer=optimizer, loss_scaler=NativeScaler(), accum_steps=2)
    before = _loss_on(model, ns)
    exec(one_call, ns)
    assert ns["monitor"].carry.checks == 12 and _loss_on(model, ns) < before
    # the one line: the check inside the step, the loop without its own check
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ns = _namespace(model, optimizer=optimizer, loss_scaler=NativeScaler(), accum_steps=2)
    ns["monitor"] = gh.GradHealth(model, optimizer, scaler=ns["loss_scaler"]._scaler, on_problem="raise")
    exec(pre_hook, ns)
    exec(one_call.replace("    monitor.check(loss)  # right after the call, accumulating or not\n", "")
         .replace('monitor = gh.GradHealth(model, optimizer, scaler=loss_scaler._scaler, on_problem="raise")\n', ""), ns)
    r = ns["monitor"].last_report
    assert ns["monitor"].carry.checks == 6 and r.ok and r.total_grad_norm <= 1.0 + 1e-6  # unscaled and clipped
    # the optimizer stepped inside backward
    model = _mlp()
    ns = _namespace(model)
    before = _loss_on(model, ns)
    exec(in_backward, ns)
    assert ns["monitor"].carry.checks == 12 and ns["monitor"].last_report.ok and _loss_on(model, ns) < before
    # Megatron's main_grad
    net = _mlp()
    model = MegatronDDP(net)
    ns = _namespace(model, optimizer=FP32Optimizer(torch.optim.Adam(net.parameters(), lr=1e-2)))
    before = _loss_on(model, ns)
    exec(main_grad, ns)
    assert ns["monitor"].carry.checks == 12 and ns["monitor"].last_report.ok and _loss_on(model, ns) < before
