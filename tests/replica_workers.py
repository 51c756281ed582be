"""Workers for the distributed idioms (spawned gloo ranks): gradients reduced inside the optimizer
(nanochat / modded-nanogpt style, no DDP wrapper), a hand-made all-reduce that misses one gradient,
and nanoGPT's require_backward_grad_sync with a bug on one rank."""

import torch
import torch.distributed as dist
from torch import nn

import gradhealth as gh

from dist_workers import _report


class ReducingAdamW(torch.optim.AdamW):
    """An optimizer that averages the gradients across ranks inside ``step()`` (what ZeRO-style
    optimizers do, reduce-scatter or all-reduce, before their update). ``skip``: a parameter this
    rank leaves out of the reduction from step ``skip_from`` on (the planted drift)."""

    def __init__(self, params, skip=None, skip_from=0, **kw):
        super().__init__(params, **kw)
        self.skip, self.skip_from, self.count = skip, skip_from, 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p is self.skip and self.count >= self.skip_from:
                    # this rank reduces a copy and steps on its own gradient for that parameter
                    # (the collective still runs: the ranks stay matched)
                    dist.all_reduce(p.grad.clone(), op=dist.ReduceOp.SUM)
                    continue
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= dist.get_world_size()
        self.count += 1
        return super().step(closure)


def _gather_params(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out)


