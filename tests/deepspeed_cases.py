"""DeepSpeed's own loop (``deepspeed.initialize``, ``engine.backward``, ``engine.step``) at ZeRO
stages 0-3 in fp32 and bf16 on the CPU, with the monitor as the README's DeepSpeed recipe sets it
up. Run by tests/test_deepspeed.py in a process of its own (DeepSpeed initialises torch.distributed,
gloo): ``python tests/deepspeed_cases.py OUT.json [CASE ...]``; under ``torchrun`` every rank runs
the cases; rank 0 writes OUT.json, rank r OUT.json.rank<r>. Each case records what the test asserts: the premise (the
loss falls, the engine's own norm and skipped steps, the masters before and after a step) and the
monitor's verdict.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29561"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                   ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradhealth as gh  # noqa: E402

STEPS = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def engine_for(stage: int, precision: str, *, lr: float = 1e-2, freeze: bool = False, seed: int = 0):
    import deepspeed

    torch.manual_seed(seed)
    model = Net()
    if freeze:
        model.fc1.requires_grad_(False)
    # the usual two groups (no weight decay on biases): ZeRO-1/2 then step their inner optimizer once per group
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for n, p in trained if n.endswith("weight")], "weight_decay": 1e-4},
                                   {"params": [p for n, p in trained if n.endswith("bias")], "weight_decay": 0.0}], lr=lr)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if stage == 3:  # (else a tiny model's parameters stay whole: below the persistence threshold)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return model, engine


def batch(step: int, precision: str):
    g = torch.Generator().manual_seed(1000 + step + 97 * int(os.environ.get("RANK", "0")))
    x = torch.randn(16, 8, generator=g)
    y = x[:, :4].sum(1, keepdim=True) - x[:, 4:].sum(1, keepdim=True)
    return (x.bfloat16() if precision == "bf16" else x), y


def masters(engine) -> list[torch.Tensor]:
    """Every trained parameter's whole fp32 master (DeepSpeed's own accessor; a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        if p.requires_grad:
            got = safe_get_full_fp32_param(p)
            out.append((got if got is not None else p).detach().float().clone())
    return out


def full_grads(engine) -> list[float]:
    """Every trained parameter's whole-gradient norm by DeepSpeed's own accessor (a collective): the
    naive per-parameter oracle."""
    from deepspeed.utils import safe_get_full_grad

    out = []
    for p in engine.module.parameters():
        if p.requires_grad:
            g = safe_get_full_grad(p)
            out.append(float(g.double().norm()) if g is not None else None)
    return out


def masters_of(engine) -> list[torch.Tensor]:
    """The fp32 masters DeepSpeed steps: its accessor (ZeRO), or the fp32 copies of its bf16
    optimizer without ZeRO (``fp32_groups``)."""
    fp32 = getattr(engine.optimizer, "fp32_groups", None)
    if fp32 is not None and not hasattr(next(engine.module.parameters()), "_hp_mapping"):
        pairs = {id(p): t for ps, ts in zip(engine.optimizer.fp16_groups, fp32) for p, t in zip(ps, ts)}
        return [pairs[id(p)].detach().float().clone() for p in engine.module.parameters() if p.requires_grad]
    return masters(engine)


def eval_loss(engine, precision: str) -> float:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=g)
    y = x[:, :4].sum(1, keepdim=True) - x[:, 4:].sum(1, keepdim=True)
    with torch.no_grad():
        return float(((engine(x.bfloat16() if precision == "bf16" else x).float() - y) ** 2).mean())


def run(stage: int, precision: str, kind: str) -> dict:
    """One run of STEPS steps; ``kind``: healthy, frozen, lr0, inf (a finite loss over an infinite
    gradient), engine (the monitor built on the engine itself)."""
    model, engine = engine_for(stage, precision, lr=0.0 if kind == "lr0" else 1e-2, freeze=kind == "frozen")
    on = engine if kind == "engine" else engine.module
    keep = Keep()
    monitor = gh.GradHealth(on, engine.optimizer, on_problem="raise" if kind in ("healthy", "engine") else "ignore",
                            update_every=1, change_every=1, sinks=[keep])
    out = {"stage": stage, "precision": precision, "kind": kind, "losses": [], "norms": [], "engine_norms": [],
           "problems": [], "findings": [], "updates": [], "true_updates": [], "names": None, "error": None,
           "skipped_steps": None, "moved": None}
    first = masters_of(engine)
    out["eval_before"] = eval_loss(engine, precision)
    out["oracle"] = []

    def steps():
        before = first  # (the masters after a step are the next step's before: nothing moves them in between)
        for step in range(STEPS):
            x, y = batch(step, precision)
            pred = engine(x).float()
            loss = ((pred - y) ** 2).mean()
            if kind == "inf":  # zero in value, an infinite gradient (d sqrt(t)/dt at t = 0)
                loss = loss + (pred - pred.detach()).pow(0.5).sum()
            engine.backward(loss)
            report = monitor.check(loss=loss)
            out["oracle"].append(full_grads(engine))
            engine.step()
            after = masters_of(engine)
            out["losses"].append(float(loss))
            out["norms"].append(report.total_grad_norm)
            out.setdefault("grad_norms", []).append(dict(report.grad_norm))
            out["engine_norms"].append(float(engine.get_global_grad_norm()) if engine.get_global_grad_norm() is not None else None)
            out["problems"].append({k: v.value for k, v in report.problems.items()})
            out["names"] = list(report.status)
            out["status"] = {k: v.value for k, v in report.status.items()}
            out["true_updates"].append([float((a - b).norm()) for a, b in zip(after, before)])
            before = after

    drive(monitor, keep, out, steps)
    out["skipped_steps"] = engine.skipped_steps
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(first, masters_of(engine)))
    out["eval_after"] = eval_loss(engine, precision)
    # ZeRO-3 keeps each parameter partitioned: outside a forward the module's own tensors are empty
    out["empty_on_module"] = [p.numel() == 0 for p in engine.module.parameters()]
    return out


