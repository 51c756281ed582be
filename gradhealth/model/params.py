"""``ParamView``: the monitored parameters, their names and modules, and which optimizer holds which;
the user's parameter names (:mod:`.wrappers`) and the validation of the ``model`` argument."""

from __future__ import annotations

import logging
import weakref
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import compress, filterfalse

import torch.nn.modules.module as module_hooks
import torch
from torch import nn

from ..base.findings import Finding, FindingKind
from ..base.hooks import guarded
from ..base.naming import agree, module_of
from ..base.report import ParamMeta
from ..base.status import Status
from .experts import find_stacks
from .optimizers import optimizer_param_ids
from .wrappers import respell, unwrap, user_names

__all__ = ["ParamView", "Selection", "ModelChanges", "LiveMeta", "check_model", "named_parameters", "is_lazy", "lazy_names"]


def check_model(model) -> nn.Module:
    """Validate the ``model`` argument and return the unwrapped module."""
    if not isinstance(model, nn.Module):
        hint = ""
        if isinstance(model, torch.optim.Optimizer):
            hint = " (an optimizer was passed where the model belongs: GradHealth(model, optimizer))"
        elif callable(model):
            hint = " (a function was passed; pass the nn.Module whose parameters train)"
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}{hint}")
    return unwrap(model)


