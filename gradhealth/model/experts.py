"""Stacked experts: one tensor holding E experts along a dimension, judged per expert. This module
finds the stacks; each stage does its part with them (the slice norms: :mod:`gradhealth.measure.expert_norms`;
the verdicts: :func:`gradhealth.judge.classify.expert_states`).

Mixture-of-experts layers in transformers 5 (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS) and in
grouped-GEMM codebases (torchtitan, Megatron) keep all experts of a layer in one tensor
(``model.layers.0.mlp.experts.gate_up_proj`` of shape ``[E, 2*I, H]``): a collapsed router leaves
``grad[3]`` exactly zero while the tensor's gradient is not, so the tensor is OK and the dead
expert is invisible unless each slice is looked at.

* **Finding the stacks** (``find_stacks``): automatically, a parameter owned by a module named
  ``experts`` whose leading dimension is that module's ``num_experts`` (or the model config's
  ``num_local_experts`` / ``num_experts`` / ``n_routed_experts`` / ``moe_num_experts``), with at least
  two dimensions; or the ``experts=`` option: name patterns (``fnmatch``) with the stacking dimension
  (``{"*.moe.w1": 0}``, or a list of patterns for dimension 0). Nothing else is guessed (a 3-D conv
  weight is not experts); ``experts=False`` turns it off.
* **Slice norms** (:mod:`gradhealth.measure.expert_norms`): each stacked gradient is reduced per slice by
  one ``vector_norm(..., dim=1)`` (no loop over slices), read in the check's single transfer; the
  tensor's own norm is the float64 ``hypot`` of its slices, so a stacked tensor costs one pass as
  before. Slices whose norm came back 0 or inf are re-checked exactly (scaled float64 norms, one
  chain per tensor over just those slices, one more transfer at that check): a zero slice is exactly
  zero, finite 1e20s are finite, 1e-30s are not zero.
* **Per-expert verdicts** (:func:`~gradhealth.judge.classify.expert_states`): an expert ``<module>[i]`` is all its stacked tensors' slices
  ``i`` together: NON_FINITE_GRAD if any slice holds NaN/inf, ZERO_GRAD (idle: it got no tokens) if
  every slice is exactly zero, NO_GRAD if none of its tensors has a gradient, FROZEN if all are
  frozen, else OK. Idle experts go through the persistence rule (:mod:`gradhealth.judge.patience`): transient is
  info, persistent is DEAD_EXPERT.
* **Router evidence** (``router_counts``): when the model returns its router logits (Hugging Face
  ``output_router_logits=True``), the tokens routed to each expert are counted on the device and
  read in the same transfer: a second, independent signal (0 tokens and a zero slice agree), in
  ``report.expert_tokens`` and the DEAD_EXPERT message. Without them the slices alone decide.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..base.naming import module_of, terminal_safe
from .wrappers import user_modules

__all__ = ["router_counts", "Stack", "find_stacks", "check_experts", "unit_name", "CONFIG_KEYS", "describe_stacks", "per_rank"]

#: model-config attributes that give the number of experts of a layer
CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_MODULE_KEYS = ("num_experts", "num_local_experts")


@dataclass(frozen=True)
class Stack:
    entry: int  # the parameter's entry index in the monitor's view
    name: str  # the parameter's name
    module: str  # the experts module the unit names are built on
    dim: int  # the stacking dimension
    count: int  # experts in it
    place: int | None = None  # an expert module's tensor: the one expert it is, by global index (see find_stacks)
    copies: int = 1  # (placed) the ranks that hold its whole gradient, when not partitioned


def unit_name(module: str, index: int) -> str:
    return f"{module}[{index}]"


def check_experts(value):
    """The ``experts`` option: None (automatic), False (off), or patterns with their dimension."""
    if value is None or value is False:
        return value
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        pairs = list(value.items())
    else:
        try:
            pairs = [(p, 0) for p in value]
        except TypeError:
            pairs = None
    if pairs is None or not all(isinstance(p, str) and isinstance(d, int) and not isinstance(d, bool) for p, d in pairs):
        raise TypeError("experts must be None (found automatically), False (off), a name pattern or list of them "
                        "(stacked along dimension 0), or a dict {pattern: dimension}, e.g. {'*.moe.experts.w1': 0}; "
                        f"got {value!r}")
    return dict(pairs)


def _config_count(root: nn.Module) -> int | None:
    cfg = getattr(root, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        for key in CONFIG_KEYS:
            v = getattr(c, key, None) if c is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                return v
    return None


def find_stacks(root: nn.Module, entries, declared=None) -> dict[int, Stack]:
    """The stacked-expert tensors among ``entries`` (``(name, parameter)``), by entry index."""
    if declared is False:
        return {}
    out: dict[int, Stack] = {}
    if declared:
        for i, (name, p) in enumerate(entries):
            for pattern, dim in declared.items():
                if fnmatch.fnmatchcase(name, pattern) and -p.dim() <= dim < p.dim() and p.shape[dim] > 1:
                    out[i] = Stack(i, name, module_of(name), dim % p.dim(), p.shape[dim])
                    break
        return out
    config = _config_count(root)
    modules = user_modules(root)
    for i, (name, p) in enumerate(entries):
        placed = _placed(modules, i, name, p)
        if placed is not None:
            out[i] = placed
            continue
        owner = module_of(name)
        if not owner.rpartition(".")[2].lower().endswith("experts") or p.dim() < 2:
            continue
        m = modules.get(owner)
        count = next((getattr(m, k) for k in _MODULE_KEYS if isinstance(getattr(m, k, None), int)), None) or config
        if count is not None and count > 1 and p.shape[0] == count:
            out[i] = Stack(i, name, owner, 0, count)
    return out


def _expert_group(modules: dict[str, nn.Module], path: str) -> tuple[int, int, int]:
    """(this rank's expert-parallel position, the expert-parallel size, the ranks holding each
    expert) from the nearest module on ``path`` that holds its expert-parallel process group."""
    while path:
        group = getattr(modules.get(path), "ep_group", None)
        if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            try:
                size = torch.distributed.get_world_size(group)
                return torch.distributed.get_rank(group), size, max(1, torch.distributed.get_world_size() // size)
            except (RuntimeError, ValueError, TypeError):
                break
        path = path.rpartition(".")[0]
    return 0, 1, 1


def _placed(modules: dict[str, nn.Module], entry: int, name: str, p) -> Stack | None:
    """An expert module's parameter (DeepSpeed's MoE: one module per local expert, its parameters
    marked ``allreduce = False`` with the ``group_name`` of their expert-parallel group, held in a
    ``ModuleList`` whose owner counts them in ``num_local_experts``): a whole expert, named by its
    global index (this rank's expert-parallel position times the local experts, plus its local
    index), so each rank's experts are their own."""
    if getattr(p, "allreduce", True) is not False or not isinstance(getattr(p, "group_name", None), str):
        return None
    parts = name.split(".")
    for k in range(len(parts) - 2, 0, -1):
        if not parts[k].isdigit():
            continue
        listed, owner = ".".join(parts[:k]), ".".join(parts[: k - 1])
        local = getattr(modules.get(owner), "num_local_experts", None)
        if isinstance(modules.get(listed), nn.ModuleList) and isinstance(local, int) and local == len(modules[listed]):
            position, size, copies = _expert_group(modules, owner)
            return Stack(entry, name, listed, 0, size * local, position * local + int(parts[k]), copies)
    return None