def fused(lr: float = 1e-4) -> dict:
    """bf16 without ZeRO and the optimizer from the config (``"optimizer": {"type": "Adam"}``, a
    ``FusedAdam``): DeepSpeed wraps it in its fused ``FP16_Optimizer``, whose fp32 masters are one
    flat tensor per group (``fp32_groups_flat``). At a fine-tuning learning rate a step moves the
    masters by less than a bf16 weight's precision: the weights stay, the masters move."""
    import deepspeed

    torch.manual_seed(0)
    model = Net()
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": lr}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    opt = engine.optimizer
    keep = Keep()
    monitor = gh.GradHealth(engine.module, opt, on_problem="raise", update_every=1, change_every=1, sinks=[keep])

    def flat_masters():  # (the oracle: each parameter's slice of its group's flat fp32 master, in order)
        return [piece.clone() for flat, group in zip(opt.fp32_groups_flat, opt.fp16_groups)
                for piece in flat.detach().split([p.numel() for p in group])]

    order = [n for g in opt.fp16_groups for p in g for n, q in model.named_parameters() if q is p]
    out = {"wrapper": type(opt).__name__, "inner": type(opt.optimizer).__name__, "error": None, "losses": [],
           "weights_still": [], "masters_moved": [], "true_updates": [], "order": order}

    def steps():
        for step in range(STEPS):
            x, y = batch(step, "bf16")
            loss = ((engine(x).float() - y) ** 2).mean()
            engine.backward(loss)
            monitor.check(loss=loss)
            weights, masters = [p.detach().clone() for g in opt.fp16_groups for p in g], flat_masters()
            engine.step()
            after_w, after_m = [p.detach() for g in opt.fp16_groups for p in g], flat_masters()
            out["losses"].append(float(loss))
            out["weights_still"].append([bool(torch.equal(a, b)) for a, b in zip(weights, after_w)])
            out["masters_moved"].append([not torch.equal(a, b) for a, b in zip(masters, after_m)])
            out["true_updates"].append([float((a - b).double().norm()) for a, b in zip(after_m, masters)])

    drive(monitor, keep, out, steps)
    return out


def drive(monitor, keep, out: dict, steps) -> None:
    """Run ``steps()`` (the loop), then the monitor's last report; a raise is recorded as the error;
    the findings and update norms of every report."""
    try:
        steps()
        monitor.flush()
    except gh.GradHealthError as exc:
        out["error"] = str(exc)
    finally:
        monitor.close()
    out["findings"] = [(f.kind, f.level, f.step, f.message) for r in keep.reports for f in r.findings]
    out["updates"] = [dict(r.update_norm) for r in keep.reports]


class Keep:
    def __init__(self):
        self.reports = []

    def write(self, report):
        self.reports.append(report)


def unfused() -> dict:
    """DeepSpeed's fp16 optimizer with a dynamic loss scale, driven as Megatron-DeepSpeed drives it
    (``optimizer.backward(loss)``, ``optimizer.step()``; the engine refuses fp16 on the CPU, the
    optimizer itself runs): the scale starts at 2**24 and settles by skipping the steps that overflow."""
    import deepspeed
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Net().half()
    optimizer = FP16_UnfusedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                                      dynamic_loss_args={"init_scale": 2**24, "scale_window": 1000, "min_scale": 1,
                                                         "delayed_shift": 1}, clip_grad=1.0)
    keep = Keep()
    monitor = gh.GradHealth(model, optimizer, on_problem="raise", sinks=[keep])
    out = {"scales": [], "overflow": [], "losses": [], "norms": [], "oracle": [], "ok": [], "problems": [], "error": None}
    x, y = batch(0, "fp32")
    try:
        for _ in range(14):
            loss = ((model(x.half()).float() - y) ** 2).mean()
            optimizer.backward(loss)
            report = monitor.check(loss=loss)
            scale = optimizer.loss_scale_config.cur_scale  # the oracle: the scaled fp16 gradients, unscaled by hand
            out["oracle"].append(math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in model.parameters())) / scale)
            out["scales"].append(scale)
            optimizer.step()
            optimizer.zero_grad()
            out["overflow"].append(bool(optimizer.overflow))
            out["losses"].append(float(loss))
            out["norms"].append(report.total_grad_norm)
            out["ok"].append(report.ok)
            out["problems"].append(sorted({v.value for v in report.problems.values()}))
    except gh.GradHealthError as exc:
        out["error"] = str(exc)
    finally:
        monitor.close()
    out["findings"] = sorted({(f.kind, f.level, f.step) for r in keep.reports for f in r.findings}, key=lambda f: f[2])
    return out


CASES = [f"{s}-{p}-{k}" for s in (0, 1, 2, 3) for p in ("fp32", "bf16") for k in ("healthy", "frozen", "lr0", "inf")]
CASES += ["2-bf16-engine"]


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    path, cases = argv[0], argv[1:] or CASES
    results = {}
    for case in cases:
        if case == "fp16-unfused":
            results[case] = unfused()
            continue
        if case == "0-bf16-fused":
            results[case] = fused()
            continue
        s, p, k = case.split("-")
        results[case] = run(int(s), p, k)
    rank = int(os.environ.get("RANK", "0"))
    with open(path if rank == 0 else f"{path}.rank{rank}", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
