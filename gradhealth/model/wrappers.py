"""Which module the user wrote, under any wrapper: one rule for the whole family.

A *wrapper* owns no parameter of its own, exposes one module that holds every parameter it holds,
and exists to distribute or compile a model the user wrote. What it does decides, no class name:

* it registers the model under a private name, as a framework's shell does (``torch.compile``'s
  ``_orig_mod``, Lightning's and Fabric's ``_forward_module`` / ``_original_module``, FSDP1's
  ``_fsdp_wrapped_module``, the activation-checkpoint wrapper's ``_checkpoint_wrapped_module``):
  a private name is never the user's own spelling;
* or it exposes the model as ``.module`` *and* holds the machinery of a parallel run
  (:func:`distributes`): a process group or DDP's reducer (DistributedDataParallel, FSDP, DeepSpeed's
  engine, Megatron's DDP), a per-forward replication (torch's ``DataParallel``), or a gradient
  buffer of its own for the parameters it holds (``main_grad``: Megatron's DDP).

A model of the user's that keeps their network as ``self.module`` (Composer's
``ComposerClassifier``, a LightningModule, a hand-written holder) is none of these: its names keep
``module.``, as its own ``named_parameters()`` and its framework's logs write them.

The names the monitor reports skip every wrapper: the outer ones (:func:`unwrap`) and those inside
the model (a compiled block: :func:`user_names`); inside the model only private children count.
A name pattern the user gives (``expect_frozen``, ``experts``) may be written with the prefix of a
wrapper or holder around the reported names, or without it (:func:`respell`).
"""

from __future__ import annotations

import gc

from torch import nn

__all__ = ["inner", "distributes", "unwrap", "chain", "respell", "user_names", "user_modules", "ddp_of", "wrapper_of"]

_DEPTH = 16  # wrappers around wrappers, at the most


def _count(module: nn.Module) -> int:
    return sum(1 for _ in module.parameters())


