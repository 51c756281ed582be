"""A learning rate of 0, judged at every step whatever the optimizer, and told apart by what the
steps showed (gradhealth/measure/lrstory.py): a group held at 0 from its first step while others train is
a hold (info once), a group whose lr fell to 0 is an error at its second step there, every group at
0 since the first step is an error past a two-step warm-up (DeepSpeed's ``WarmupLR`` from 0 starts
with two exact zeros)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

import gradhealth as gh
from conftest import free_port
import procs

HERE = Path(__file__).parent


# ------------------------------------------------------------------ OLMo-core's skip-step AdamW
class SkipStepOptimizer(torch.optim.Optimizer):
    """OLMo-core's ``SkipStepOptimizer`` (olmo_core/optim/skip_step_optimizer.py), ported: a step
    skips itself (a device factor of 0) when the latest loss is an outlier of the rolling window."""

    def __init__(self, params, defaults, rolling_interval_length=128, sigma_factor=6):
        super().__init__(params, defaults)
        self.rolling_interval_length, self.sigma_factor = rolling_interval_length, sigma_factor
        self._losses: list[torch.Tensor] = []

    @property
    def latest_loss(self) -> torch.Tensor:
        return self._losses[-1]

    @latest_loss.setter
    def latest_loss(self, loss: torch.Tensor):
        self._losses.append(loss)
        while len(self._losses) > self.rolling_interval_length + 1:
            self._losses.pop(0)

    def get_step_factor(self) -> torch.Tensor:
        if len(self._losses) < max(20, self.rolling_interval_length // 2):
            return torch.tensor(1.0).to(device=self.latest_loss.device, non_blocking=True)
        loss_std, loss_mean = torch.std_mean(torch.stack(self._losses[:-1]))
        return (self.latest_loss - loss_mean).abs().div(loss_std) <= self.sigma_factor


def adamw_step(p, *, lr, betas, eps, weight_decay, exp_avg, exp_avg_sq, step, step_factor):
    if p.grad is None:
        return
    beta1, beta2 = betas
    p.mul_(1 - step_factor * (lr * weight_decay))
    exp_avg.lerp_(p.grad.type_as(exp_avg), (step_factor * (1 - beta1)).type_as(exp_avg))
    exp_avg_sq.mul_(1 - step_factor * (1 - beta2))
    exp_avg_sq.add_(step_factor * p.grad * p.grad, alpha=1 - beta2)
    bias_correction1 = 1 - beta1 ** (step + 1)
    bias_correction2 = 1 - beta2 ** (step + 1)
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()).add_(eps)
    update = -step_size * torch.div(exp_avg, denom)
    update.mul_(step_factor)
    p.add_(update)
    step.add_(step_factor)


class SkipStepAdamW(SkipStepOptimizer):
    """OLMo-core's ``SkipStepAdamW`` (olmo_core/optim/adamw.py), ported."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 rolling_interval_length=128, sigma_factor=6, dtype: Optional[torch.dtype] = None):
        assert lr > 0.0
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                         rolling_interval_length=rolling_interval_length, sigma_factor=sigma_factor)
        self.dtype = dtype

    @torch.no_grad()
    def step(self, closure=None) -> None:
        step_factor = self.get_step_factor()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.dtype)
                adamw_step(p, lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                           exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"], step=state["step"],
                           step_factor=step_factor)


def olmo_set_lr(group: dict, step: int, zero_from: int | None) -> None:
    """OLMo-core's ``Scheduler.set_lr``: the base kept in ``initial_lr``, the lr written for the step
    (here a constant schedule that writes 0.0 from ``zero_from`` on: a schedule ended too early)."""
    initial_lr = group.setdefault("initial_lr", group["lr"])
    group["lr"] = 0.0 if zero_from is not None and step >= zero_from else initial_lr


