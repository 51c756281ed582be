"""Loss-side guards: is this loss able to produce gradients at all, and if not, why; the forward watch that
sees what the loss alone cannot (grad mode, the modules run in eval(), a reentrant checkpoint, the loop's calls
and the router's tokens, recorded as a :class:`~gradhealth.measure.observe.ForwardRecord`); and the findings
of the eval-mode idioms taken as intended (frozen BatchNorm, ``norm_eval``)."""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections.abc import Collection

import torch
from torch import Tensor, nn

from ..base.errors import GradModeError
from ..base.findings import Finding, FindingKind
from ..base.hooks import guarded
from ..base.naming import ROOT
from ..model.checkpointing import _in_reentrant_checkpoint, checkpoint_cut, reentrant_checkpointing, uses_checkpointing
from ..model.modes import mode_matters, reads_training
from ..measure.observe import ForwardRecord

__all__ = ["ForwardWatch", "diagnose_loss", "check_loss", "uses_checkpointing", "reads_training",
           "mode_matters", "reentrant_checkpointing", "checkpoint_cut", "frozen_norms", "norm_eval", "norm_idioms"]

_CUT_HINT = (
    "the graph was cut between the model and the loss: look for .detach(), .data, .item(), "
    ".numpy()/.tolist(), or a value re-wrapped with torch.tensor(...)/torch.as_tensor(...) on "
    "the way from the model's output to the loss"
)


_TRAINING = operator.attrgetter("training")


@functools.lru_cache(maxsize=None)
def _record(grad_enabled: bool, inference: bool, training: bool) -> ForwardRecord:
    """The forward's record (frozen: one instance per combination, not one per forward)."""
    return ForwardRecord(grad_enabled, inference, training)


def diagnose_loss(loss, model: nn.Module | None = None, forward: ForwardRecord | None = None) -> str | None:
    """Why ``loss.backward()`` cannot train ``model``, or None for a healthy loss.

    Looks only at Python-side attributes (no host synchronisation). The causes are tried in the
    order a person would look: type, shape, grad mode, inference mode, frozen parameters, a cut
    graph. ``forward`` (what the monitor saw during the forward) makes the answer precise where the
    loss alone cannot tell a no_grad forward from a detached output.
    """
    if not isinstance(loss, Tensor):
        what = type(loss).__name__
        extra = (
            " A Python number usually means .item() or float() was called on the loss: keep the "
            "tensor for backward() and call .item() only for logging."
            if isinstance(loss, (int, float))
            else ""
        )
        return f"the loss is a {what}, not a torch.Tensor.{extra}"
    if loss.numel() != 1:
        return (
            f"the loss has shape {tuple(loss.shape)}, not a single value: reduce it first "
            "(loss.mean() or loss.sum()) before backward()"
        )
    if loss.requires_grad:
        if loss.grad_fn is None and not (model is not None and any(loss is p for p in model.parameters())):
            return ("the loss is a leaf tensor: it requires grad but has no grad_fn, so it was cut from the model and "
                    "made to require grad again (loss.detach().requires_grad_(), or torch.tensor(loss.item(), "
                    "requires_grad=True)); backward() then reaches no parameter. Remove the .detach() and the "
                    "re-wrapping: keep the graph from the model's output to the loss")
        return None
    if forward is not None:
        if forward.inference:
            return (
                "the model's forward ran under torch.inference_mode(): tensors made there can never "
                "require grad. Run the training forward outside inference_mode (it is for evaluation only)."
            )
        if not forward.grad_enabled:
            return (
                "the model's forward ran with grad mode disabled (torch.no_grad() or "
                "torch.set_grad_enabled(False) around it, often an evaluation helper that did not "
                "restore it): run the training forward with grad enabled."
            )
    if loss.is_inference() or torch.is_inference_mode_enabled():
        return (
            "the loss was computed in torch.inference_mode(): tensors made there can never require "
            "grad. Run the training forward outside inference_mode (it is for evaluation only)."
        )
    if not torch.is_grad_enabled():
        return (
            "grad mode is disabled here (torch.no_grad() or torch.set_grad_enabled(False) is "
            "active): run the training forward and backward with grad enabled."
        )
    if model is not None:
        params = list(model.parameters())
        if params and not any(p.requires_grad for p in params):
            return (
                f"every parameter of the model ({len(params)} tensor{'' if len(params) == 1 else 's'}) has requires_grad=False, so "
                "nothing can get a gradient: unfreeze what should train (requires_grad_(True))."
            )
    if forward is not None:
        return "the loss does not require grad although the forward ran with grad enabled: " + _CUT_HINT + "."
    return (
        "the loss does not require grad. Either the forward ran under torch.no_grad() (an "
        "evaluation helper or a no_grad block around the forward), or " + _CUT_HINT + ". (With a "
        "gh.GradHealth monitor on the model, gh.check_loss(loss, model) tells which.)"
    )