def per_rank(stack: Stack | None, world: int) -> bool:
    """An expert module's tensor that is another expert on some other rank (expert parallelism): a
    replica only within its ``copies`` ranks, never compared with every rank's."""
    return stack is not None and stack.place is not None and stack.copies < world


def describe_stacks(stacks: dict[int, Stack]) -> str | None:
    """``stacked experts: model.layers.0.mlp.experts (4 experts: gate_up_proj, down_proj), ...``"""
    if not stacks:
        return None
    by: dict[str, list[Stack]] = {}
    for s in stacks.values():
        by.setdefault(s.module, []).append(s)
    def tensor(s: Stack) -> str:  # (an expert module's: its name inside the expert)
        return s.name.rpartition(".")[2] if s.place is None else s.name[len(s.module) + 1:].partition(".")[2]

    parts = [f"{m} ({ss[0].count} experts: {', '.join(dict.fromkeys(map(tensor, ss)))})" for m, ss in by.items()]
    shown = ", ".join(parts[:4]) + (f" and {len(parts) - 4} more layers" if len(parts) > 4 else "")
    return terminal_safe(f"stacked experts judged per expert in {len(by)} layer{'s' if len(by) != 1 else ''}: {shown}")


def router_counts(output, top_k) -> list[Tensor] | None:
    """Tokens routed to each expert of each MoE layer, counted on the device from a model output's
    ``router_logits`` (Hugging Face ``output_router_logits=True``: one ``[tokens, E]`` tensor per
    layer) with the config's ``top_k``; None when the output has none."""
    logits = getattr(output, "router_logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("router_logits")
    if not logits or not isinstance(top_k, int) or isinstance(logits, Tensor):
        return None
    out = []
    with torch.no_grad():
        for layer in logits:
            if not isinstance(layer, Tensor) or layer.dim() != 2 or top_k > layer.shape[-1]:
                return None
            chosen = layer.topk(top_k, dim=-1).indices.reshape(-1)
            out.append(torch.bincount(chosen, minlength=layer.shape[-1]).to(torch.float64))
    return out