def olmo_loop(zero_from: int | None, steps: int = 12):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optim = SkipStepAdamW(model.parameters(), lr=3e-2)
    monitor = gh.GradHealth(model, optim, on_problem="raise")
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    losses = []
    try:
        for step in range(steps):  # OLMo-core's train module: zero_grad, forward/backward, latest_loss, set_lr, step
            optim.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            monitor.check(loss=loss)
            optim.latest_loss = loss.detach()
            for group in optim.param_groups:
                olmo_set_lr(group, step, zero_from)
            optim.step()
            losses.append(loss.item())
        monitor.flush()
    finally:
        monitor.close()
    return losses


def test_olmo_skip_step_adamw_whose_schedule_writes_zero_is_an_error_at_the_second_step(one_thread):
    losses = olmo_loop(None)  # the healthy control: silent under raise
    assert losses[-1] < 0.7 * losses[0]
    with pytest.raises(gh.GradHealthError, match="fell to 0") as caught:
        olmo_loop(zero_from=6)
    found = [f for f in caught.value.report.findings if f.kind == "NOT_UPDATED" and f.level == "error"]
    assert found and found[0].step == 7, [(f.step, f.message) for f in found]  # 0 at step 6 (info), 7 (error)
    assert set(found[0].params) == {"0.weight", "0.bias", "2.weight", "2.bias"}


# ------------------------------------------------------------------ skorch's documented hold
def test_skorch_param_groups_holding_a_layer_at_lr_zero_is_info_once_and_the_fit_runs(one_thread):
    skorch = pytest.importorskip("skorch")
    from skorch.callbacks import Callback

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(20, 8)
            self.out = nn.Linear(8, 1)

        def forward(self, X):
            return self.out(self.embedding(X).mean(1))

    class Health(Callback):  # the monitor in skorch's own hook after backward, before the step
        def on_train_begin(self, net, **kw):
            self.monitor = gh.GradHealth(net.module_, net.optimizer_, on_problem="raise", sinks=[self])
            self.reports = []
            self.before = net.module_.embedding.weight.detach().clone()

        def write(self, report):
            self.reports.append(report)

        def on_grad_computed(self, net, named_parameters, X=None, y=None, training=False, **kw):
            self.monitor.check()

        def on_train_end(self, net, **kw):
            self.monitor.flush()
            self.monitor.close()

    torch.manual_seed(0)
    X = torch.randint(0, 20, (128, 5))
    y = (X.float().mean(1, keepdim=True) / 10).float()
    health = Health()
    net = skorch.NeuralNetRegressor(Net, max_epochs=6, lr=0.05, optimizer=torch.optim.SGD, batch_size=32,
                                    train_split=None, verbose=0, callbacks=[health],
                                    optimizer__param_groups=[("embedding.*", {"lr": 0.0})])
    net.fit(X, y)  # nothing raised: the hold is intended
    losses = net.history[:, "train_loss"]
    assert losses[-1] < 0.5 * losses[0]  # premise: the rest trains
    assert torch.equal(net.module_.embedding.weight, health.before)  # premise: the embedding is held
    held = [f for r in health.reports for f in r.findings if "held at lr 0" in f.message]
    assert len({id(f) for f in held}) == 1 and held[0].level == "info", [f.message for f in held]
    assert held[0].params == ("embedding.weight",)
    assert "held at lr 0: not trained, on purpose?" in held[0].message
    assert not [f for r in health.reports for f in r.findings if f.level != "info"]