def in_optimizer(rank, world, case):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    planted = case == "drift" and rank == 1
    opt = ReducingAdamW(model.parameters(), lr=2e-2, skip=model[2].weight if planted else None, skip_from=3)
    options = {"on_problem": "ignore" if case == "drift" else "raise"}
    if case == "explicit":
        options["grad_sync"] = "in_optimizer"
    mon = gh.GradHealth(model, opt, **options)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    reports, losses = [], []
    for step in range(20):
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x @ w)
        loss.backward()
        reports.append(_report(mon.check(loss)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    mon.close()
    return {"reports": reports, "losses": losses, "same": _gather_params(model)}


def manual(rank, world, missing=None):
    """A hand-made data-parallel all-reduce before the check; ``missing``: the one gradient it
    forgets (GRAD_DISAGREE names it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gh.GradHealth(model, opt, on_problem="ignore" if missing else "raise")
    g = torch.Generator().manual_seed(rank + 1)
    reports, losses = [], []
    for _ in range(8 if missing is None else 3):
        opt.zero_grad()
        x = torch.randn(16, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        for name, p in model.named_parameters():
            if name != missing:
                dist.all_reduce(p.grad)
                p.grad /= world
        reports.append(_report(mon.check(loss)))
        opt.step()
        losses.append(loss.item())
    return {"reports": reports, "losses": losses, "same": _gather_params(model)}


def nanogpt_sync(rank, world, case):
    """nanoGPT's accumulation under DDP: require_backward_grad_sync only at the last micro-step;
    ``bug``: rank 1 leaves it False at iteration 3 (it steps on its own gradients)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    mon = gh.GradHealth(model, opt, ddp_model=ddp, on_problem="raise")  # (the bug: both ranks stop together)
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    accum, reports, losses = 2, [], []
    for it in range(8):
        for micro_step in range(accum):
            last = micro_step == accum - 1
            ddp.require_backward_grad_sync = last and not (case == "bug" and rank == 1 and it == 3)
            x = torch.randn(16, 8, generator=g)
            loss = nn.functional.mse_loss(ddp(x), x @ w) / accum
            loss.backward()
        try:
            r = mon.check(loss)
        except gh.GradHealthError as exc:
            reports.append({"raised_at": it, **_report(exc.report)})
            break
        reports.append(None if r is None else {"step": r.step, **_report(r)})
        if not (case == "skip_step" and rank == 1 and it == 3):  # a rank-dependent branch around the step
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    mon.close()
    return {"reports": reports, "losses": losses}


def skipped_check(rank, world, case, idiom="ddp", on_problem="raise", every_n=1, scaler=False):
    """A plain loop that calls check() after every backward, but on ``case``'s ranks not at
    iteration 5 (a rank-dependent branch around the call): ``rank1`` skips it on rank 1 only,
    ``every`` on both ranks, ``none`` nowhere. ``idiom``: DDP, or the gradients reduced inside the
    optimizer (no wrapper)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if idiom == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    else:
        net, opt = model, ReducingAdamW(model.parameters(), lr=2e-2)
    # ``scaler``: a grad scaler whose first scale overflows (2**127 times a gradient above 2 is inf):
    # it skips optimizer.step() at the first iterations while its scale settles, as fp16 AMP does
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127) if scaler else None
    mon = gh.GradHealth(net, opt, on_problem=on_problem, every_n_steps=every_n, scaler=amp)
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    reports, losses, called, skipped, ran = {}, [], [], [], []
    opt.register_step_post_hook(lambda *_: ran.append(1))
    for it in range(16):
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(net(x), x @ w)
        (loss if amp is None else amp.scale(loss)).backward()
        skip = it == 5 and (case == "every" or (case == "rank1" and rank == 1))
        try:
            if not skip:
                called.append(it)
                r = mon.check(loss)
                if r is not None:
                    reports[it] = _report(r)
            before, steps = mon.last_report, len(ran)
            if amp is None:
                opt.step()
            else:
                amp.step(opt)
                amp.update()
                skipped.append(len(ran) == steps)  # the scaler did not call optimizer.step()
            if mon.last_report is not before:  # a check joined from the step
                reports[it] = {"from_step": True, **_report(mon.last_report)}
        except gh.GradHealthError as exc:
            reports[it] = {"raised_at": it, "in_step": skip, **_report(exc.report)}
            break
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    mon.close()
    same = _gather_params(model) if "raised_at" not in reports.get(5, {}) else None
    return {"reports": {str(k): v for k, v in reports.items()}, "losses": losses, "same": same, "called": called,
            "scaler_skipped": skipped}


def huge_finite(rank, world):
    """DDP gradients that are all finite but so large that their float32 2-norm overflows (each
    element about 1e25: its square is past float32's 3.4e38): one check, under raise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    net = nn.parallel.DistributedDataParallel(model)
    mon = gh.GradHealth(net, torch.optim.SGD(model.parameters(), lr=0.0), on_problem="raise")
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + rank))
    (net(x).square().mean() * 1e25).backward()
    premise = {"finite": all(bool(p.grad.isfinite().all()) for p in model.parameters()),
               "norm_overflows": any(torch.linalg.vector_norm(p.grad).isinf().item() for p in model.parameters())}
    report = _report(mon.check())
    mon.close()
    return {"report": report, **premise}


def nanochat(rank, world, case="ok"):
    """nanochat's base_train loop on its GPT (tests/nanochat_port.py): zero-initialised projections,
    scalar gains, per-group learning rates with a warmdown multiplier, gradient accumulation, the
    gradients reduced inside the optimizer (no DDP wrapper), ``model.zero_grad(set_to_none=True)``.
    ``drift``: rank 1's optimizer leaves ``lm_head.weight`` out of its reduction from step 3 on."""
    from nanochat_port import GPT, Config

    torch.manual_seed(0)
    config = Config()
    model = GPT(config)
    model.init_weights()
    blocks = [p for p in model.transformer.h.parameters()]
    embeds = [model.transformer.wte.weight, *model.value_embeds.parameters()]
    groups = [dict(params=blocks, lr=0.02), dict(params=embeds, lr=0.2), dict(params=[model.lm_head.weight], lr=0.004),
              dict(params=[model.resid_lambdas], lr=0.005), dict(params=[model.x0_lambdas], lr=0.5),
              dict(params=[model.smear_gate.weight, model.smear_lambda, model.backout_lambda], lr=0.2)]
    skip = model.lm_head.weight if case == "drift" and rank == 1 else None
    optimizer = ReducingAdamW(groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0, skip=skip, skip_from=3)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    mon = gh.GradHealth(model, optimizer, on_problem="raise" if case == "ok" else "ignore")
    premise = {"zero_at_0": None}
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    num_iterations, grad_accum_steps, reports, losses = 20, 2, [], []
    for step in range(num_iterations):
        for micro_step in range(grad_accum_steps):
            x = torch.randint(0, config.vocab_size, (4, config.sequence_len), generator=g)
            y = (x * 5 + 3) % config.vocab_size  # a bigram language the model can learn
            loss = model(x, y)
            loss = loss / grad_accum_steps
            loss.backward()
        if step == 0:  # the premise: zero projections leave exactly-zero gradients behind them
            premise["zero_at_0"] = sorted(n for n, p in model.named_parameters() if p.grad is not None and not p.grad.any())
        try:
            reports.append(_report(mon.check(loss)))
        except gh.GradHealthError as exc:
            reports.append({"raised_at": step, **_report(exc.report)})
            break
        lrm = 1.0 if step < num_iterations // 2 else (num_iterations - step) / (num_iterations - num_iterations // 2)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
        optimizer.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item() * grad_accum_steps)
    mon.close()
    return {"reports": reports, "losses": losses, "same": _gather_params(model), **premise}


