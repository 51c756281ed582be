"""DeepSpeed's own gradient accumulation (``"gradient_accumulation_steps": 4`` in the config) as its
docs write the loop: ``engine.backward(loss); engine.step()`` on every micro-batch, the engine
deciding the boundary. Two monitors watch one engine: ``every`` checks after each
``engine.backward``, ``boundary`` only where ``engine.is_gradient_accumulation_boundary()``; both
before ``engine.step()``. Run by tests/test_deepspeed.py in a process of its own (one or two ranks,
as tests/deepspeed_cases.py): ``python tests/deepspeed_accum_cases.py OUT.json CASE ...``, a case
``<stage>-<precision>-<offload|plain>-<kind>`` (kind: healthy, left, inf), or DeepSpeed's MoE:
``experts`` (expert parallelism, ep_size 2, ZeRO-2), ``experts-z0`` (the same without ZeRO),
``experts-1`` (every expert on one process).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import deepspeed_cases as dc  # (sets the distributed environment's defaults first)
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradhealth as gh  # noqa: E402

GAS, WINDOWS = 4, 6
INF_AT = 5  # the micro-batch whose gradient is infinite: inside the second window, not its boundary


def engine_for(stage: int, precision: str, offload: bool, left: bool = False):
    import deepspeed

    torch.manual_seed(0)
    model = dc.Net()
    trained = [(n, p) for n, p in model.named_parameters() if not (left and n.startswith("head."))]
    groups = [{"params": [p for n, p in trained if n.endswith("weight")], "weight_decay": 1e-4},
              {"params": [p for n, p in trained if n.endswith("bias")], "weight_decay": 0.0}]
    if offload:  # (ZeRO-Offload steps on the CPU: DeepSpeed's own Adam)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, lr=1e-2, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=1e-2)
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
              "zero_optimization": zero, "steps_per_print": 10**9}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, optimizer=optimizer, config=config)
    return engine


def full_grads(engine) -> list[float | None]:
    """Every trained parameter's whole-gradient norm by DeepSpeed's own accessor (a collective)."""
    from deepspeed.utils import safe_get_full_grad

    out = []
    for p in engine.module.parameters():
        g = safe_get_full_grad(p)
        out.append(float(g.double().norm()) if g is not None else None)
    return out


def run(stage: int, precision: str, offload: bool, kind: str) -> dict:
    engine = engine_for(stage, precision, offload, left=kind == "left")
    raising = "raise" if kind == "healthy" else "ignore"
    kept = {"every": dc.Keep(), "boundary": dc.Keep()}
    monitors = {k: gh.GradHealth(engine.module, engine.optimizer, on_problem=raising, update_every=1, change_every=1,
                                 sinks=[kept[k]]) for k in kept}
    out = {"kind": kind, "between": [], "boundaries": [], "engine_norms": [], "oracle": [], "error": None,
           "eval_before": dc.eval_loss(engine, precision)}
    try:
        for micro in range(GAS * WINDOWS):
            x, y = dc.batch(micro, precision)
            pred = engine(x).float()
            loss = ((pred - y) ** 2).mean()
            if kind == "inf" and micro == INF_AT:
                loss = loss + (pred - pred.detach()).pow(0.5).sum()  # zero in value, an infinite gradient
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            every = monitors["every"].check(loss=loss)
            if boundary:
                monitors["boundary"].check(loss=loss)
                out["oracle"].append(full_grads(engine))
                out["boundaries"].append(micro)
            else:
                out["between"].append(every is None)
            engine.step()
            if boundary:
                norm = engine.get_global_grad_norm()
                out["engine_norms"].append(float(norm) if norm is not None else None)
        for m in monitors.values():
            m.flush()
    except gh.GradHealthError as exc:
        out["error"] = str(exc)
    finally:
        for m in monitors.values():
            m.close()
    for k, keep in kept.items():
        out[k] = [{"step": r.step, "total": r.total_grad_norm, "grad_norm": dict(r.grad_norm),
                   "problems": {n: s.value for n, s in r.problems.items()},
                   "findings": [(f.kind, f.level, f.step, f.message) for f in r.findings]} for r in keep.reports]
    out["names"] = [n for n, _ in engine.module.named_parameters()]
    out["skipped_steps"] = engine.skipped_steps
    out["eval_after"] = dc.eval_loss(engine, precision)
    return out


class MoENet(nn.Module):
    """A layer of DeepSpeed's MoE (4 experts, 2 on each of the two expert-parallel ranks) between two
    linear layers; the gate reads a constant feature so expert 3 (rank 1's second) gets no tokens."""

    def __init__(self, ep_size: int):
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.moe = MoE(hidden_size=16, expert=nn.Sequential(nn.Linear(16, 16), nn.ReLU()), num_experts=4, ep_size=ep_size,
                       k=1, capacity_factor=4.0, min_capacity=4, use_rts=False, drop_tokens=False)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = torch.cat([torch.ones_like(h[:, :1]), h[:, 1:]], dim=1)  # (the gate's constant feature)
        out, _aux, _counts = self.moe(h.unsqueeze(0))
        return self.head(out.squeeze(0))


def experts(ep_size: int = 2, stage: int = 2) -> dict:
    """Expert parallelism on two ranks (ep_size=2): every rank's local experts 0 and 1 are the global
    experts 2r and 2r+1; the gate never picks expert 3 (rank 1's local expert 1)."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = MoENet(ep_size=ep_size)
    gate = model.moe.deepspeed_moe.gate.wg
    with torch.no_grad():  # experts 0-2 share the tokens about evenly; the constant feature sends none to expert 3
        gate.weight.copy_(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)))
        gate.weight[:, 0] = torch.tensor([0.53, -0.92, 0.39, -100.0])
        gate.weight[3, 1:] = 0.0
    gate.weight.requires_grad_(False)
    rank = int(os.environ.get("RANK", "0"))
    with torch.no_grad():  # every expert its own initial weights (MoE deep-copies one): rank r's are not rank 0's
        for k, e in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            e[0].weight.add_(0.01 * (model.moe.num_local_experts * rank + k))
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "all"})
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    keep = dc.Keep()
    # (the replicas compared at every check: an expert is not a replica of another rank's)
    monitor = gh.GradHealth(engine.module, engine.optimizer, on_problem="ignore", sinks=[keep], desync_every=1)
    out = {"tokens": [], "error": None, "local_norms": [],
           "first_weights": [float(e[0].weight.sum()) for e in model.moe.deepspeed_moe.experts.deepspeed_experts]}
    for step in range(8):
        x, y = dc.batch(step, "fp32")
        loss = ((engine(x).float() - y) ** 2).mean()
        engine.backward(loss)
        monitor.check(loss=loss)
        out["tokens"].append([float(c) for c in model.moe.deepspeed_moe.exp_counts])  # (this rank's tokens, per expert)
        # the premise: this rank's own local experts' gradients (DeepSpeed's accessor), each its own
        from deepspeed.utils import safe_get_full_grad

        local = model.moe.deepspeed_moe.experts.deepspeed_experts
        out["local_norms"].append([float(torch.sqrt(sum(safe_get_full_grad(p).double().norm() ** 2 for p in e.parameters())))
                                   for e in local])
        engine.step()
    monitor.close()
    r = keep.reports[-1]
    out["rank"] = rank
    out["expert_status"] = {u: s.value for u, s in r.expert_status.items()}
    out["expert_grad_norm"] = dict(r.expert_grad_norm)
    out["expert_norms_by_step"] = [dict(x.expert_grad_norm) for x in keep.reports]
    out["findings"] = [(f.kind, f.level, f.step, f.message) for x in keep.reports for f in x.findings]
    return out


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    path, results = argv[0], {}
    for case in argv[1:]:
        if case.startswith("experts"):  # (experts: ep_size 2; experts-1: every expert on one rank; -z0: no ZeRO)
            results[case] = experts(1 if case == "experts-1" else 2, 0 if case == "experts-z0" else 2)
            continue
        s, p, o, k = case.split("-")
        results[case] = dict(run(int(s), p, o == "offload", k), case=case)
    rank = int(os.environ.get("RANK", "0"))
    with open(path if rank == 0 else f"{path}.rank{rank}", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