#: model -> the carry of the monitor that watches its forward (its ``forward`` record): what lets
#: ``check_loss(loss, model)`` tell a no_grad forward from a cut graph
_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_loss(loss, model: nn.Module | None = None) -> None:
    """Raise `GradModeError` naming why `loss` cannot train `model`; else return None.

    A loss that does not require grad after a `torch.no_grad()` forward looks like one whose graph
    was cut (a `.detach()`): when a `gradhealth.GradHealth` monitor watches `model`, what it saw of
    the forward names which; without one, both are named.
    """
    carry = _WATCHED.get(model) if model is not None else None
    cause = diagnose_loss(loss, model, getattr(carry, "forward", None))
    if cause is not None:
        raise GradModeError(f"gradhealth: loss cannot produce gradients: {cause}")


_NORMS = (nn.modules.batchnorm._BatchNorm,)
_DROPOUT_OR_NORM = (nn.modules.dropout._DropoutNd, nn.AlphaDropout, *_NORMS)
def _first_grad_tensor(output) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output] if output.requires_grad else []
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for o in items:
        found = _first_grad_tensor(o)
        if found:
            return found
    return []


#: a model output of at most this many elements is kept until the check, its gradient retained by
#: autograd: no kernel in the forward, no Python in the backward; a larger one is reduced to its max |x|
#: in the forward, its gradient in a hook (a kernel each, small beside the step that made them)
KEEP_OUTPUT = 1 << 16


def output_maxima(seen) -> tuple[Tensor, Tensor] | None:
    """(max |output|, max |gradient reaching it|) over the forwards since the last check (the forward
    watch's ``carry.output_grad``), on the device; None when no backward reached an output."""
    pairs = []
    for item in seen or ():
        if isinstance(item, Tensor):
            if item.grad is not None:
                pairs.append((_largest(item.detach()), _largest(item.grad)))
        else:
            pairs.append(item)
    if not pairs:
        return None
    if len(pairs) == 1:
        return pairs[0]
    return torch.stack([a for a, _ in pairs]).amax(), torch.stack([b for _, b in pairs]).amax()


def _largest(t: Tensor) -> Tensor:
    """max |t| as a 0-d device tensor, in one kernel: finite exactly when every element is (NaN
    propagates); 0 for an empty tensor."""
    return torch.linalg.vector_norm(t, math.inf) if t.numel() else t.new_zeros((), dtype=torch.float32)


