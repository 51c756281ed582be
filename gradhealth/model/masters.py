"""Optimizers that train the model through copies of its parameters: master weights, flat partitions.

Mixed precision and ZeRO wrap a torch optimizer that never sees the model's parameters: DeepSpeed's
ZeRO optimizers (stages 1-3) and its fp16/bf16 optimizers, Apex's and Megatron's mixed-precision
optimizers step fp32 *masters* (one per parameter, or flat partitions holding a slice of each) and
copy them back into the model. Their ``param_groups`` hold the masters, so every model parameter
would read as NOT_IN_OPTIMIZER; the gradients live in the wrapper's buffers (:mod:`.gradients`); and
a step the wrapper decides to skip (its overflow check found inf/NaN) never reaches the inner
optimizer.

The rule that recognises the family, with no class name looked at: an object with ``param_groups``
whose inner ``.optimizer`` (the torch optimizer that steps) holds none of the tensors the wrapper
lists, in an attribute of its own, as groups of ``nn.Parameter`` (DeepSpeed's ``bit16_groups`` /
``fp16_groups``, Apex's ``fp16_groups``). Such a wrapper is presented to the monitor as a
:class:`MasterView`: an optimizer whose ``param_groups`` hold the model's parameters (with the
inner groups' live hyperparameters) and whose step is the wrapper's: its step hooks run once around
the wrapper's ``step()`` (ZeRO-1/2 step the inner optimizer once per param group), and a step in
which the inner optimizer never ran (*skipped by the wrapper*) is flagged like a fused step a grad
scaler skipped, so the check names it (:func:`gradhealth.judge.judges.optimizer_skip`).

Each parameter's master, where the step really lands (what the update numbers measure): the fp32
fragment a ZeRO-1/2 or bf16 optimizer maps it to (``_hp_mapping``; an empty tensor on a rank that
holds none of it), a ZeRO-3 parameter's local fp32 partition, or the tensor at the same position of
a wrapper's parallel groups of masters (``fp32_groups``); else the parameter itself.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from ..base.hooks import guarded
from .foreign import StepView

__all__ = ["MasterView", "Masters", "LossScale", "find_view", "view_for", "master_of"]

_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # wrapper -> its view (one per wrapper)


def _groups_of_params(value) -> list[list[nn.Parameter]] | None:
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(g, (list, tuple)) for g in value):
        return None
    flat = [p for g in value for p in g]
    if not flat or not all(isinstance(p, nn.Parameter) for p in flat):
        return None
    return [list(g) for g in value]


def find_view(optimizer) -> MasterView | None:
    """A :class:`MasterView` of ``optimizer`` when it is such a wrapper (see the module's docstring),
    else None."""
    inner = getattr(optimizer, "optimizer", None)
    if inner is None or inner is optimizer or not callable(getattr(inner, "register_step_post_hook", None)):
        return None
    groups = getattr(inner, "param_groups", None)
    if not isinstance(groups, list):
        return None
    held = {id(p) for g in groups for p in g["params"]}
    best: list[list[nn.Parameter]] | None = None
    try:
        attrs = list(vars(optimizer).values())
    except TypeError:
        return None
    for value in attrs:
        found = _groups_of_params(value)
        if found and not any(id(p) in held for g in found for p in g):
            if best is None or sum(map(len, found)) > sum(map(len, best)):
                best = found
    return MasterView(optimizer, inner, best) if best else None


def view_for(optimizer) -> MasterView | None:
    """The one :class:`MasterView` of ``optimizer`` (made at the first call), or None."""
    try:
        view = _VIEWS.get(optimizer)
    except TypeError:  # (not weak-referenceable: not such a wrapper)
        return None
    if view is None or view.closed:
        view = find_view(optimizer)
        if view is not None:
            _VIEWS[optimizer] = view
    return view


def _parallel_masters(wrapper, groups: list[list[nn.Parameter]], held: set[int]) -> dict[int, Tensor]:
    """Masters by position: an attribute of the wrapper shaped like ``groups`` (same lengths, same
    shapes) whose tensors the inner optimizer holds (Apex's and DeepSpeed's ``fp32_groups``); or one
    flat tensor per group that the inner optimizer holds, as long as the group's parameters together,
    each master a slice of it in the group's order (DeepSpeed's fused ``FP16_Optimizer``, which bf16
    without ZeRO takes with a ``FusedAdam``: ``fp32_groups_flat``, the parameters flattened with no
    padding)."""
    for value in vars(wrapper).values():
        if not isinstance(value, (list, tuple)) or len(value) != len(groups):
            continue
        if all(isinstance(t, Tensor) and t.dim() == 1 and id(t) in held and t.numel() == sum(p.numel() for p in m)
               for t, m in zip(value, groups)):
            out = {}
            for flat, m in zip(value, groups):
                for p, piece in zip(m, flat.split([p.numel() for p in m])):
                    out[id(p)] = piece.view(p.shape)
            return out
        if not all(isinstance(g, (list, tuple)) and len(g) == len(m) for g, m in zip(value, groups)):
            continue
        pairs = [(p, t) for m, g in zip(groups, value) for p, t in zip(m, g)]
        if pairs and all(isinstance(t, Tensor) and id(t) in held and t.shape == p.shape for p, t in pairs):
            return {id(p): t for p, t in pairs}
    return {}


def master_of(p: Tensor, parallel: dict[int, Tensor] | None = None) -> Tensor:
    """The tensor a step of ``p``'s optimizer really writes for ``p`` on this rank (see the module's
    docstring): a fragment or partition of a master, the master, or ``p`` itself."""
    mapping = getattr(p, "_hp_mapping", _MISSING)
    if mapping is not _MISSING:  # ZeRO-1/2 and bf16 optimizers: a fragment of a flat fp32 partition
        if mapping is None:
            return torch.empty(0, dtype=torch.float32, device=p.device)  # (held by other ranks)
        return mapping.hp_fragment
    z3 = getattr(p, "_z3_optimizer", None)
    if z3 is not None and hasattr(p, "ds_id"):  # ZeRO-3: this rank's fp32 partition
        got = z3.get_local_fp32_param(p)
        if got is not None:
            return got
    if parallel:
        got = parallel.get(id(p))
        if got is not None:
            return got
    return p


_MISSING = object()


class LossScale:
    """A wrapper's own loss scale (DeepSpeed's fp16 optimizers: dynamic, or static but not 1), read
    as the monitor reads a torch GradScaler's: the gradients a check reads are still multiplied by
    it (the wrapper unscales inside its step), a check that finds them non-finite under a dynamic
    scale is the scale settling (AMP_SKIPPED, info), and the steps it skips are the scaler's."""

    _per_optimizer_states: dict = {}  # (nothing is unscaled before the wrapper's own step)

    def __init__(self, view: MasterView):
        self.view = view

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self.view.loss_scale() or 1.0

    @property
    def _scale(self) -> Tensor:
        return torch.tensor([self.get_scale()], dtype=torch.float32)


