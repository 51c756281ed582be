"""Update norms from the optimizer's own rule: ||Δθ|| per parameter without a copy of θ.

After ``optimizer.step()``, the update each parameter received is a function of what the
optimizer keeps (its state, the gradient, the new θ, the group's hyperparameters). Every update
the rules below know has the form

    θ_new = θ_old · (1 - lr·W) - lr·U      so      ||Δθ|| = lr / (1 - lr·W) · ||U + W·θ_new||

* ``torch.optim.SGD``: no momentum: U = ±g, W = weight_decay; momentum (not Nesterov): U = the
  momentum buffer, W = 0; Nesterov: U = ±g + momentum · buffer, W = weight_decay;
* ``torch.optim.Adam`` / ``AdamW``: U = (m / bc1) / (sqrt(v / bc2) + eps) (``max_exp_avg_sq`` for
  AMSGrad), W = weight_decay when decoupled (AdamW), else 0 (the decay is inside m). The bias
  corrections come from the step counts: read on the host when they are there (plain Adam), computed
  on the device when they are device tensors (fused or capturable Adam: never read, no host wait).

The single-tensor, foreach and fused implementations share that math. The number is the update
the rule computed, in float32 (float64 for float64 parameters): the values stored in θ differ from
it by the rounding of θ's own dtype, at most half an ulp of θ per element, so
``| ||Δθ_stored|| - ||Δθ_rule|| | <= ||ulp(θ)|| / 2`` (relative error ~1e-7 for fp32 updates well above
the ulp; whether θ changed at all is decided separately and exactly, see :mod:`.deltas`).
Temporaries are made a batch of tensors at a time, each batch at most ``budget`` elements (a
tensor larger than that is cut into chunks), so the transient memory stays bounded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..base.distributed import to_local
from .host import host_to
from .stats import foreach_norms

__all__ = ["rule_of", "rule_norms", "KNOWN"]

KNOWN = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def rule_of(opt) -> str | None:
    """'sgd', 'adam', or None for an optimizer whose rule is not known here (exact types only:
    a subclass may change the rule)."""
    return _RULES.get(type(opt))


_RULES = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}


def _on_host(t: Tensor) -> bool:
    return t.device.type == "cpu"


def _host_values(t: Tensor) -> list:
    """The values of ``t``, a tensor in host memory (:func:`_on_host`): read without a wait."""
    return t.tolist()


def _adam_coefs(t, beta1: float, beta2: float, eps: float):
    """(c, eps·sqrt(bc2)) such that (m / bc1) / (sqrt(v / bc2) + eps) = c · m / (sqrt(v) + eps·sqrt(bc2)),
    c = sqrt(bc2) / bc1; ``t`` a step count, or a vector of them on the device (then a pair of
    vectors, and a third: 0 where the count is 0, a fused step that skipped itself, whose update is 0,
    weight decay included; c = 0 and the second coefficient 1 there, so that 0 / (0 + 1) stays 0)."""
    if not isinstance(t, Tensor):
        if t == 0:
            return 0.0, 0.0
        root = (1 - beta2**t) ** 0.5
        return root / (1 - beta1**t), eps * root
    root, skipped = (1 - torch.pow(beta2, t)).sqrt(), t == 0
    return (torch.where(skipped, 0.0, root / (1 - torch.pow(beta1, t))), torch.where(skipped, 1.0, eps * root),
            (~skipped).double())


def _f(x) -> float:
    return float(x) if not isinstance(x, Tensor) else float(x.detach().cpu())


def _chunks(t: Tensor, budget: int) -> list[Tensor]:
    if t.numel() <= budget and not t.is_complex():  # the common case: the tensor itself
        return [t]
    if t.is_complex():  # torch's optimizers update complex tensors as their real views, elementwise
        t = torch.view_as_real(t)
    flat = t.reshape(-1)
    return [flat] if flat.numel() <= budget else list(flat.split(budget))


def _terms(opt, rule: str, params: list[Tensor]) -> list:
    """Per parameter: None (skipped by the step: no gradient, no state), or (scale, kind, tensors,
    coefficients, W) with ||Δθ|| = scale · ||U + W·θ||: kind "sum" (U = Σ coefficient·tensor) or
    "adam" (tensors m, v; coefficients c and eps·sqrt(bc2) of :func:`_adam_coefs`: floats, or 0-d
    device tensors for device step counts)."""
    index = {id(p): k for k, p in enumerate(params)}
    out: list = [None] * len(params)
    for g in opt.param_groups:
        lr = _f(g["lr"])
        steps = {}
        sign = -1.0 if g.get("maximize", False) else 1.0
        wd = _f(g.get("weight_decay", 0.0))
        if rule == "sgd":
            mom, nesterov = _f(g.get("momentum", 0.0)), g.get("nesterov", False)
        else:
            beta1, beta2 = (_f(b) for b in g["betas"])
            w = wd if g.get("decoupled_weight_decay", type(opt) is torch.optim.AdamW) else 0.0
            eps, second = _f(g["eps"]), "max_exp_avg_sq" if g.get("amsgrad", False) else "exp_avg_sq"
            have = [p for p in g["params"] if "step" in opt.state.get(p, {})]  # every parameter's step count at once
            counts = [opt.state[p]["step"] for p in have]
            if counts and all(isinstance(t, Tensor) for t in counts) and len(
                    {(t.device, t.dtype, t.dim()) for t in counts}) == 1:
                t = torch.stack(counts).reshape(-1)
                if _on_host(t):  # (plain Adam: one read of host memory)
                    steps = dict(zip(map(id, have), map(lambda c: _adam_coefs(c, beta1, beta2, eps), _host_values(t))))
                else:  # (fused/capturable Adam: the counts stay on the device, and so do the corrections)
                    c, e, on = _adam_coefs(t.to(torch.float64), beta1, beta2, eps)
                    steps = dict(zip(map(id, have), zip(c.unbind(), e.unbind(), on.unbind())))
            elif counts:
                steps = {id(p): _adam_coefs(_f(t), beta1, beta2, eps) for p, t in zip(have, counts)}
        state_of = opt.state
        for p in g["params"]:
            k = index.get(id(p))
            if k is None or p.grad is None:
                continue
            state = state_of.get(p, {})
            if rule == "sgd":
                buf = state.get("momentum_buffer")
                if mom and buf is not None and not nesterov:
                    out[k] = (lr, "sum", (buf,), (1.0,), 0.0)
                elif mom and buf is not None:
                    out[k] = (lr / (1 - lr * wd), "sum", (p.grad, buf), (sign, mom), wd)
                else:
                    out[k] = (lr / (1 - lr * wd), "sum", (p.grad,), (sign,), wd)
            elif "exp_avg" in state:
                coefs = steps[id(p)]
                if not isinstance(coefs[0], Tensor) and coefs[0] == 0.0:  # a fused step that skipped itself
                    continue  # (a grad scaler's found_inf: no update; on the device, c = 0 says the same)
                out[k] = (lr / (1 - lr * w), "adam", (state["exp_avg"], state[second]), coefs, w)
    return out


def rule_norms(opt, rule: str, params: list, budget: int) -> Tensor:
    """||Δθ|| of ``params`` (parameters the optimizer holds) for the step that just ran, as a
    float64 tensor on the first parameter's device; 0 for a parameter the step skipped."""
    with torch.no_grad():  # (θ read as it is: no detached view of each parameter)
        return _rule_norms(opt, rule, params, budget)


