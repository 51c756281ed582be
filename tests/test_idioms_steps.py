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
    assert caught.value.report.step == 3  # the second update: lr 0 at the first alone is a warmup's start