class Masters:
    """A monitor's optimizers that train through masters (their :class:`MasterView` s), and what the
    monitor asks of them together."""

    def __init__(self, optimizers: list):
        self.views = [x for x in optimizers if isinstance(x, MasterView)]
        self.foreign = [x for x in optimizers if isinstance(x, StepView)]  # (their step put back at close)

    def loss_scale(self) -> LossScale | None:
        """The first view's own loss scale, when it scales (dynamic, or static but not 1)."""
        for v in self.views:
            scale = v.loss_scale()
            if scale is not None and (v.skip_info()["dynamic"] or scale != 1.0):
                return LossScale(v)
        return None

    def held(self):
        """For the update tracker: parameter -> the tensor its optimizer's step writes (None: every
        parameter is its own, the default)."""
        if not self.views:
            return None
        from ..base.distributed import to_local

        views = self.views

        def held(p: Tensor) -> Tensor:
            for v in views:
                got = v.masters().get(id(p))
                if got is not None:
                    return got.detach()
            return to_local(p.detach())

        return held

    def attach(self, tracker) -> None:
        """A wrapper's step no check read first: its gradients' norms, for the check after it."""
        for v in self.views:
            v.unread_step = tracker.ran.capture

    def checked(self, after_step: bool) -> None:
        """A check read the gradients (``after_step``: those of a step that already ran)."""
        for v in self.views:
            v.read = not after_step

    def close(self) -> None:
        for v in self.views:
            v.close()
        for v in self.foreign:
            v.close()
        self.views, self.foreign = [], []


class _Handle:
    def __init__(self, hooks: dict, key: int):
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)


