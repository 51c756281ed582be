"""Optimizers that are not torch's: found by what they have, never by their class's name.

The monitor measures a step through torch's step-hook API (``register_step_pre_hook`` /
``register_step_post_hook``). An object with ``param_groups`` (a list of dicts, each with its
``"params"``) and a callable ``step`` but without that API is used by one of two rules, in order:

1. it holds a torch optimizer over the same parameters in an attribute of its own (fastai's
   ``OptimWrapper`` around torch's ``AdamW`` holds it as ``.opt``): that optimizer is the one the
   monitor watches, its step runs inside the wrapper's;
2. otherwise its ``step`` is wrapped on the instance (as :class:`gradhealth.model.masters.MasterView`
   wraps the DeepSpeed family's): a :class:`StepView` whose ``param_groups`` are the object's own,
   read at every use (fastai's ``Optimizer`` builds them from ``param_lists`` and ``hypers`` at each
   read), and whose step hooks run around that ``step``.

Anything else is refused at construction with words that name its framework (the top-level package
of its class) and what to pass instead (:func:`refuse`).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["StepView", "held_optimizer", "foreign_view", "refuse", "has_hook_api"]

_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # object -> its StepView


def has_hook_api(opt) -> bool:
    return callable(getattr(opt, "register_step_post_hook", None)) and callable(getattr(opt, "register_step_pre_hook", None))


def _groups_ok(groups) -> bool:
    return isinstance(groups, list) and all(isinstance(g, dict) and "params" in g for g in groups)


def _param_ids(opt) -> set[int]:
    return {id(p) for g in opt.param_groups for p in g["params"]}


def held_optimizer(opt):
    """The torch optimizer ``opt`` holds in an attribute of its own, over the same parameters (rule 1), or None."""
    try:
        attrs = list(vars(opt).values())
    except TypeError:
        return None
    mine = None
    for value in attrs:
        if isinstance(value, torch.optim.Optimizer) and value is not opt:
            mine = _param_ids(opt) if mine is None else mine
            if _param_ids(value) == mine:
                return value
    return None


def foreign_view(opt):
    """The optimizer the monitor uses for ``opt`` when ``opt`` lacks torch's hook API: the torch
    optimizer it holds, else its one :class:`StepView`; ``opt`` itself when it has the API. Raises
    ``TypeError`` (:func:`refuse`) for an object that is not an optimizer the monitor can watch."""
    if has_hook_api(opt):
        return opt
    groups = getattr(opt, "param_groups", None)
    if not _groups_ok(groups) or not callable(getattr(opt, "step", None)):
        return None  # (the caller refuses it, naming the framework)
    inner = held_optimizer(opt)
    if inner is not None:
        return inner
    try:
        view = _VIEWS.get(opt)
    except TypeError:
        raise TypeError(refuse(opt, "it cannot be weakly referenced, so its step cannot be watched")) from None
    if view is None or view.closed:
        view = _VIEWS[opt] = StepView(opt)
    return view


def framework_of(obj) -> str:
    return (type(obj).__module__ or "").split(".")[0] or "an unknown library"


def refuse(opt, why: str | None = None) -> str:
    """Words for an optimizer the monitor cannot watch: its framework, why, and the alternative."""
    name, where = type(opt).__name__, framework_of(opt)
    if why is None:
        why = ("it has no torch-style param_groups (a list of dicts of torch parameters) and step(), so the monitor "
               "cannot tell which parameters it trains or when it steps")
    return (f"optimizer {name} is {where}'s optimizer ({type(opt).__module__}.{name}), not a torch optimizer, and "
            f"cannot be watched: {why}. Pass the torch optimizer it holds if it holds one, or monitor without it: "
            "gh.GradHealth(model) still judges every parameter's gradient (FROZEN, "
            "NO_GRAD, NON_FINITE_GRAD, ZERO_GRAD, norms, NaN origins) but cannot see NOT_IN_OPTIMIZER, NOT_UPDATED "
            "or a learning rate of 0, which need the optimizer's param_groups and its step")


class _Handle:
    def __init__(self, view: StepView, hooks: dict, key: int):
        self.view, self.hooks, self.key = view, hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)
        self.view._release()


class StepView:
    """An optimizer without torch's hook API, as the monitor sees it: its own ``param_groups``
    (read live) and step hooks run around its ``step``, wrapped on the instance while a hook is
    registered (and only then: ``gh.classify`` with such an optimizer leaves it untouched)."""

    def __init__(self, opt):
        self.wrapped = opt
        self._pre: dict[int, object] = {}
        self._post: dict[int, object] = {}
        self._next = 0
        self.closed = False
        self._own = None  # the instance's own ``step`` attribute before the wrap (None: the class's)
        self._patched = False

    def _patch(self) -> None:
        opt = self.wrapped
        self._own = vars(opt).get("step")
        original = opt.step

        def step(*args, **kwargs):
            for hook in list(self._pre.values()):
                hook(self, args, kwargs)
            out = original(*args, **kwargs)
            for hook in list(self._post.values()):
                hook(self, args, kwargs)
            return out

        opt.step = step
        self._patched = True

    def _release(self) -> None:
        """Put the object's own step back once no hook is left (another monitor may still hold one)."""
        if self._patched and not self._pre and not self._post:
            if self._own is None:
                vars(self.wrapped).pop("step", None)
            else:
                self.wrapped.step = self._own
            self._patched = False

    @property
    def param_groups(self) -> list[dict]:
        return self.wrapped.param_groups

    @property
    def state(self):
        return getattr(self.wrapped, "state", {})

    def _register(self, hooks: dict, hook) -> _Handle:
        self._next += 1
        hooks[self._next] = hook
        if not self._patched:
            self._patch()
        return _Handle(self, hooks, self._next)

    def register_step_pre_hook(self, hook) -> _Handle:
        return self._register(self._pre, hook)

    def register_step_post_hook(self, hook) -> _Handle:
        return self._register(self._post, hook)

    def zero_grad(self, *args, **kwargs):
        return self.wrapped.zero_grad(*args, **kwargs)

    def step(self, *args, **kwargs):
        return self.wrapped.step(*args, **kwargs)

    def close(self) -> None:
        self._release()
        self.closed = not self._patched
