"""Workers for 2-D meshes (spawned gloo ranks): HSDP, tensor parallel, FSDP2 + TP as torchtitan's
``parallelize.py`` applies them to a tiny Llama-style block, each against the unsharded model."""

import math

import torch
import torch.distributed as dist
from torch import nn

import gradhealth as gh


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.head_dim = d // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its own heads (torchtitan's reshape)
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False), nn.Linear(d, hidden, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d=16, heads=4, hidden=32):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(d), Attention(d, heads)
        self.ffn_norm, self.feed_forward = RMSNorm(d), FeedForward(d, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Model(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.ModuleList([Block(d), Block(d)])
        self.out = nn.Linear(d, 1, bias=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


#: torchtitan's plan for a block: q/k/v and w1/w3 column-wise, wo and w2 row-wise, norms replicated
def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()}


def batches(group: int, step: int, groups: int):
    """The batch of data-parallel group ``group`` at ``step`` (the same on its TP ranks), and the
    concatenation of every group's (the unsharded reference's batch)."""
    def one(g):
        gen = torch.Generator().manual_seed(1000 * step + g)
        return torch.randn(2, 6, 16, generator=gen), torch.randn(2, 6, 1, generator=gen)

    every = [one(g) for g in range(groups)]
    return every[group], (torch.cat([x for x, _ in every]), torch.cat([y for _, y in every]))


def reference(_: int, groups: int, lr: float, steps: int):
    """The unsharded model in this process: per step, the grad norms, the total, and update norms."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for s in range(steps):
        _, (x, y) = batches(0, s, groups)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        grads = {n: p.grad.double().norm().item() for n, p in model.named_parameters()}
        opt.step()
        # plain SGD's step is lr * g: in float64 (θ's float32 rounding of it, up to half an ulp of θ per
        # element, is not the monitor's to reproduce)
        upd = {n: lr * v for n, v in grads.items()}
        out.append({"grad": grads, "total": math.sqrt(sum(v * v for v in grads.values())), "update": upd})
    return out


def run_mesh(rank, world, layout, case="healthy"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    lr, steps = 0.05, 3
    torch.manual_seed(0)
    model = Model()
    if layout in ("hsdp", "hsdp22"):  # (replicate=2, shard=1 or 2); each replica its own batch on (2, 2)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        group, groups = (0, 1) if layout == "hsdp" else (mesh["replicate"].get_local_rank(), 2)
    elif layout == "tp":  # one TP group of 2: the same batch on both
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for block in model.layers:
            parallelize_module(block, mesh, tp_plan())
        group, groups = 0, 1
    else:  # "fsdp_tp": (dp=2, tp=2), torchtitan's order: TP inside, then FSDP over dp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.layers:
            parallelize_module(block, mesh["tp"], tp_plan())
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        group, groups = mesh["dp"].get_local_rank(), 2
    if case == "frozen":
        model.layers[0].attention.wq.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    mon = gh.GradHealth(model, opt, on_problem="raise" if case == "healthy" else "ignore", update_every=1,
                        desync_every=1 if case == "drifted" else 100,
                        expect_frozen=[] if case == "frozen" else None)
    got, kept, ref = [], [], reference(0, groups, lr, steps) if case == "healthy" else None
    for s in range(steps):
        (x, y), _ = batches(group, s, groups)
        if case == "nan" and s == 1 and group == 1:
            x = x.clone()
            x[0, 0, 0] = math.nan  # one data-parallel group's batch
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if case == "damaged" and s == 1 and rank == 3:  # one replica's shard of one gradient, 1% off
            with torch.no_grad():
                model.layers[1].feed_forward.w2.weight.grad.to_local().mul_(1.01)
        if case == "drifted" and s == 1 and rank == 3:  # one replica's shard of one parameter moved
            with torch.no_grad():
                model.layers[0].ffn_norm.weight.to_local().add_(1e-3)
        r = mon.check(loss)
        kept.append(r)
        clip = None
        if layout != "tp":  # (pure TP leaves the norms plain tensors: torch's clip refuses the mix)
            # torch's own total over the DTensor gradients, one mesh at a time (FSDP2 + TP puts the
            # TP-sharded weights on the 2-D mesh and the norm weights on the dp mesh)
            by_mesh: dict = {}
            for p in model.parameters():
                if p.grad is not None:
                    by_mesh.setdefault(id(p.grad.device_mesh), []).append(p.grad)
            clip = math.sqrt(sum(float(torch.nn.utils.get_total_norm(g).full_tensor()) ** 2 for g in by_mesh.values()))
        opt.step()
        got.append({"grad": r.grad_norm, "total": r.total_grad_norm, "clip": clip, "ok": r.ok,
                    "status": {n: v.value for n, v in r.status.items()},
                    "findings": [[f.kind, list(f.params), f.level, f.data.get("ranks")] for f in r.findings]})
    mon.close()  # (delivers the last step's update norms into its report)
    return {"got": got, "ref": ref, "updates": [dict(r.update_norm) for r in kept]}


SCENARIOS = {f"mesh_{layout}_{case}": (lambda layout, case: lambda r, w: run_mesh(r, w, layout, case))(layout, case)
             for layout in ("hsdp", "hsdp22", "tp", "fsdp_tp") for case in ("healthy", "frozen", "nan", "damaged", "drifted")}


def partial_grad(rank, world):
    """A DTensor parameter whose gradient is still Partial (a pending sum): its norm is the sum's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
    locals_ = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    model.weight.grad = DTensor.from_local(locals_[rank], mesh, [Partial()])
    mon = gh.GradHealth(model, on_problem="raise")
    r = mon.check()
    mon.close()
    return {"got": r.grad_norm["weight"], "want": sum(locals_).double().norm().item(),
            "local": locals_[rank].double().norm().item()}


SCENARIOS["partial_grad"] = partial_grad


class Experts(nn.Module):
    """Stacked experts as transformers 5 stores them: one [E, d, d] tensor, tokens routed by argmax;
    expert 3 never gets a token (dead)."""

    num_experts = 4

    def __init__(self, d=8):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(self.num_experts, d, d) * 0.3)

    def forward(self, x, route):
        return torch.einsum("td,tde->te", x, self.weight[route])


class MoE(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.router = nn.Linear(d, 3, bias=False)  # only experts 0-2 can be chosen
        self.experts = Experts(d)

    def forward(self, x):
        return self.experts(x, self.router(x).argmax(-1))


def moe(rank, world, how):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model, ref = MoE(), MoE()
    ref.load_state_dict(model.state_dict())
    xs = [torch.randn(32, 8, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    # the reference: the mean of the ranks' losses, in one process
    sum(ref(x).square().mean() for x in xs).div(world).backward()
    want = [ref.experts.weight.grad[e].double().norm().item() for e in range(4)]
    if how == "fsdp2":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        trained = model
    else:
        trained = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)  # (the router gets none)
    mon = gh.GradHealth(trained, on_problem="ignore", grad_patience=100)
    trained(xs[rank]).square().mean().backward()
    r = mon.check()
    mon.close()
    return {"got": [r.expert_grad_norm.get(f"experts[{e}]") for e in range(4)], "want": want,
            "status": {k: v.value for k, v in r.expert_status.items()}}


SCENARIOS["moe_fsdp2"] = lambda r, w: moe(r, w, "fsdp2")
SCENARIOS["moe_ddp"] = lambda r, w: moe(r, w, "ddp")