def _rule_norms(opt, rule: str, params: list, budget: int) -> Tensor:
    terms = _terms(opt, rule, params)
    device = to_local(params[0]).device
    sq = torch.zeros(len(params), dtype=torch.float64, device=device)
    # ||c·U|| with one tensor and no W needs no temporary: its norm, one fused kernel per group
    direct: dict[tuple, list] = {}
    # the others: chunks of like terms, batched so that a batch's temporaries stay within the budget
    batches: dict[tuple, list] = {}
    scales = [0.0] * len(terms)  # ||Δθ|| = scale · sqrt(sq)
    for k, term in enumerate(terms):
        if term is None:
            continue
        scales[k], kind, tensors, coefs, w = term
        if kind == "sum" and len(tensors) == 1 and w == 0.0:
            t = to_local(tensors[0])
            t = torch.view_as_real(t) if t.is_complex() else t
            direct.setdefault((t.device, t.dtype), []).append((k, t))
            scales[k] *= abs(coefs[0])
            continue
        theta = to_local(params[k])
        pieces = [_chunks(to_local(t), budget // 3) for t in tensors]
        for c, th in enumerate(_chunks(theta, budget // 3)):
            key = (kind, len(tensors), coefs if kind == "sum" else type(coefs[0]), w != 0.0, th.device, th.dtype)
            batches.setdefault(key, []).append((k, th, [pc[c] for pc in pieces], coefs, w))
    for items in direct.values():
        norms = torch.stack(foreach_norms([t for _, t in items])).to(sq.dtype)
        sq.index_add_(0, host_to([k for k, _ in items], sq.device), norms.to(sq.device) ** 2)
    for (kind, _, _, with_w, _, _), items in batches.items():
        start, size = 0, 0
        for end, item in enumerate(items, 1):
            size += item[1].numel()
            if size >= budget // 3 or end == len(items):
                _accumulate(kind, with_w, items[start:end], sq)
                start, size = end, 0
    return sq.sqrt() * host_to(scales, device, torch.float64)


def _accumulate(kind: str, with_w: bool, batch: list, sq: Tensor) -> None:
    """Add ||U + W·θ||² of one batch of like chunks into ``sq`` (per parameter), with foreach
    kernels; the temporaries are at most two per chunk."""
    parts = list(zip(*[item[2] for item in batch]))  # parts[j]: the j-th tensor of every chunk
    coefs = [item[3] for item in batch]
    thetas = [item[1] for item in batch]
    if kind == "adam":
        # c · m / (sqrt(v) + eps·sqrt(bc2)) (:func:`_adam_coefs`): the scalars folded so that each
        # element is read and written as few times as possible
        denom = torch._foreach_sqrt(list(parts[1]))
        torch._foreach_add_(denom, [c[1] for c in coefs])
        scale = [c[0] for c in coefs]
        if with_w and not isinstance(scale[0], Tensor):  # U + W·θ = W·θ + c · m / denom, in one kernel
            u = torch._foreach_mul(thetas, [item[4] for item in batch])
            torch._foreach_addcdiv_(u, list(parts[0]), denom, scale)
        else:  # (device coefficients: 0-d tensors, as lists of tensors)
            u = torch._foreach_div(list(parts[0]), denom)
            torch._foreach_mul_(u, scale)
            if with_w:
                torch._foreach_add_(u, torch._foreach_mul(thetas, [item[4] for item in batch]))
                torch._foreach_mul_(u, [c[2] for c in coefs])  # (a step that skipped itself: no decay either)
        del denom
    else:
        u = torch._foreach_mul(list(parts[0]), coefs[0][0])
        for j in range(1, len(parts)):
            torch._foreach_add_(u, list(parts[j]), alpha=coefs[0][j])
        if with_w:
            torch._foreach_add_(u, torch._foreach_mul(thetas, [item[4] for item in batch]))
    norms = torch.stack(foreach_norms(u)).to(sq.dtype)
    idx = host_to([item[0] for item in batch], sq.device)
    sq.index_add_(0, idx, norms.to(sq.device) ** 2)