class MasterView:
    """The wrapper as the monitor sees it: ``param_groups`` of the model's parameters, the inner
    optimizer's step hooks, and a step the wrapper skipped flagged (``found_inf`` 1.0 while its
    hooks run), with what the wrapper said about it (:meth:`skip_info`)."""

    _step_supports_amp_scaling = True  # (its found_inf flags a skipped step, as a fused step's does)

    def __init__(self, wrapper, inner, groups: list[list[nn.Parameter]]):
        self.wrapper, self.inner = wrapper, inner
        self._model_groups = groups
        inner_groups = inner.param_groups
        self._groups = [{**(inner_groups[k] if k < len(inner_groups) else inner_groups[0]), "params": g}
                        for k, g in enumerate(groups)] if inner_groups else [{"params": g} for g in groups]
        self.state: dict = {}  # (the masters' state is the inner optimizer's)
        self.found_inf = torch.zeros(1)
        self.steps = 0  # the wrapper's steps, and how many of them it skipped
        self.skips = 0
        self.skips_in_a_row = 0
        self._pre: dict[int, object] = {}
        self._post: dict[int, object] = {}
        self._next = 0
        self._inner_steps = 0
        self._masters: dict[int, Tensor] | None = None
        self.closed = False
        #: a check read this step's gradients before the step (the usual order). A step that comes
        #: first (Accelerate's and the HF Trainer's DeepSpeed backward: ``engine.backward`` then
        #: ``engine.step`` in one call, the check after it) frees them: ``unread_step(view)`` is
        #: called at its start to take their norms for the check that follows (:mod:`gradhealth.measure.ranon`)
        self.read = False
        self.unread_step = None
        self._handles = [inner.register_step_post_hook(guarded(self._inner_post, "inner optimizer's step hook"))]
        self._patched = "step" not in vars(wrapper)
        if self._patched:
            original = wrapper.step

            def step(*args, **kwargs):
                if not self.read and self.unread_step is not None:  # (a one-call step: see ``read``)
                    try:
                        self.unread_step(self)
                    except Exception:  # inside the user's step: never break it
                        pass
                self._run(self._pre, args, kwargs)
                before = self._inner_steps
                try:
                    return original(*args, **kwargs)
                finally:
                    self.read = False
                    self._wrapper_stepped(self._inner_steps == before, args, kwargs)

            wrapper.step = step

    @property
    def param_groups(self) -> list[dict]:
        inner_groups = self.inner.param_groups
        for k, g in enumerate(self._groups):  # live hyperparameters (a scheduler writes the inner groups)
            src = inner_groups[k] if k < len(inner_groups) else (inner_groups[0] if inner_groups else {})
            for key, value in src.items():
                if key != "params":
                    g[key] = value
        return self._groups

    def masters(self) -> dict[int, Tensor]:
        """Per model parameter id, the tensor the step writes for it (:func:`master_of`)."""
        if self._masters is None:
            held = {id(p) for g in self.inner.param_groups for p in g["params"]}
            parallel = _parallel_masters(self.wrapper, self._model_groups, held)
            self._masters = {id(p): master_of(p, parallel) for g in self._model_groups for p in g}
        return self._masters

    def skip_info(self) -> dict:
        """What the wrapper says about its last skipped step: its name, whether its loss scale is
        dynamic (an overflow that lowers it), the scale, and the counts."""
        w = self.wrapper
        dynamic = getattr(w, "dynamic_loss_scale", None)
        if dynamic is None:
            dynamic = getattr(getattr(w, "loss_scale_config", None), "dynamic_loss_scale", None)
        if dynamic is None:
            dynamic = getattr(getattr(w, "loss_scaler", None), "dynamic", False)
        return {"optimizer": type(w).__name__, "dynamic": bool(dynamic), "scale": self.loss_scale(), "steps": self.steps,
                "skips": self.skips, "in_a_row": self.skips_in_a_row}

    def loss_scale(self) -> float | None:
        """The scale the wrapper multiplies the loss by (None: it has none)."""
        w = self.wrapper
        for value in (getattr(getattr(w, "loss_scale_config", None), "cur_scale", None), getattr(w, "cur_scale", None),
                      getattr(w, "loss_scale", None)):
            if isinstance(value, Tensor) and value.numel() == 1:
                value = float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return None

    def register_step_pre_hook(self, hook) -> _Handle:
        self._next += 1
        self._pre[self._next] = hook
        return _Handle(self._pre, self._next)

    def register_step_post_hook(self, hook) -> _Handle:
        self._next += 1
        self._post[self._next] = hook
        return _Handle(self._post, self._next)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wrapper.zero_grad(set_to_none=set_to_none)

    def step(self, *args, **kwargs):
        return self.wrapper.step(*args, **kwargs)

    def _run(self, hooks: dict, args, kwargs) -> None:
        for hook in list(hooks.values()):
            hook(self, args, kwargs)

    def _inner_post(self, _opt, _args, _kwargs) -> None:
        self._inner_steps += 1  # (ZeRO-1/2 step the inner optimizer once per param group: counted, not passed on)

    def _wrapper_stepped(self, skipped: bool, args, kwargs) -> None:
        """The wrapper's step is the step: its hooks run once around it, and a step in which the
        inner optimizer never ran is flagged as skipped."""
        self.steps += 1
        if skipped:
            self.skips += 1
            self.skips_in_a_row += 1
            self.found_inf.fill_(1.0)  # (read by the hooks below: the step that did not run)
        else:
            self.skips_in_a_row = 0
        try:
            self._run(self._post, args, kwargs)
        finally:
            self.found_inf.fill_(0.0)

    def close(self) -> None:
        self.closed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._patched and "step" in vars(self.wrapper):
            del self.wrapper.step
            self._patched = False