def named_parameters(model: nn.Module, *, validate: bool = True, meta: bool = False) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` pairs as ``named_parameters()`` gives them (tied ones once), with
    wrapper prefixes removed. Raises ``ValueError`` for an empty model or (unless ``meta``) meta
    parameters."""
    module = check_model(model)
    named = [(n, p) for n, p in module.named_parameters() if not is_lazy(p)]
    entries = list(zip(user_names(module, [n for n, _ in named]), [p for _, p in named]))
    if validate:
        if not entries and not any(is_lazy(p) for p in module.parameters()):
            raise ValueError(
                f"model ({type(module).__name__}) has no parameters: named_parameters() is empty, so "
                "there is nothing to monitor; pass the module that holds the trainable weights"
            )
        for name, p in entries if not meta else ():
            if p.device.type == "meta":
                raise ValueError(
                    f"parameter {name!r} is on the meta device and holds no data; materialise the "
                    "model first (model.to_empty(device=...) and initialise the weights) and then "
                    "monitor it"
                )
    return entries


def is_lazy(p) -> bool:
    """A lazy module's parameter before its first forward (no shape, no data yet)."""
    return nn.parameter.is_lazy(p)


def lazy_names(model: nn.Module) -> list[str]:
    root = unwrap(model)
    return user_names(root, [n for n, p in root.named_parameters() if is_lazy(p)])


@dataclass
class Selection:
    """The parameters one check judges: every parameter, or one optimizer's and those of no
    optimizer (so NOT_IN_OPTIMIZER is found whatever the number of optimizers)."""

    ids: list[int] | None  # the optimizer's parameter ids, in order (None: every parameter)
    idx: list[int]  # entry indices judged
    names: list[str]
    opt_ids: set[int] | None
    key: tuple | None = None  # the optimizers' param_groups it was made for


class LiveMeta(Mapping):
    """name -> :class:`ParamMeta`, read from the parameter when asked: ``model.double()`` or
    ``.to(device)`` keep the Parameter objects and change their data, and the meta follows."""

    def __init__(self, entries):
        self._params = dict(entries)

    def __getitem__(self, name: str) -> ParamMeta:
        p = self._params[name]
        return ParamMeta(p.numel(), str(p.dtype).replace("torch.", ""), str(p.device))

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class ParamView:
    """``named_parameters()`` of the model (wrappers unwrapped, tied parameters once), indexed."""

    def __init__(self, model: nn.Module, optimizers: list, experts=None, strict: bool = False):
        # strict (at setup): a meta parameter is a clear error; attached later, it is named at every check
        entries = named_parameters(model, meta=not strict)
        #: parameters on the meta device (no data): left out, and named at every check
        self.meta_names = [n for n, p in entries if p.device.type == "meta"]
        self.entries = [(n, p) for n, p in entries if p.device.type != "meta"] if self.meta_names else entries
        self.optimizers = optimizers
        self.names = [n for n, _ in self.entries]
        self.params = [p for _, p in self.entries]
        self.pids = [id(p) for p in self.params]
        self.meta = LiveMeta(self.entries)
        #: modules in order of first parameter, and the module (index) of each entry
        self.modules = list(dict.fromkeys(module_of(n) for n in self.names))
        slot = {m: k for k, m in enumerate(self.modules)}
        self.module_index = [slot[module_of(n)] for n in self.names]
        #: the entries of each module as a ``slice`` when every module's entries are consecutive (the
        #: usual ``named_parameters()`` order), else None
        mi = self.module_index
        self.module_runs = ([slice(mi.index(k), len(mi) - mi[::-1].index(k)) for k in range(len(self.modules))]
                            if all(a <= b for a, b in zip(mi, mi[1:])) else None)
        everything = list(range(len(self.entries)))
        self.everything = Selection(None, everything, self.names, None)
        self._selections: dict[int, Selection] = {}
        self._ids_key: tuple | None = None
        self._ids: set[int] | None = None
        self.all_inside = True  # (with optimizer_ids) every parameter is in some optimizer
        #: stacked-expert tensors by entry index (:mod:`.experts`); declared patterns in either spelling
        self.stacks = find_stacks(unwrap(model), self.entries, respell(model, experts) if isinstance(experts, dict) else experts)
        self._model = weakref.ref(model)
        self._spelled: dict = {}
        #: names of the parameters that can never train (:func:`cannot_train`): never FROZEN trouble
        self.cannot_train = cannot_train(model, self.entries)  # (the model as given: a framework's layer API is on it)

    def __len__(self) -> int:
        return len(self.entries)

    def spelled(self, patterns: tuple[str, ...] | None) -> tuple[str, ...] | None:
        """The user's name ``patterns`` as they match this view's names, written with a wrapper's or
        holder's prefix or without it (:func:`.wrappers.respell`); worked out once per view."""
        if not patterns:
            return patterns
        got = self._spelled.get(patterns)
        if got is None:
            model = self._model()
            got = self._spelled[patterns] = respell(model, patterns) if model is not None else patterns
        return got

    def optimizer_index(self, optimizer) -> int:
        for i, o in enumerate(self.optimizers):
            if o is optimizer:
                return i
        n = len(self.optimizers)
        theirs = "the monitor's optimizer" if n == 1 else f"one of the monitor's {n} optimizers"
        raise ValueError(f"check(optimizer=...) got a {type(optimizer).__name__} object that is not {theirs}: "
                         "pass an optimizer given to GradHealth(model, optimizer)")

    def selection(self, optimizer=None) -> Selection:
        """Every parameter, or (``optimizer`` given) that optimizer's plus those in no optimizer;
        cached while the param_groups hold."""
        if optimizer is None:
            return self.everything
        everywhere = self.optimizer_ids()
        sel = self._selections.get(id(optimizer))
        if sel is not None and sel.key is self._ids_key:  # (the key is replaced at any change of any group)
            return sel
        ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
        if sel is None or sel.ids != ids or sel.key != self._ids_key:
            self.optimizer_index(optimizer)  # one of ours?
            members = set(ids)
            idx = [i for i, pid in enumerate(self.pids) if pid in members or pid not in everywhere]
            sel = Selection(ids, idx, [self.names[i] for i in idx], members, self._ids_key)
            self._selections[id(optimizer)] = sel
        return sel

    def optimizer_ids(self) -> set[int] | None:
        """ids of every parameter in the optimizers (None without any), recomputed only when
        their param_groups change."""
        if not self.optimizers:
            return None
        # exact (in-place edits too); raw addresses compare without touching 400 int objects
        key = [array("Q", map(id, g["params"])) for o in self.optimizers for g in o.param_groups]
        if key != self._ids_key:
            self._ids_key, self._ids = key, optimizer_param_ids(self.optimizers)
            self.all_inside = self._ids.issuperset(self.pids)
        return self._ids


class ModelChanges:
    """Whether the model's parameters may have changed since the view was built.

    torch's global registration hooks fire whenever any module registers a parameter or a
    submodule (a head attached, a module replaced, ``load_state_dict(assign=True)``): when the
    module is one of this model's, that marks the view stale, and it is rebuilt at the next check;
    nothing is paid per check while nothing changes. A container made in a forward is not the
    model's (Hugging Face's ``self.layers[:n]`` builds a new ``ModuleList`` of the model's layers at
    every forward: each of them registered into it, none into the model). A module built since the
    last check that is still alive at this one (``newcomers``) is looked for in the model: placed
    there without a registration of the model's (``Sequential.insert``, ``_modules[name] = m``), it
    marks the view stale too. Lazy parameters materialised by their first forward are looked at by
    name (few).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.dirty = False
        self.ours = _module_ids(model)  # (None: not a torch module; any registration marks it)
        self.newcomers: weakref.WeakSet = weakref.WeakSet()  # modules built since the last check
        self._verified: set[str] = set()  # the problems' names looked up (:meth:`_verify`)
        self.lazy = lazy_names(model)
        #: per lazy parameter name: checks in a row at which it was still uninitialised although
        #: its optimizer stepped since the check before (:meth:`judge_lazy`)
        self.lazy_gaps: dict[str, int] = {}
        self._steps_seen = 0
        _install()
        _LIVE.add(self)

    def _verify(self, report, view) -> None:
        """A problem (NO_GRAD; NOT_IN_OPTIMIZER with a gradient left from before) may be a parameter
        the model no longer holds: a layer deleted (``del model.layers[1]``, ``ModuleList.pop``)
        fires no hook. Each name is looked up the first time it is such a problem (an expert idle now
        and then, a layer dropped at random: once each): one that the model holds no more marks the
        view stale."""
        status = report.status  # (a ZERO_GRAD or NaN gradient came from this backward: a layer still there)
        gone = compress(report.not_ok, map(_GONE.__contains__, map(status.__getitem__, report.not_ok)))
        new = list(filterfalse(self._verified.__contains__, gone))
        if not new:
            return
        self._verified.update(new)  # (a name that is no path in the model: one rebuild, not one a check)
        root, held = unwrap(self.model), dict(zip(view.names, view.params))
        for n in new:
            try:
                same = root.get_parameter(n) is held.get(n)
            except (AttributeError, TypeError):  # (a name that is not a path in the model: looked at afresh)
                same = False
            if not same:
                self.dirty = True
                return

    def note_lazy(self) -> None:
        if self.lazy:
            logging.getLogger("gradhealth").info("lazy parameters not materialised yet, left out until their first "
                                                 "forward: %s", ", ".join(self.lazy))

    def stale(self, report=None, view=None) -> bool:
        """Rebuild the view now? (``report``, ``view``: the last check's, for :meth:`_verify`)"""
        if self.lazy and lazy_names(self.model) != self.lazy:
            self.dirty = True
        try:  # (a model that cannot be walked or looked up now: judged as it is, the run goes on)
            if not self.dirty and report is not None and report.not_ok and not self._verified.issuperset(report.not_ok):
                self._verify(report, view)  # (every name looked up already: nothing new to look up)
            if self.newcomers.data and self.newcomers:  # (a forward's temporary containers are gone by now: usually
                # none left; the WeakSet's raw set first: its own len() runs Python)
                ours = _module_ids(self.model)
                self.dirty = self.dirty or any(id(m) in ours for m in self.newcomers)
        except Exception:
            pass
        finally:
            if self.newcomers.data:
                self.newcomers.clear()
        if not self.dirty:
            return False
        self.dirty, self.lazy, self.ours = False, lazy_names(self.model), _module_ids(self.model)
        return True

    def judge_lazy(self, optimizers: list, total_steps: int, patience: int, step: int) -> list[Finding]:
        """A lazy parameter that is still uninitialised while its optimizer keeps stepping: its
        module never ran. Named (NO_GRAD) once that has lasted ``patience`` checks with a step between."""
        stepped, self._steps_seen = total_steps > self._steps_seen, total_steps
        held = optimizer_param_ids(optimizers) if optimizers else set()
        lazy = dict(zip(self.lazy, (p for _, p in _lazy_params(self.model))))
        gaps = {n: self.lazy_gaps.get(n, 0) + stepped for n, p in lazy.items() if id(p) in held}
        self.lazy_gaps = gaps
        names = [n for n, g in gaps.items() if g >= patience]
        if not names:
            return []
        modules = list(dict.fromkeys(module_of(n) for n in names))
        return [Finding(FindingKind.META_PARAM,
                        f"NO_GRAD: {', '.join(names)} of lazy module{agree(modules, 's', '')} {', '.join(map(repr, modules))} "
                        f"{agree(names, 'are', 'is')} still uninitialised after {max(gaps[n] for n in names)} checks at "
                        f"which {agree(names, 'their', 'its')} optimizer stepped: the lazy module never ran (no batch "
                        "reached it), so it has no weights and cannot train. Run it once on a dummy batch before "
                        "training if it should train (a PyTorch Geometric relation that no batch holds, a branch "
                        "never taken), or leave it out of the model and the optimizer",
                        params=tuple(names), step=step, data={"status": "NO_GRAD", "lazy": True})]

    def close(self) -> None:
        _LIVE.discard(self)
        if not _LIVE:  # the last live monitor: the global hooks go with it
            while _HOOKS:
                _HOOKS.pop().remove()


def cannot_train(root: nn.Module, entries) -> frozenset[str]:
    """Names of parameters that can never train, by rule: a dtype that is not floating point or
    complex (no gradient exists for it: a seed generator's int32 state, a step counter), and a
    framework's non-trainable *state*: a tensor a layer that itself trains declares non-trainable
    (the Keras layer API, ``trainable`` and ``non_trainable_variables``, whose variables Keras
    registers as torch Parameters: BatchNorm's moving statistics). A layer frozen on purpose
    (``trainable`` False) declares all its variables non-trainable: those stay ordinary frozen
    parameters, for ``expect_frozen`` to judge."""
    state, frozen, seen = set(), set(), set()
    stack = list(root.modules())
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        try:
            trainable, declared = getattr(layer, "trainable", None), getattr(layer, "non_trainable_variables", None)
            if not isinstance(trainable, bool) or not isinstance(declared, (list, tuple)):
                continue
            (state if trainable else frozen).update(id(getattr(v, "value", v)) for v in declared)
            inner = getattr(layer, "layers", None)
            if isinstance(inner, (list, tuple)):  # (nested layers that are not torch submodules)
                stack.extend(inner)
        except Exception:  # (a framework's property that cannot be read now: nothing declared)
            continue
    state -= frozen
    return frozenset(n for n, p in entries if not (p.is_floating_point() or p.is_complex()) or id(p) in state)


def _lazy_params(model: nn.Module) -> list:
    return [(n, p) for n, p in unwrap(model).named_parameters() if is_lazy(p)]


_GONE = (Status.NO_GRAD, Status.NOT_IN_OPTIMIZER)  # the states a deleted layer's parameters take


# One pair of global hooks for the whole process, however many monitors: each registration marks
# every live view stale (monitors that are never closed cost nothing once garbage-collected).
_LIVE: weakref.WeakSet = weakref.WeakSet()
_HOOKS: list = []


def _mark_all(module, *_args) -> None:
    """(a registration on ``module``) Every live view of a model that holds ``module`` is stale."""
    for changes in list(_LIVE):
        if changes.ours is None or id(module) in changes.ours:
            changes.dirty = True
        elif not changes.dirty:
            changes.newcomers.add(module)


def _module_ids(model) -> set[int] | None:
    """ids of every module of ``model`` (the wrapper's and the wrapped model's), or None."""
    inner = unwrap(model)
    if not isinstance(model, nn.Module) and not isinstance(inner, nn.Module):
        return None
    return {id(m) for root in (model, inner) if isinstance(root, nn.Module) for m in root.modules()}


def _install() -> None:
    if not _HOOKS:
        said: set = set()  # (looked up at each call: the one function both hooks run)
        mark = guarded(lambda *args: _mark_all(*args), "parameter registration hook", said)
        _HOOKS.append(module_hooks.register_module_parameter_registration_hook(mark))
        _HOOKS.append(module_hooks.register_module_module_registration_hook(mark))