def ddp_bypassed(rank, world, case="module"):
    """TrainCheck's silent bug: DDP is built, but the loop's forward calls ``ddp.module(x)``, so
    the wrapper's hooks never fire and every rank steps on its own gradients. ``module``: the
    monitor is given the module (as with Accelerate's recipe); ``none``: there is no DDP at all
    (a data-parallel loop that never reduces): the reduction looks still to come, and the
    parameters' drift after the first step is what names it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    mon = gh.GradHealth(model, opt, on_problem="ignore") if case != "module" else None
    ddp = nn.parallel.DistributedDataParallel(model) if case != "none" else None
    mon = mon or gh.GradHealth(model, opt, on_problem="ignore")
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    reports = []
    for _ in range(4):
        x = torch.randn(16, 8, generator=g)
        out = ddp.module(x) if ddp is not None else model(x)
        loss = nn.functional.mse_loss(out, x @ w)
        loss.backward()
        reports.append(_report(mon.check(loss)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    mon.close()
    return {"reports": reports, "same": _gather_params(model)}


SCENARIOS = {
    "nanochat_ok": nanochat,
    "nanochat_drift": lambda r, w: nanochat(r, w, "drift"),
    "ddp_bypassed_module": ddp_bypassed,
    "ddp_bypassed_none": lambda r, w: ddp_bypassed(r, w, "none"),
    "ddp_bypassed_before": lambda r, w: ddp_bypassed(r, w, "before"),
    **{f"skipped_check_{c}_{i}": (lambda c, i: lambda r, w: skipped_check(r, w, c, i))(c, i)
       for c in ("rank1", "every", "none") for i in ("ddp", "in_optimizer")},
    "skipped_check_rank1_warn": lambda r, w: skipped_check(r, w, "rank1", on_problem="warn"),
    "skipped_check_rank1_gated": lambda r, w: skipped_check(r, w, "rank1", every_n=2),
    **{f"skipped_check_{c}_amp": (lambda c: lambda r, w: skipped_check(r, w, c, scaler=True))(c) for c in ("none", "rank1")},
    "huge_finite": huge_finite,
    "in_optimizer_auto": lambda r, w: in_optimizer(r, w, "auto"),
    "in_optimizer_explicit": lambda r, w: in_optimizer(r, w, "explicit"),
    "in_optimizer_drift": lambda r, w: in_optimizer(r, w, "drift"),
    "manual_missing": lambda r, w: manual(r, w, "2.bias"),
    "manual_ok": manual,
    "nanogpt_ok": lambda r, w: nanogpt_sync(r, w, "ok"),
    "nanogpt_bug": lambda r, w: nanogpt_sync(r, w, "bug"),
    "nanogpt_skip_step": lambda r, w: nanogpt_sync(r, w, "skip_step"),
}


from reduce_workers import SCENARIOS as _PER_OPTIMIZER  # noqa: E402  (modded-nanogpt's two places, jxmnop's loop)

SCENARIOS.update(_PER_OPTIMIZER)
