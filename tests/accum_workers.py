"""Workers (spawned gloo ranks) for DDP accumulation windows: a loop whose last micro-step is under
``no_sync()`` too (its gradients never reduced by DDP), on its own or reduced by hand before the
step, and a loss that turns NaN inside a window on one rank."""

import torch
import torch.distributed as dist
from torch import nn

import gradhealth as gh

from dist_workers import _report as _plain
from replica_workers import _gather_params


def _report(r):
    """The workers' usual report, each finding with the micro-batches it names (window findings)."""
    out = _plain(r)
    for f, kept in zip(r.findings, out["findings"]):
        kept.append(f.data.get("micro_batches"))
    return out

ACCUM = 2


def never_synced(rank, world, where="every", by_hand=False):
    """Every micro-step under ``ddp.no_sync()``, the last one too; ``where``: the check after every
    backward (inside the block) or once after it; ``by_hand``: the gradients all-reduced by hand
    before the step (DDP reduces nothing, the loop does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gh.GradHealth(ddp, opt, on_problem="raise")
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    held = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))  # (a held-out batch, the same on every rank)

    def held_out():
        with torch.no_grad():
            return nn.functional.mse_loss(model(held), held @ w).item()

    reports, drift, losses, before = [], [], [], held_out()
    try:
        for it in range(6):
            for micro in range(ACCUM):
                with ddp.no_sync():
                    x = torch.randn(16, 8, generator=g)
                    loss = nn.functional.mse_loss(ddp(x), x @ w) / ACCUM
                    loss.backward()
                    if where == "every":
                        reports.append(None if (r := mon.check(loss)) is None else _report(r))
            if where == "after":
                reports.append(None if (r := mon.check(loss)) is None else _report(r))
            if by_hand:
                for p in model.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                    p.grad /= world
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            drift.append(not _gather_params(model))  # the premise: the replicas apart after this step
    except gh.GradHealthError as exc:
        reports.append({"raised_at": it, **_report(exc.report)})
    mon.close()
    return {"reports": reports, "drift": drift, "losses": losses, "before": before, "after": held_out()}


def nan_in_window(rank, world, tracked=False):
    """nanoGPT's accumulation under DDP, the check after every backward: at iteration 2 rank 1's
    first micro-batch (inside ``no_sync()``) selects no token, and its token mean is NaN;
    ``tracked``: the loop counts the tokens with ``monitor.track_valid``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gh.GradHealth(ddp, opt, on_problem="ignore")
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    reports, nan_at = [], None
    for it in range(3):  # (the step of iteration 2 makes the weights NaN: the run ends there)
        for micro in range(ACCUM):
            ddp.require_backward_grad_sync = micro == ACCUM - 1
            x = torch.randn(16, 8, generator=g)
            mask = torch.ones(16, dtype=torch.bool)
            if it == 2 and micro == 0 and rank == 1:
                mask[:] = False  # the planted empty batch
            if tracked:
                mon.track_valid(mask, "tokens")
            per_token = (ddp(x) - x @ w).square().squeeze(1)
            loss = (per_token * mask).sum() / mask.sum() / ACCUM  # a token mean: 0/0 over no token
            if not torch.isfinite(loss):
                nan_at = [it, micro]  # the premise
            loss.backward()
            r = mon.check(loss)
            reports.append(None if r is None else {"step": r.step, **_report(r), "valid": dict(r.valid_counts)})
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.close()
    return {"reports": reports, "nan_at": nan_at}


SCENARIOS = {
    "never_synced_every": never_synced,
    "never_synced_after": lambda r, w: never_synced(r, w, "after"),
    "never_synced_by_hand": lambda r, w: never_synced(r, w, "every", by_hand=True),
    "nan_in_window": nan_in_window,
    "nan_in_window_tracked": lambda r, w: nan_in_window(r, w, tracked=True),
}


class Engine(torch.nn.Module):
    """An engine that owns its accumulation, reduced to what the monitor reads of one (DeepSpeed's
    shape: ``.module``, ``micro_steps``, ``is_gradient_accumulation_boundary()``; ``step()`` steps
    the optimizer at the boundary only)."""

    def __init__(self, module, optimizer, gas):
        super().__init__()
        self.module, self.optimizer, self.gas, self.micro_steps = module, optimizer, gas, 0

    def forward(self, x):
        return self.module(x)

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gas == 0

    def step(self):
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.micro_steps += 1


def engine_window(rank, world):
    """One process, an engine's accumulation window of 3 micro-batches, the check after every
    backward: window 1's second micro-batch has a NaN loss (a NaN input)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.05), gas=3)
    mon = gh.GradHealth(engine.module, engine.optimizer, on_problem="ignore")
    g = torch.Generator().manual_seed(100)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    reports = []
    for micro in range(6):
        x = torch.randn(16, 8, generator=g)
        if micro == 4:
            x[0, 0] = float("nan")
        loss = nn.functional.mse_loss(engine(x), x @ w) / 3
        loss.backward()
        r = mon.check(loss)
        reports.append(None if r is None else {"step": r.step, **_report(r),
                                               "messages": [f.message for f in r.findings]})
        engine.step()
    mon.close()
    return {"reports": reports}


SCENARIOS["engine_window"] = engine_window
