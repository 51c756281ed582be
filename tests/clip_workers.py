"""Workers for the shared clip on gloo ranks: FSDP2 (a 1-D mesh) and DDP, each rank its own batch;
the monitored model clipped by ``monitor.clip_grad_norm_`` against a twin clipped by torch's
``clip_grad_norm_`` (over DTensors under FSDP2: the global total)."""

import torch
import torch.distributed as dist
from torch import nn

import gradhealth as gh


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(rank, world, layout, max_norm=0.05):
    ours, twin = _net(), _net()
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for net in (ours, twin):
            for layer in (net[0], net[2], net[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
        run_ours, run_twin = ours, twin
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        run_ours, run_twin = DDP(ours), DDP(twin)
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in (ours, twin)]
    mon = gh.GradHealth(run_ours, opts[0], on_problem="raise")
    from gradhealth.check.clip import arm

    arm(mon)  # (the first clip shared too, as the adapters do)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank + 1))  # each rank its own batch
    out = {"totals": [], "twin_totals": [], "grad_gap": [], "coef": [], "losses": []}
    for _ in range(4):
        for o in opts:
            o.zero_grad()
        loss = run_ours(x).square().mean()
        loss.backward()
        run_twin(x).square().mean().backward()
        mon.check(loss=loss)
        total = mon.clip_grad_norm_(max_norm)
        twin_total = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
        out["totals"].append(float(_full(total)))
        out["twin_totals"].append(float(_full(twin_total)))
        out["coef"].append(mon.last_report.clip_coef)
        out["grad_gap"].append(max(float(((_full(p.grad) - _full(q.grad)).abs().max()) / _full(q.grad).abs().max())
                                   for p, q in zip(ours.parameters(), twin.parameters())))
        out["losses"].append(float(loss))
        for o in opts:
            o.step()
    out["param_gap"] = max(float((_full(p) - _full(q)).abs().max()) for p, q in zip(ours.parameters(), twin.parameters()))
    mon.close()
    dist.barrier()
    return out


SCENARIOS = {"clip_fsdp2": lambda r, w: _run(r, w, "fsdp2"), "clip_ddp": lambda r, w: _run(r, w, "ddp")}