def _owns_parameters(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def _accessor(module: nn.Module) -> nn.Module | None:
    """``module.module`` when it is another module (a property on some wrappers; a wrapper's
    ``__getattr__`` may forward to what it wraps), else None."""
    try:
        m = getattr(module, "module", None)
    except Exception:
        return None
    return m if isinstance(m, nn.Module) and m is not module else None


def _shell(module: nn.Module, accessor: bool = True) -> list[tuple[str, nn.Module]]:
    """``(how, wrapped)`` for each module ``module`` exposes that holds every parameter it holds
    (``".module"`` for the accessor, else the private child's name), when it owns none itself: the
    shape of a wrapper, and of a user's holder of ``self.module``."""
    if _owns_parameters(module):
        return []
    found: list[tuple[str, nn.Module]] = []
    m = _accessor(module) if accessor else None
    if m is not None:
        found.append((".module", m))
    found += [(k, c) for k, c in module._modules.items() if k.startswith("_") and isinstance(c, nn.Module)]
    if not found:
        return []
    n = _count(module)
    return [(how, m) for how, m in found if n and _count(m) == n]  # (a part of the parameters cannot hold all of them)


_MACHINERY: tuple | None = None


def _machinery() -> tuple:
    """The types of torch.distributed's machinery a parallel wrapper holds: a process group, DDP's reducer."""
    global _MACHINERY
    if _MACHINERY is None:
        try:
            import torch.distributed as dist

            _MACHINERY = (dist.ProcessGroup, dist.Reducer) if dist.is_available() else ()
        except Exception:  # (a torch built without distributed support)
            _MACHINERY = ()
    return _MACHINERY


def distributes(module: nn.Module, wrapped: nn.Module) -> bool:
    """Does ``module`` run ``wrapped`` in parallel: does it hold a process group or DDP's reducer
    (DistributedDataParallel, FSDP, DeepSpeed's engine, Megatron's DDP: as an attribute, or in a
    list, tuple or dict of them), replicate it at each forward (torch's DataParallel), or keep a
    gradient buffer of its own for its parameters (``main_grad``, Megatron's DDP)?"""
    if isinstance(module, nn.DataParallel):  # (torch's own: one process, no group to hold)
        return True
    kinds = _machinery()
    if kinds:
        for v in vars(module).values():
            if isinstance(v, kinds):
                return True
            items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else ()
            if any(isinstance(x, kinds) for x, _ in zip(items, range(64))):
                return True
    return any(hasattr(p, "main_grad") for p in wrapped.parameters())


def inner(module: nn.Module, accessor: bool = True) -> tuple[str, nn.Module] | None:
    """``(how, wrapped)`` when ``module`` is a wrapper (see the module's docstring), else None.
    ``how``: the private child's name, or ``".module"`` for the accessor; ``accessor``: look at
    ``.module`` too (at the top of the model, not inside it)."""
    for how, m in _shell(module, accessor):
        if how != ".module" or distributes(module, m):
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


def _paths(outer: nn.Module, target: nn.Module) -> list[str]:
    """Every dotted prefix from ``outer`` to ``target`` (``"module."``, ``"_forward_module._orig_mod."``)
    through modules that hold all of ``target``'s parameters and own none: the ways a name under
    ``target`` is spelled from ``outer``."""
    if outer is target:
        return [""]
    n, out, frontier = _count(target), [], [(outer, "")]
    for _ in range(_DEPTH):
        nxt = []
        for m, path in frontier:
            kids = list(m._modules.items())
            acc = _accessor(m)
            if acc is not None and "module" not in m._modules:
                kids.append(("module", acc))
            for k, c in kids:
                if c is target:
                    out.append(f"{path}{k}.")
                elif isinstance(c, nn.Module) and not _owns_parameters(c) and _count(c) == n:
                    nxt.append((c, f"{path}{k}."))
        frontier = nxt
        if not frontier:
            break
    return list(dict.fromkeys(out))


def _joined(links: list[list[str]]) -> list[str]:
    """Each way to write some of ``links`` (a prefix per level, or none), in order: ``["module."],
    ["_orig_mod."]`` gives ``module._orig_mod.``, ``module.``, ``_orig_mod.``."""
    out = [""]
    for options in links:
        out = [w + o for w in out for o in ["", *options]]
    return [w for w in dict.fromkeys(out) if w]


def respell(model: nn.Module, patterns):
    """``patterns`` (name patterns, or ``{pattern: value}``) as they match the names the monitor
    reports for ``model``: each as written, and also without the prefix of a wrapper around the
    reported module (``module.0.*`` under DistributedDataParallel: ``0.*``) and with the prefix of a
    holder the names keep (``0.*`` under a holder of ``self.module``: ``module.0.*``), each wrapper's
    or holder's prefix written or left out, so either spelling matches the same parameters.
    Returns the same kind (a tuple, or a dict)."""
    if not patterns:
        return patterns
    levels = chain(model)
    k = len(levels) - 1  # (the reported module)
    while len(levels) < _DEPTH:  # the holders below it (the names keep their prefix)
        below = _shell(levels[-1])
        if not below or any(below[0][1] is m for m in levels):
            break
        levels.append(below[0][1])
    links = [_paths(a, b) for a, b in zip(levels, levels[1:])]
    strip, add = _joined(links[:k]), _joined(links[k:])
    items = list(patterns.items()) if isinstance(patterns, dict) else [(p, None) for p in patterns]
    out: dict = {}
    for pattern, value in items:
        out.setdefault(pattern, value)
        for p in strip:
            if pattern.startswith(p) and len(pattern) > len(p):
                out.setdefault(pattern[len(p):], value)
        for p in add:
            out.setdefault(p + pattern, value)
    return out if isinstance(patterns, dict) else tuple(out)


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
                # (its .module is the target: an engine passes ``test`` by what it does, accumulating,
                # with or without a process group of its own)
                if (isinstance(ref, nn.Module) and ref is not target and test(ref)
                        and (unwrap(ref) is target or getattr(ref, "module", None) is target)):
                    return ref
                if isinstance(ref, dict) and id(ref) not in seen:
                    seen.add(id(ref))
                    nxt.append(ref)
        frontier = nxt
    return None