class ForwardWatch:
    """What the training forward really ran (Python state only, no sync), with two hooks on the
    model in a healthy run.

    * on the model: its grad mode and inference mode, and whether it was in training mode, in
      ``carry.forward`` (for the loss diagnosis);
    * the model, its direct children and every dropout / batch-norm module wherever it sits (a
      LightningModule's inner model included) are *watched*: a pre-hook on the model (on each
      direct child of a LightningModule, whose forward Lightning never calls) reads their
      ``training`` flags (one attribute each) and, only for those found in eval() mode, puts a
      forward hook on them, kept while they stay in eval(). A module that ran in eval() mode with
      grad enabled lands in ``carry.eval_backward`` only when a backward really goes through its
      output (a hook on that output fires then, and never for validation forwards);
    * on the model's output: whether it was finite, and whether the gradient reaching it was
      (``carry.output_grad``: a small output itself, its gradient retained by autograd, else the two
      max |x| as 0-d device tensors; read only at a check with NaN/inf gradients: a finite output
      with a NaN gradient means the NaN was made in the loss).

    Which of the modules in eval() mode that ran compute differently for it (:func:`mode_matters`:
    dropout with p > 0, a norm on its running statistics, a forward that reads ``self.training``) is
    kept with the record (``readers``): every module whose forward reads ``training`` is watched too.
    A model in eval() in which none did computed what train() mode computes: said as a warning.

    Normalisation layers in eval() mode are intended idioms, not eval-mode mistakes: with frozen
    (or no) affine parameters, frozen-BatchNorm fine-tuning (``carry.frozen_norms``); with
    trainable ones, ``norm_eval`` (detection backbones) and QAT's ``freeze_bn_stats``
    (``carry.norm_eval``). The model itself, a direct child that is not a normalisation layer, or
    a dropout module in eval() during a training backward stays a GRAD_MODE error. A module that
    runs with grad disabled inside a training model under a reentrant ``torch.utils.checkpoint``
    is kept in ``cut`` and sets ``carry.reentrant`` (for CHECKPOINT_NO_GRAD: :func:`checkpoint_cut`):
    looked for by hooks on the direct children and the NO_GRAD parameters' modules during the
    forwards after a check that found NO_GRAD parameters (``probe``), the only time the answer is used.
    """

    def __init__(self, model: nn.Module, module: nn.Module, carry, experts: bool = False, calls: bool = False):
        self.carry = carry
        self.root = module
        self._models = (model, module)
        for m in self._models:
            _WATCHED[m] = carry  # (gh.check_loss(loss, model) reads the forward's record)
        self.experts = experts  # stacked experts were found: count the tokens the router sends them
        cfg = getattr(module, "config", None)
        self.top_k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "moe_topk", None)
        children = dict(module.named_children())
        watched = [(name, m) for name, m in module.named_modules()
                   if name == "" or name in children or isinstance(m, _DROPOUT_OR_NORM) or reads_training(type(m))]
        #: the modules in eval() mode that ran with grad in this forward and compute differently for it
        self._readers: set[str] = set()
        # where the modes are read: the model's own forward, or, for a LightningModule (its
        # training_step calls the inner modules, never its forward), each direct child's
        entries = [("", module)] if not callable(getattr(module, "training_step", None)) else list(children.items())
        from ..origin.calls import LoopCalls  # the loop's calls into the model, kept to the check (:mod:`gradhealth.origin.calls`)

        self.calls = LoopCalls(module, len(entries) == 1 and entries[0][0] == "") if calls else None
        self._names = [name or ROOT for name, _ in entries]
        self._said: set = set()  # (each hook's own failure said once: :func:`gradhealth.base.hooks.guarded`)
        self.handles = [model.register_forward_hook(guarded(self._on_model, "forward hook (the model's output)", self._said))]
        self._hooked: list[dict[int, object]] = []  # per entry: id(module) -> its hook for these forwards
        for i, (top, m) in enumerate(entries):
            under = [(n, w) for n, w in watched if not top or n == "" or n == top or n.startswith(top + ".")]
            self._hooked.append({})
            self.handles.append(m.register_forward_pre_hook(guarded(functools.partial(
                self._before, i, under, [(n, w) for n, w in under if n in children], [w for _, w in under]),
                "forward pre-hook (the modes)", self._said), with_kwargs=True))
        #: look for a reentrant checkpoint at the next forwards, in these modules (the monitor sets
        #: the modules of the NO_GRAD parameters; their forward runs inside the checkpoint, however deep)
        self.probe: set[str] = set()
        self._probed: tuple = (frozenset(), [])
        #: the probed modules seen running with grad disabled inside a reentrant checkpoint (their
        #: parameters' NO_GRAD is the checkpoint's doing), and those whose stack was looked at
        self.cut: set[str] = set()
        self.walked: set[str] = set()

    def _before(self, i: int, watched: list, children: list, modules: list, module, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return
        if self.calls is not None:
            self.calls.keep(self._names[i], module, args, kwargs)
        hooked = self._hooked[i]
        if not hooked and not self.probe and all(map(_TRAINING, modules)):
            return  # (the usual forward: everything in training mode, nothing hooked, nothing probed)
        if i == 0:
            self._readers.clear()  # (a new forward: what reads the mode is seen again)
        want = {id(m): (n, m) for n, m in watched if not m.training}
        if self.probe and self.root.training:
            want.update({id(m): (n, m) for n, m in children + self._probe_modules()})
        hooked = self._hooked[i]
        if want.keys() != hooked.keys():  # modes changed (rare): hook exactly the modules that need it
            for key in [k for k in hooked if k not in want]:
                hooked.pop(key).remove()
            for key, (name, m) in want.items():
                if key not in hooked:
                    hooked[key] = m.register_forward_hook(guarded(functools.partial(self._on_module, name),
                                                                  "forward hook (a module in eval mode)", self._said))

    def _probe_modules(self) -> list:
        key = frozenset(self.probe)
        if key != self._probed[0]:
            from ..model.wrappers import user_modules

            modules = user_modules(self.root)
            self._probed = (key, [(n, modules[n]) for n in sorted(key) if n in modules])
        return self._probed[1]

    def _on_model(self, module, args, output) -> None:
        self.carry.forward = _record(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), self.root.training)
        if torch.is_grad_enabled() and self.root.training:
            for t in _first_grad_tensor(output):  # was a NaN in the gradient before it entered the model?
                if t.numel() <= KEEP_OUTPUT and not t.is_leaf:  # kept; autograd keeps its gradient (no kernel)
                    t.retain_grad()
                    self._seen(t)
                else:
                    t.register_hook(guarded(functools.partial(self._output_grad, _largest(t.detach())),
                                            "backward hook (the output's gradient)", self._said))
        if self.experts and torch.is_grad_enabled() and self.root.training:
            from ..model.experts import router_counts

            counts = router_counts(output, self.top_k)
            if counts is not None:  # micro-batches before one check add up
                prev = self.carry.router
                self.carry.router = counts if prev is None or len(prev) != len(counts) else [
                    a + b for a, b in zip(prev, counts)]

    def _output_grad(self, out_max, grad) -> None:
        self._seen((out_max, _largest(grad)))  # no sync: read at a failing check

    def _seen(self, item) -> None:
        seen = self.carry.output_grad
        if seen is None:
            self.carry.output_grad = [item]
            return
        for k, old in enumerate(seen):  # an output no backward reached is not kept past the next forward
            if isinstance(old, Tensor) and old.grad is None:  # (its graph: no longer than the loop's own variable)
                old.register_hook(guarded(functools.partial(self._output_grad, _largest(old.detach())),
                                          "backward hook (the output's gradient)", self._said))
                seen[k] = None
        if None in seen:
            seen[:] = [s for s in seen if s is not None]
        if len(seen) >= 64:  # (many forwards between two checks: the earlier ones folded, a rare pass)
            folded = output_maxima(seen)
            seen[:] = [folded] if folded is not None else []
        seen.append(item)

    def _on_module(self, name: str, module, args, output) -> None:
        if not torch.is_grad_enabled():
            if self.root.training and name not in self.walked:  # (each module's stack looked at once)
                self.walked.add(name)
                if _in_reentrant_checkpoint():
                    self.cut.add(name)
                    self.carry.reentrant = True  # a hand-written checkpoint(..., use_reentrant=True)
            return
        if module.training:
            return
        if mode_matters(module):
            self._readers.add(name or ROOT)
        if isinstance(module, _NORMS):
            # normalisation layers alone in eval() while the rest trains: frozen BatchNorm
            # (frozen affine), or norm_eval / QAT's freeze_bn_stats (affine still training)
            frozen = not any(p.requires_grad for p in module.parameters(recurse=False))
            (self.carry.frozen_norms if frozen else self.carry.norm_eval).add(name)
            return
        for t in _first_grad_tensor(output):
            t.register_hook(guarded(functools.partial(self._backward_through, name),
                                    "backward hook (a module in eval mode)", self._said))

    def _backward_through(self, name: str, grad) -> None:
        seen = self.carry.eval_backward
        names = set(seen.eval_modules) if seen is not None else set()
        if seen is not None and not seen.training:
            names.add(ROOT)  # the model itself was seen in eval() by an earlier hook of this backward
        names.add(name or ROOT)
        self.carry.eval_backward = ForwardRecord(True, False, ROOT not in names, tuple(sorted(names - {ROOT})),
                                                 tuple(sorted(self._readers)))

    def remove(self) -> None:
        if self.calls is not None:
            self.calls.close()
        for h in [*self.handles, *(h for hooked in self._hooked for h in hooked.values())]:
            h.remove()
        for m in self._models:
            if _WATCHED.get(m) is self.carry:
                del _WATCHED[m]
        self._hooked = [{} for _ in self._hooked]