def test_a_group_held_at_zero_that_a_scheduler_later_drops_is_still_an_error(one_thread):
    """A hold is a group at 0 from its first step; another group that falls to 0 is named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adamax([{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}], lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 4 else 0.0)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    reports = []
    for _ in range(7):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        reports.append(mon.check())
        opt.step()
        sched.step()
    mon.flush()
    found = [(f.step, f.level, f.params) for r in reports for f in r.findings if f.kind == "NOT_UPDATED" and f.step == r.step]
    assert found[0] == (0, "info", ("0.weight", "0.bias"))  # held: said once
    assert found[1][:2] == (4, "info") and found[2][:2] == (5, "error") and set(found[2][2]) == {"2.weight", "2.bias"}
    assert not [f for f in found[1:] if "0.weight" in f[2]], found


# ------------------------------------------------------------------ DeepSpeed, default cadence
@pytest.fixture(scope="module")
def deepspeed_lr(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("dslr") / "lr.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    cases = ["0-fp32-warmup", "2-bf16-warmup", "0-fp32-stuck", "2-bf16-stuck", "1-bf16-lr0", "2-bf16-lr0"]
    proc = procs.run([sys.executable, str(HERE / "deepspeed_lr.py"), str(out), *cases], env=env,
                     capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case_id", ["0-fp32-warmup", "2-bf16-warmup"])
def test_deepspeed_warmup_lr_from_zero_is_silent(deepspeed_lr, case_id):
    case = deepspeed_lr[case_id]
    assert [lr[0] for lr in case["lrs"][:3]] == [0, 0, 0.01]  # premise: exactly 0 at its first two steps
    assert case["eval_after"] < 0.5 * case["eval_before"]  # premise: it trains
    assert case["error"] is None, case["error"]
    assert not [f for f in case["findings"] if f[1] != "info"]


@pytest.mark.slow
@pytest.mark.parametrize("case_id", ["0-fp32-stuck", "2-bf16-stuck", "1-bf16-lr0", "2-bf16-lr0"])
def test_deepspeed_lr_stuck_at_zero_in_every_group_is_an_error_by_check_3(deepspeed_lr, case_id):
    case = deepspeed_lr[case_id]
    assert case["moved"] is False and all(lr == [0, 0] or lr == [0.0, 0.0] for lr in case["lrs"])  # premise
    errors = [f for f in case["findings"] if f[0] == "NOT_UPDATED" and f[1] == "error"]
    assert errors and errors[0][2] == 2 and case["error_step"] is not None, case["findings"]
    assert "all 6 parameters" in errors[0][3] and "since the first step" in errors[0][3]


def test_a_schedule_that_starts_one_group_later_while_the_head_trains_is_a_hold(one_thread):
    """Head first: a LambdaLR holds the body at 0 for its first five steps (its base above 0) while the
    head trains, then starts it. Nothing is an error; the hold is said once at info."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.0 if s < 5 else 1.0, lambda s: 1.0])
    mon = gh.GradHealth(model, opt, on_problem="raise")
    x = torch.randn(64, 4)
    y = x[:, :1] - x[:, 1:2]
    reports, losses, before = [], [], model[0].weight.detach().clone()
    for _ in range(10):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        reports.append(mon.check(loss=loss))
        opt.step()
        sched.step()
        losses.append(loss.item())
    mon.close()
    assert opt.param_groups[0]["initial_lr"] == 0.05 and not torch.equal(before, model[0].weight)  # premise: base > 0, it started
    assert losses[-1] < 0.7 * losses[0]
    found = [f for r in reports for f in r.findings if f.kind == "NOT_UPDATED"]
    assert found and all(f.level == "info" for f in found), [(f.step, f.level, f.message[:80]) for f in found]
    assert "held at lr 0" in found[0].message and found[0].params == ("0.weight", "0.bias")


def test_steps_a_grad_scaler_skipped_do_not_count_as_steps_at_lr_zero(one_thread):
    """A warm-up from 0 that Hugging Face's loop advances only on steps that ran, with a grad scaler
    whose first scales overflow (fused AdamW: its step hooks run on the skipped steps too): the
    skipped steps did not run, so the first step that ran is the warm-up's first, not a stuck lr."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)
    mon = gh.GradHealth(model, opt, scaler=scaler, on_problem="raise")
    x = torch.randn(64, 4)
    y = 10 * (x[:, :1] - x[:, 1:2]) + 10  # (gradients above 1: the first scales overflow)
    skipped, losses = [], []
    for _ in range(14):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        mon.check(loss=loss)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        if not skipped[-1]:  # (transformers' Trainer: no scheduler step after a skipped optimizer step)
            sched.step()
        losses.append(loss.item())
    mon.close()
    assert sum(skipped[:4]) >= 3 and not any(skipped[-6:])  # premise: the scale settled after overflowing
    assert losses[-1] < losses[5]
