"""Which module the user wrote, under any wrapper: one rule for the whole family.

A *wrapper* owns no parameter of its own and exposes one module that holds every parameter it
holds, through the documented accessor ``.module`` (DistributedDataParallel, DataParallel,
DeepSpeed's engine, Fabric's ``_FabricModule``) or as a child registered under a private name
(``torch.compile``'s ``_orig_mod``, Fabric's ``_forward_module`` / ``_original_module``, FSDP1's
``_fsdp_wrapped_module``, the activation-checkpoint wrapper's ``_checkpoint_wrapped_module``).
The names the monitor reports skip every wrapper: the outer ones (:func:`unwrap`) and those inside
the model (a compiled block: :func:`user_names`). No class name is looked at, so the next
library's wrapper is unwrapped the same way.

Inside the model only private children count: a user's own attribute ``self.module`` inside a block
keeps its name. At the top, a model of the user's whose single child is ``self.module`` and which
owns no parameter itself would be taken for a wrapper (its names lose the ``module.`` prefix).
"""

from __future__ import annotations

import gc

from torch import nn

__all__ = ["inner", "unwrap", "chain", "user_names", "user_modules", "ddp_of", "wrapper_of"]

_DEPTH = 16  # wrappers around wrappers, at the most


def _count(module: nn.Module) -> int:
    return sum(1 for _ in module.parameters())


def _owns_parameters(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def inner(module: nn.Module, accessor: bool = True) -> tuple[str, nn.Module] | None:
    """``(how, wrapped)`` when ``module`` is a wrapper (see the module's docstring), else None.
    ``how``: the private child's name, or ``".module"`` for the accessor; ``accessor``: look at
    ``.module`` too (at the top of the model, not inside it)."""
    if _owns_parameters(module):
        return None
    found: list[tuple[str, nn.Module]] = []
    if accessor:
        try:  # (a property on some wrappers; a wrapper's __getattr__ may forward to what it wraps)
            m = getattr(module, "module", None)
        except Exception:
            m = None
        if isinstance(m, nn.Module) and m is not module:
            found.append((".module", m))
    found += [(k, c) for k, c in module._modules.items() if k.startswith("_") and isinstance(c, nn.Module)]
    if not found:
        return None
    n = _count(module)
    for how, m in found:
        if n and _count(m) == n:  # (a part of the parameters cannot hold all of them)
            return how, m
    return None


def chain(model: nn.Module) -> list[nn.Module]:
    """``model`` and every wrapper inside it, outermost first, down to the module the user wrote."""
    out = [model]
    while len(out) < _DEPTH:
        got = inner(out[-1])
        if got is None or any(got[1] is m for m in out):
            break
        out.append(got[1])
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The module the user wrote, under any nesting of wrappers."""
    return chain(model)[-1]


def _infixes(root: nn.Module) -> list[tuple[str, str]]:
    """``(path of a wrapper inside the model, its private child)`` for each wrapper inside ``root``."""
    out = []
    for path, m in root.named_modules():
        if m is root or not any(k.startswith("_") for k in m._modules):
            continue
        got = inner(m, accessor=False)
        if got is not None:
            out.append((path, got[0]))
    return out


def _cleaner(root: nn.Module):
    """A function from a name under ``root`` to the user's name (the identity without inner wrappers)."""
    infixes = _infixes(root)
    if not infixes:
        return lambda name: name
    drop = {f"{path}.{child}" if path else child for path, child in infixes}

    def clean(name: str) -> str:
        parts, kept = name.split("."), []
        for k in range(len(parts)):
            if ".".join(parts[: k + 1]) not in drop:
                kept.append(parts[k])
        return ".".join(kept)

    return clean


def user_names(root: nn.Module, names) -> list[str]:
    """Parameter (or module) names under ``root`` without the wrappers inside it."""
    clean = _cleaner(root)
    return [clean(n) for n in names]


def user_modules(root: nn.Module) -> dict[str, nn.Module]:
    """``named_modules()`` of ``root`` by the user's names (a wrapper inside it and the module it
    wraps share one name: the wrapped one is kept)."""
    clean = _cleaner(root)
    out: dict[str, nn.Module] = {}
    for path, m in root.named_modules():
        out[clean(path)] = m  # (the wrapped module comes after its wrapper)
    return out


def ddp_of(model: nn.Module):
    """The DistributedDataParallel around the user's module: one in the chain of wrappers the
    monitor was given (Fabric's ``_FabricModule`` holds it), else one that refers to the module
    the user wrote (Accelerate's and Lightning's recipes hand the monitor the unwrapped module;
    a monitor made before ``fabric.setup`` finds it at its first check). None without one."""
    for m in chain(model):
        if isinstance(m, nn.parallel.DistributedDataParallel):
            return m
    return wrapper_of(model, lambda m: isinstance(m, nn.parallel.DistributedDataParallel))


def wrapper_of(model: nn.Module, test):
    """A module that wraps the module the user wrote (its innermost wrapper unwraps to it) and passes
    ``test``, found among the objects that refer to it; None without one."""
    target = unwrap(model)
    seen, frontier = set(), [target]
    for _ in range(3):  # the wrapper -> its _modules dict -> the module (or the wrapper directly)
        nxt = []
        for obj in frontier:
            for ref in gc.get_referrers(obj):
                if isinstance(ref, nn.Module) and ref is not target and test(ref) and unwrap(ref) is target:
                    return ref
                if isinstance(ref, dict) and id(ref) not in seen:
                    seen.add(id(ref))
                    nxt.append(ref)
        frontier = nxt
    return None