def frozen_norms(names: Collection[str], step: int) -> list[Finding]:
    """FROZEN_NORM (info): normalisation layers run in eval() mode with frozen or no affine
    parameters during training: the frozen-BatchNorm fine-tuning idiom, intended."""
    if not names:
        return []
    shown = ", ".join(sorted(names)[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return [Finding(FindingKind.FROZEN_NORM, f"{len(names)} normalisation layer{'s' if len(names) != 1 else ''} ({shown}) ran in "
                    "eval() mode with frozen affine parameters during training: the frozen-BatchNorm idiom of "
                    "fine-tuning, taken as intended (their running statistics stay fixed); not an eval-mode mistake",
                    params=tuple(sorted(names)), level="info", step=step)]


def norm_eval(names: Collection[str], step: int) -> list[Finding]:
    """FROZEN_NORM (info): normalisation layers alone in eval() mode while the rest of the model
    trains, their affine parameters still training: ``norm_eval`` (detection backbones) and QAT's
    ``freeze_bn_stats``, intended."""
    if not names:
        return []
    shown = ", ".join(sorted(names)[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return [Finding(FindingKind.FROZEN_NORM, f"{len(names)} normalisation layer{'s' if len(names) != 1 else ''} ({shown}) ran in "
                    "eval() mode while the rest of the model trained: the norm_eval / freeze_bn_stats idiom (running "
                    "statistics kept fixed on purpose, the affine parameters still training), taken as intended; not "
                    "an eval-mode mistake", params=tuple(sorted(names)), level="info", step=step)]


def norm_idioms(carry, step: int) -> list[Finding]:
    """FROZEN_NORM / the norm_eval info, each once, at the first check after such layers ran."""
    found = []
    if carry.frozen_norms and not carry.frozen_norms_said:
        found += frozen_norms(carry.frozen_norms, step)
        carry.frozen_norms_said = True
    if carry.norm_eval and not carry.norm_eval_said:
        found += norm_eval(carry.norm_eval, step)
        carry.norm_eval_said = True
    return found
