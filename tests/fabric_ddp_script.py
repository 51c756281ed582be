"""Fabric's DDP on 2 CPU processes, launched as its users launch it: ``python fabric_ddp_script.py
ddp OUT`` (``fabric.launch()`` runs this script again for rank 1) or ``ddp_spawn OUT``
(``fabric.launch(fn)`` spawns). Each rank writes OUT/<launch>-<rank>.json with one entry per case."""

import json
import os
import sys
import traceback
import warnings

import lightning as L
import torch
from torch import nn

import gradhealth as gh

ACCUM, ITERS = 2, 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x))


def _report(r):
    return None if r is None else {"step": r.step, "ok": r.ok, "names": list(r.status),
                                   "findings": [[f.kind, list(f.params), f.level, f.data.get("ranks")] for f in r.findings]}


def run_case(fabric, case):
    """litgpt's accumulation idiom; ``case``: where the check is and what the monitor is given."""
    torch.manual_seed(0)
    net = Net()
    inner = torch.compile(net, backend="eager") if case == "compiled" else net
    opt = torch.optim.AdamW(net.parameters(), lr=2e-2)
    mon = gh.GradHealth(net, opt, on_problem="raise") if case == "before_setup" else None
    model, optimizer = fabric.setup(inner, opt)
    if mon is None:
        mon = gh.GradHealth(model, optimizer, on_problem="ignore" if case == "bug" else "raise")
    g = torch.Generator().manual_seed(100 + fabric.global_rank)  # each rank its own batches
    w = torch.randn(4, 2, generator=torch.Generator().manual_seed(7))
    reports, losses, raised = [], [], None
    try:
        for it in range(1, ITERS + 1):
            x = torch.randn(16, 4, generator=g)
            is_accumulating = it % ACCUM != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                loss = nn.functional.mse_loss(model(x), x @ w)
                fabric.backward(loss / ACCUM)
                if case == "bug" and not is_accumulating and fabric.global_rank == 1:
                    net.head.weight.grad[0, 0] += 0.5  # the planted bug: rank 1's reduced gradient changed
                if case != "after":
                    reports.append(_report(mon.check(loss)))
            if case == "after":  # the check just after the block, on accumulating micro-steps too
                reports.append(_report(mon.check(loss)))
            if not is_accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=5.0)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
    except gh.GradHealthError as exc:
        raised = str(exc)
    mon.close()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = fabric.all_gather(flat)
    return {"reports": reports, "losses": losses, "raised": raised, "names": mon.parameter_names,
            "same": bool(torch.equal(gathered[0], gathered[1])), "ddp_found": mon.ranks.ddp is not None}


def head_out(fabric, out):
    """Fabric's DDP around a compiled model, the head left out of the optimizer: the names in the
    report, the warning (rank 0 says it) and the TensorBoard tags (rank 0 writes them)."""
    from gradhealth.integrations.tensorboard import TensorBoardSink, read_run

    torch.manual_seed(0)
    net = Net()
    model, optimizer = fabric.setup(torch.compile(net, backend="eager"), torch.optim.SGD(net.body.parameters(), lr=0.1))
    logdir = os.path.join(out, "tb")
    mon = gh.GradHealth(model, optimizer, sinks=[TensorBoardSink(logdir)] if fabric.global_rank == 0 else [])
    fabric.backward(model(torch.randn(8, 4)).square().mean())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = mon.check()
    mon.close()
    said = [str(w.message) for w in caught if issubclass(w.category, gh.GradHealthWarning)]
    tags = sorted(set(read_run(logdir)["tag"])) if fabric.global_rank == 0 else []
    return {"report": _report(r), "said": said, "tags": tags}


def main(fabric, launch, out):
    warnings.simplefilter("ignore")
    cases = ["inside", "after", "before_setup", "compiled", "bug"] if launch == "ddp" else ["inside"]
    result = {}
    if launch == "ddp":
        try:
            result["head_out"] = head_out(fabric, out)
        except Exception:
            result["head_out"] = {"error": traceback.format_exc()}
    for case in cases:
        try:
            result[case] = run_case(fabric, case)
        except Exception:
            result[case] = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"{launch}-{fabric.global_rank}.json"), "w") as f:
        json.dump(result, f)


def spawn(launch, out):
    """``ddp_spawn``: ``fabric.launch(fn)`` starts both ranks (test_fabric_ddp.py calls this in its own process)."""
    torch.set_num_threads(1)
    L.Fabric(accelerator="cpu", devices=2, strategy=launch).launch(main, launch, out)


if __name__ == "__main__":
    launch, out = sys.argv[1], sys.argv[2]
    if launch == "ddp":
        torch.set_num_threads(1)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=launch)
        fabric.launch()
        main(fabric, launch, out)
    else:
        spawn(launch, out)
