"""Workers (spawned gloo ranks) for where the replicas are reduced, per optimizer: modded-nanogpt's
loop (Adam's gradients all-reduced by hand before the step, Muon reducing inside its own step) and
TrainCheck's jxmnop loop (the bare module on even steps, a fresh DDP(model) on odd ones)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradhealth as gh

from dist_workers import _report
from replica_workers import _gather_params


def zeropower_via_newtonschulz5(G, steps=5):
    """modded-nanogpt's Newton-Schulz orthogonalisation (in float32 here: the CPU)."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.float()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


class Muon(torch.optim.Optimizer):
    """modded-nanogpt's Muon, its distributed step reduced to its essence: the gradients are
    averaged across the ranks inside ``step()``, then the momentum, the orthogonalised update."""

    def __init__(self, params, lr=0.02, momentum=0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        world = dist.get_world_size()
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                dist.all_reduce(g, op=dist.ReduceOp.SUM)
                g /= world
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - group["momentum"])
                g = g.lerp_(buf, group["momentum"])
                p.add_(zeropower_via_newtonschulz5(g).type_as(p), alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)


class TinyGPT(nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in range(2)])
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.lm_head(x)


def nanogpt(rank, world, case="ok", one=False):
    """modded-nanogpt's step: backward, Adam's gradients (embed, lm_head) all-reduced by hand,
    every optimizer stepped (Muon reduces its own inside), zero_grad. ``case="head"``: lm_head left
    out of the manual all-reduce. ``one``: one optimizer (:class:`HandAndInside`) whose two param
    groups are reduced in those two places."""
    torch.manual_seed(0)
    model = TinyGPT()
    adam_params = [model.embed.weight, model.lm_head.weight]
    if one:
        optimizers = [HandAndInside([{"params": adam_params}, {"params": [b.weight for b in model.blocks],
                                                                "reduce": True}], lr=0.5)]
    else:
        optimizers = [torch.optim.Adam(adam_params, lr=1e-2, betas=(0.8, 0.95), eps=1e-10),
                      Muon([b.weight for b in model.blocks], lr=0.02, momentum=0.95)]
    mon = gh.GradHealth(model, optimizers, on_problem="raise" if case == "ok" else "ignore")
    g = torch.Generator().manual_seed(100 + rank)
    reports, losses = [], []
    for step in range(10 if case == "ok" else 4):
        idx = (torch.randint(0, 32, (8, 1), generator=g) + torch.arange(9)) % 32
        loss = nn.functional.cross_entropy(model(idx[:, :-1]).reshape(-1, 32), idx[:, 1:].reshape(-1))
        loss.backward()
        for p in adam_params:
            if case == "head" and p is model.lm_head.weight:
                continue
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world
        reports.append(_report(mon.check(loss)))
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    mon.close()
    return {"reports": reports, "losses": losses, "same": _gather_params(model)}


def jxmnop(rank, world):
    """TrainCheck's jxmnop loop: the bare module on even steps, a fresh DDP(model) on odd ones (its
    construction broadcasts rank 0's parameters), the monitor on the module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = gh.GradHealth(model, opt, on_problem="ignore")
    g = torch.Generator().manual_seed(100 + rank)
    reports, drift = [], []
    for step in range(4):
        net = model if step % 2 == 0 else DDP(model)
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
        loss.backward()
        reports.append(_report(mon.check(loss)))
        opt.step()
        opt.zero_grad()
        drift.append(not _gather_params(model))  # the premise: the replicas differ after the bare steps
    mon.close()
    return {"reports": reports, "drift": drift}


class HandAndInside(torch.optim.Optimizer):
    """One optimizer, two kinds of param group (nanochat's and modded-nanogpt's hybrids hold both in
    one object): a group marked ``reduce=True`` has its gradients averaged across the ranks inside
    ``step()``; the others were reduced by hand before the step. SGD updates either way."""

    def __init__(self, groups, lr=0.05):
        super().__init__(groups, dict(lr=lr, reduce=False))

    @torch.no_grad()
    def step(self):
        world = dist.get_world_size()
        for group in self.param_groups:
            for p in group["params"]:
                if group["reduce"]:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                    p.grad /= world
                p.add_(p.grad, alpha=-group["lr"])

def modded_nanogpt(rank, world, case="ok"):
    """modded-nanogpt's loop on its GPT (tests/moddednanogpt_port.py): backward, Adam's gradients
    all-reduced by hand, the check, Adam's and Muon's steps (Muon reduces inside its own), zero_grad.
    ``head``: lm_head left out of the hand all-reduce. At check 0 the zero-initialised lm_head and
    projections leave every gradient but lm_head's exactly zero: Adam's only evidence is lm_head."""
    import moddednanogpt_port as port

    torch.manual_seed(0)
    model = port.GPT()
    adam, muon = port.optimizers(model)
    hand = [p for g in adam.param_groups for p in g["params"] if not (case == "head" and p is model.lm_head.weight)]
    mon = gh.GradHealth(model, [adam, muon], on_problem="raise" if case == "ok" else "ignore")
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    reports, losses, premise = [], [], {}
    for step in range(6 if case == "ok" else 3):
        idx = (torch.randint(0, port.VOCAB, (4, 1), generator=g) + 3 * torch.arange(port.SEQ + 1)) % port.VOCAB
        loss = model(idx[:, :-1], idx[:, 1:])  # (a sequence the model can learn: every token 3 after the last)
        loss.backward()
        if step == 0:  # the premise: only lm_head's gradient is non-zero, and it differs between the ranks
            premise["nonzero_at_0"] = sorted(n for n, p in model.named_parameters() if p.grad is not None and p.grad.any())
            premise["head_norm_at_0"] = float(model.lm_head.weight.grad.norm())
        for p in hand:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world
        if step == 0:
            norms = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(norms, model.lm_head.weight.grad.norm().reshape(1))
            premise["head_differs_at_0"] = bool(norms[0] != norms[1])
        try:
            reports.append(_report(mon.check(loss)))
        except gh.GradHealthError as exc:
            reports.append({"raised_at": step, **_report(exc.report)})
            break
        adam.step()
        muon.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    mon.close()
    return {"reports": reports, "losses": losses, "same": _gather_params(model), **premise}


SCENARIOS = {
    "modded_nanogpt_ok": modded_nanogpt,
    "modded_nanogpt_head": lambda r, w: modded_nanogpt(r, w, "head"),
    "nanogpt_two_places_ok": nanogpt,
    "nanogpt_two_places_head": lambda r, w: nanogpt(r, w, "head"),
    "jxmnop_alternating_ddp": jxmnop,
    "one_optimizer_two_places_ok": lambda r, w: nanogpt(r, w, one=True),
    "one_optimizer_two_places_head": lambda r, w: nanogpt(r, w, "head", one=True),
}
