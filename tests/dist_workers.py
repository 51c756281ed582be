"""Worker functions for the multi-process tests (spawned: they must live in an importable module)."""

import gc
import json
import math
import os
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

import gradhealth as gh


def _init(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _dump(out, rank, payload):
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(payload, f)


def _report(r):
    return {"status": {k: v.value for k, v in r.status.items()}, "grad_norm": r.grad_norm, "total": r.total_grad_norm,
            "findings": [[f.kind, list(f.params), f.level, f.data.get("ranks"), f.data.get("ranks_without")] for f in r.findings],
            "ok": r.ok}


class Partly(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b):
        y = self.a(x)
        if use_b:
            y = y + self.b(x)
        return y  # c is never used


def run(rank, world, port, out, scenario):
    # What the fork server imported is never garbage: out of the collector's sight (its passes and
    # gc.get_referrers, which the monitor's wrapper lookup calls, walk only what this rank makes).
    gc.freeze()
    try:
        _init(rank, world, port)
        warnings.simplefilter("ignore")
        if scenario in SCENARIOS:
            payload = SCENARIOS[scenario](rank, world)
        else:  # the distributed idioms' and the 2-D meshes' workers
            import accum_workers
            import clip_workers
            import mesh_workers
            import replica_workers

            payload = {**replica_workers.SCENARIOS, **mesh_workers.SCENARIOS, **clip_workers.SCENARIOS,
                       **accum_workers.SCENARIOS}[scenario](rank, world)
        _dump(out, rank, payload)
    except BaseException:
        _dump(out, rank, {"error": traceback.format_exc()})
        raise
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    # The results are on disk and the group is gone: leave now. A normal interpreter exit can abort
    # ("terminate called without an active exception") while C++ threads of gloo/FSDP are torn down.
    os._exit(0)


def s_verdict(rank, world):
    torch.manual_seed(0)
    model = Partly()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = gh.GradHealth(ddp, opt, on_problem="ignore")
    torch.manual_seed(rank + 1)
    reports = []
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(3, 4), use_b=(rank == 0)).sum().backward()
        reports.append(_report(mon.check()))
        opt.step()
    mon.close()
    return {"reports": reports}


