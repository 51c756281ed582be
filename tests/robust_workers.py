"""Two gloo ranks under DDP with a failure injected into each DDP hook the monitor owns (spawned by
tests/test_robust_hooks.py: the worker must live in an importable module)."""

import gc
import json
import os
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

import gradhealth as gh
from gradhealth.ranks.ddp import RankOrigin, Ranks


def _boom(*args, **kwargs):
    raise RuntimeError("injected failure")


def run(rank, world, port, out):
    gc.freeze()  # (what the fork server imported: out of the collector's sight, as in tests/dist_workers.py)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        torch.set_num_threads(1)
        # every DDP hook of the monitor fails: the comm hook's norms, the DDP forward hooks
        RankOrigin._note = _boom
        RankOrigin._forward = _boom
        Ranks._forward = _boom
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
        losses, oks = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mon = gh.GradHealth(ddp, opt, on_problem="raise", change_every=1)
            for _ in range(5):
                opt.zero_grad()
                loss = (ddp(x) - y).pow(2).mean()
                loss.backward()
                oks.append(mon.check(loss=loss).ok)
                opt.step()
                losses.append(loss.item())
            mon.close()
        said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthInternalWarning)
                and "injected" in str(w.message)]
        payload = {"losses": losses, "oks": oks, "said": said}
    except BaseException:
        payload = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(payload, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)