def s_nan_rank1(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = gh.GradHealth(ddp, opt, on_problem="ignore")
    x = torch.randn(3, 4)
    if rank == 1:
        x[0, 0] = float("nan")
    ddp(x).sum().backward()
    r = mon.check()
    return {"report": _report(r)}


def s_desync(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore", desync_every=3)
    reports = []
    for step in range(4):
        if step == 2 and rank == 1:
            with torch.no_grad():
                model[1].bias += 1.0  # changed on one rank only
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        for p in model.parameters():  # a hand-made data-parallel all-reduce
            dist.all_reduce(p.grad)
        reports.append(_report(mon.check()))
        opt.step()
    return {"reports": reports}


def s_raise(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = gh.GradHealth(ddp, opt, on_problem="raise")
    if rank == 1:
        model[1].eval()  # a local mistake on one rank only
    ddp(torch.randn(3, 4)).sum().backward()
    try:
        mon.check()
    except gh.GradHealthError as exc:
        return {"raised": True, "message": str(exc)}
    return {"raised": False}


def s_no_sync(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = gh.GradHealth(ddp, opt, on_problem="ignore")
    got = []
    opt.zero_grad()
    with ddp.no_sync():
        for _ in range(2):
            ddp(torch.randn(2, 4)).sum().backward()
            got.append(mon.check())
    ddp(torch.randn(2, 4)).sum().backward()
    got.append(mon.check())
    opt.step()
    return {"deferred": [g is None for g in got], "final_ok": got[-1].ok, "findings": [f.kind for f in got[-1].findings]}


def s_sharded(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))

    def batch(r):
        g = torch.Generator().manual_seed(100 + r)
        return torch.randn(5, 4, generator=g)

    def loss_fn(m, x):
        return m(x).square().mean()

    # reference: the unsharded model, gradients averaged over the ranks' batches
    ref = build()
    for r in range(world):
        (loss_fn(ref, batch(r)) / world).backward()
    ref_norms = {n: p.grad.double().norm().item() for n, p in ref.named_parameters()}
    ref_total = sum(v * v for v in ref_norms.values()) ** 0.5

    model = build()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="ignore", deltas="exact")
    loss_fn(model, batch(rank)).backward()
    r = mon.check()
    opt.step()
    opt.zero_grad()
    loss_fn(model, batch(rank)).backward()
    mon.check()  # carries the first step's update norms, reduced over the shards
    update = dict(r.update_norm)
    # a gradient that is zero on rank 0's shard and not on rank 1's, and a NaN in one shard only
    for p in model.parameters():
        p.grad = None
    w = model[2].weight  # 8 rows, 4 per rank
    local = torch.zeros_like(w.to_local())
    if rank == 1:
        local[0, 0] = 1.0
    from torch.distributed.tensor import DTensor

    w.grad = DTensor.from_local(local, w.device_mesh, w.placements)
    b = model[2].bias
    lb = torch.zeros_like(b.to_local())
    if rank == 0:
        lb[0] = float("nan")
    b.grad = DTensor.from_local(lb, b.device_mesh, b.placements)
    r2 = mon.check()
    mon.close()
    return {"grad_norm": r.grad_norm, "total": r.total_grad_norm, "ref": ref_norms, "ref_total": ref_total, "update": update,
            "lr_times_grad": {n: 0.1 * v for n, v in ref_norms.items()},
            "status": {k: v.value for k, v in r.status.items()}, "status2": {k: v.value for k, v in r2.status.items()}}


def s_fsdp1(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    import copy

    ref = copy.deepcopy(model)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    for x in xs:
        (ref(x).square().mean() / world).backward()
    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    fsdp(xs[rank]).square().mean().backward()
    r = gh.GradHealth(fsdp, on_problem="ignore").check()
    return {"grad_norm": r.grad_norm, "ref": {n: p.grad.double().norm().item() for n, p in ref.named_parameters()},
            "status": {k: v.value for k, v in r.status.items()}}


def s_local_failure(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ddp = nn.parallel.DistributedDataParallel(model)
    mon = gh.GradHealth(ddp, on_problem="warn")
    if rank == 1:
        from gradhealth.measure import stats

        def broken(*a, **k):
            raise RuntimeError("planted failure")

        stats.Launched.read = broken  # this rank's check breaks before the collective
    ddp(torch.randn(2, 4)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = mon.check()
    said = [str(w.message) for w in caught]
    ddp(torch.randn(2, 4)).sum().backward()  # training goes on: the next collective is DDP's own
    return {"report": r is not None, "said": said}


def _replicas(rank, world, case):
    """Replicas that stop agreeing (and their fixed versions): 3 checks of a small DDP model."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    if case == "roundtrip_fixed":
        model.double().float()  # before wrapping: fine
    ddp = nn.parallel.DistributedDataParallel(model)
    if case == "roundtrip":
        model.double().float()  # after wrapping: DDP's hooks stay on the old tensors (pytorch#104336 on CPU)
    healthy = case.endswith("_fixed")
    options = {"on_problem": "raise" if healthy else "ignore"}
    if case.startswith("bucket"):
        def hook(state, bucket):  # a faulty link: 1% of the bucket zeroed on the way to rank 1
            fut = allreduce_hook(None, bucket)
            if case == "bucket_fixed":
                return fut

            def damage(f):
                t = f.value()[0] if isinstance(f.value(), list) else f.value()
                if dist.get_rank() == 1:
                    t[: max(1, t.numel() // 100)] = 0.0
                return t

            return fut.then(damage)

        ddp.register_comm_hook(None, hook)
        options["rank_origin"] = False  # one comm hook per DDP model: the faulty one here
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mon = gh.GradHealth(ddp, opt, **options)
    if case == "nan_collective":
        plain = mon.ranks.origin._allreduce

        def faulty(state, bucket):  # the all-reduce itself hands rank 1 a NaN
            def poison(f):
                t = f.value()[0] if isinstance(f.value(), list) else f.value()
                if dist.get_rank() == 1:
                    t[0] = float("nan")
                return t

            return plain(state, bucket).then(poison)

        mon.ranks.origin._allreduce = faulty
    torch.manual_seed(rank + 1)
    reports, losses = [], []
    for step in range(3):
        x = torch.randn(8, 4)
        opt.zero_grad()
        out = model(x) if case == "around" and step == 0 else ddp(x)  # around its wrapper, once
        loss = (out - x.sum(1, keepdim=True)).square().mean()
        loss.backward()
        try:
            reports.append(_report(mon.check(loss=loss)))
        except gh.GradHealthError as e:
            reports.append({"raised": str(e)})
            break
        opt.step()
        losses.append(loss.item())
    mon.close()
    return {"reports": reports}


def s_healthy_replicas(rank, world):
    """find_unused_parameters=True with bf16 parameters, 6 steps under raise."""
    torch.manual_seed(0)
    model = Partly().to(torch.bfloat16)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mon = gh.GradHealth(ddp, opt, on_problem="raise", expect_frozen=None, grad_patience=100)
    torch.manual_seed(rank + 1)
    oks = []
    for step in range(6):
        opt.zero_grad()
        ddp(torch.randn(3, 4, dtype=torch.bfloat16), use_b=(rank == 0 or step % 2 == 0)).float().sum().backward()
        r = mon.check()
        oks.append([f.kind for f in r.findings if f.level == "error"] + [s.value for n, s in r.errors.items() if n[0] != "c"])
        opt.step()
    mon.close()
    return {"errors": oks}


def s_fsdp2_healthy(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = gh.GradHealth(model, opt, on_problem="raise")
    torch.manual_seed(rank + 1)
    oks, names = [], []
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        r = mon.check()
        oks.append(r.ok)
        names = list(r.status)
        opt.step()
    mon.close()
    return {"ok": oks, "names": names}


def s_skip_rank1(rank, world):
    """skip_nonfinite under DDP: only rank 1's batch at step 3 is NaN; every rank drops that step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    mon = gh.GradHealth(ddp, opt, on_problem="raise", skip_nonfinite=True)
    g = torch.Generator().manual_seed(10 + rank)
    skipped, finite = [], []
    for step in range(6):
        x = torch.randn(8, 4, generator=g)
        if step == 3 and rank == 1:
            x[0, 0] = float("nan")
        opt.zero_grad()
        (ddp(x) - x.sum(1, keepdim=True)).square().mean().backward()
        r = mon.check()
        f = r.findings_of("STEP_SKIPPED")
        skipped.append([f[0].step, f[0].data.get("ranks")] if f else None)
        opt.step()
        finite.append(all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    mon.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"skipped": skipped, "finite": finite, "params": flat.tolist(),
            "steps": [float(opt.state[p]["step"]) for p in model.parameters()]}


def s_deferred(rank, world):
    """The same DDP loop twice, synchronous then deferred (lag=1): NaN on rank 1 at step 3 with the
    step guard, a parameter left out of the optimizer. Each rank's reports, compared by the test."""
    out = {}
    for lag in (0, 1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(list(ddp.parameters())[:4], lr=1e-2, fused=True)

        class Keep:
            reports = []

            def write(self, report):
                self.reports.append(_report(report) | {"step": report.step, "updates": report.update_norm})

        keep = Keep()
        keep.reports = []
        mon = gh.GradHealth(ddp, opt, on_problem="ignore", lag=lag, sinks=[keep], skip_nonfinite=True, update_every=2)
        g = torch.Generator().manual_seed(rank)
        returned = []
        for step in range(6):
            x = torch.randn(8, 4, generator=g)
            if rank == 1 and step == 3:
                x[0, 0] = float("inf")
            ddp(x).pow(2).mean().backward()
            r = mon.check()
            returned.append(None if r is None else r.step)
            opt.step()
            opt.zero_grad()
        mon.close()
        out[str(lag)] = {"reports": keep.reports, "returned": returned}
    return out


def s_deferred_failure(rank, world):
    """Deferred checks (lag=1) under DDP whose work fails on rank 1 only: at check 1 while launching
    (the observation), at check 3 while completing (the numbers read back). Every rank skips those
    two checks together, no rank waits in a collective the other never joins, DDP trains on."""
    from gradhealth.measure import observe, stats

    launched, complete = stats.Launched.__init__, observe.Pending.complete
    calls = {"launch": 0, "complete": 0}

    def launch_once(self, *args, **kwargs):
        calls["launch"] += 1
        if rank == 1 and calls["launch"] == 2:
            raise RuntimeError("planted failure at launch")
        return launched(self, *args, **kwargs)

    def complete_once(self, values):
        calls["complete"] += 1
        if rank == 1 and calls["complete"] == 3:  # (checks 0, 2, 3: check 1 has nothing to complete)
            raise RuntimeError("planted failure at completion")
        return complete(self, values)

    stats.Launched.__init__, observe.Pending.complete = launch_once, complete_once
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    mon = gh.GradHealth(ddp, opt, on_problem="warn", lag=1)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(rank))
    returned, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            loss = (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean()
            loss.backward()
            r = mon.check(loss=loss)
            returned.append(None if r is None else [r.step, r.ok])
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        mon.flush()
        last = mon.last_report
        mon.close()
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthInternalWarning)]
    return {"returned": returned, "last": [last.step, last.ok], "said": said, "losses": losses}


def s_early_failure(rank, world):
    """A check whose bookkeeping fails on rank 1 before its numbers are gathered (the stale-gradient
    watch, at check 1), with measured updates pending: synchronous and deferred, every rank skips
    that check together and the others are judged."""
    from gradhealth.measure import stale

    take = stale.StaleWatch.take
    out = {}
    for lag in (0, 1):
        calls = {"n": 0}

        def planted(self, *args, **kwargs):
            calls["n"] += 1
            if rank == 1 and calls["n"] == 2:
                raise RuntimeError("planted early failure")
            return take(self, *args, **kwargs)

        stale.StaleWatch.take = planted
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        mon = gh.GradHealth(ddp, opt, on_problem="warn", lag=lag, update_every=1, change_every=1)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(rank))
        returned = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(4):
                (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
                r = mon.check()
                returned.append(None if r is None else [r.step, r.ok])
                opt.step()
                opt.zero_grad()
            mon.close()
        stale.StaleWatch.take = take
        said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthInternalWarning)]
        out[str(lag)] = {"returned": returned, "said": said, "last": [mon.last_report.step, mon.last_report.ok]}
    return out


def s_deferred_late_failure(rank, world):
    """lag=1 under DDP with the step guard and fused AdamW: rank 1's launch fails after its
    observation at check 1 (the gradient witnesses it stages), and its observation fails at check
    3, the step whose gradients are NaN on every rank (the batch on rank 0 holds one, DDP averages
    it). Rank 1 still joins both checks' collectives, flagged, and still hands its optimizer the
    guard's flag: the replicas stay identical and finite."""
    from gradhealth.check import deferred
    from gradhealth.measure import stats

    stage, launched = deferred.witnesses, stats.Launched.__init__
    calls = {"stage": 0, "launch": 0}

    def stage_once(*args, **kwargs):
        calls["stage"] += 1
        if rank == 1 and calls["stage"] == 2:
            raise RuntimeError("planted failure after the observation")
        return stage(*args, **kwargs)

    def launch_once(self, *args, **kwargs):
        calls["launch"] += 1
        if rank == 1 and calls["launch"] == 4:
            raise RuntimeError("planted failure at launch")
        return launched(self, *args, **kwargs)

    deferred.witnesses, stats.Launched.__init__ = stage_once, launch_once
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05, fused=True)
    mon = gh.GradHealth(ddp, opt, on_problem="ignore", lag=1, skip_nonfinite=True)
    returned = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            if step == 3 and rank == 0:
                x[0, 0] = math.nan
            (ddp(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
            r = mon.check()
            returned.append(None if r is None else r.step)
            opt.step()
            opt.zero_grad()
        mon.close()
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthInternalWarning)]
    return {"returned": returned, "said": said, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


SCENARIOS = {"deferred_late_failure": s_deferred_late_failure, "early_failure": s_early_failure, "deferred_failure": s_deferred_failure, "skip_rank1": s_skip_rank1, "healthy_replicas": s_healthy_replicas, "fsdp2_healthy": s_fsdp2_healthy,
             **{f"replicas_{c}": (lambda c: lambda rank, world: _replicas(rank, world, c))(c)
                for c in ("roundtrip", "roundtrip_fixed", "around", "around_fixed", "bucket", "bucket_fixed",
                          "nan_collective")},
"local_failure": s_local_failure, "fsdp1": s_fsdp1, "verdict": s_verdict, "nan_rank1": s_nan_rank1, "desync": s_desync, "raise": s_raise,
             "no_sync": s_no_sync, "sharded": s_sharded, "deferred": s_deferred}
