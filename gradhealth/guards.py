"""Loss-side guards: is this loss able to produce gradients at all, and if not, why."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .errors import GradModeError

__all__ = ["ForwardRecord", "ForwardWatch", "diagnose_loss", "check_loss"]

_CUT_HINT = (
    "the graph was cut between the model and the loss: look for .detach(), .data, .item(), "
    ".numpy()/.tolist(), or a value re-wrapped with torch.tensor(...)/torch.as_tensor(...) on "
    "the way from the model's output to the loss"
)


@dataclass(frozen=True)
class ForwardRecord:
    """Python state seen when the model's forward last ran (recorded by the monitor's pre-hook)."""

    grad_enabled: bool
    inference: bool
    training: bool
    #: submodules with dropout or batch norm that were in eval() mode while the model ran
    eval_modules: tuple[str, ...] = ()


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
                f"every parameter of the model ({len(params)} tensors) has requires_grad=False, so "
                "nothing can get a gradient: unfreeze what should train (requires_grad_(True))."
            )
    if forward is not None:
        return "the loss does not require grad although the forward ran with grad enabled: " + _CUT_HINT + "."
    return (
        "the loss does not require grad. Either the forward ran under torch.no_grad() (an "
        "evaluation helper or a no_grad block around the forward), or " + _CUT_HINT + "."
    )


def check_loss(loss, model: nn.Module | None = None) -> None:
    """Raise :class:`GradModeError` naming why ``loss`` cannot train ``model``; else return None."""
    cause = diagnose_loss(loss, model)
    if cause is not None:
        raise GradModeError(f"gradhealth: loss cannot produce gradients: {cause}")


_DROPOUT_OR_NORM = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm, nn.AlphaDropout)


def _first_grad_tensor(output) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output] if output.requires_grad else []
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    for o in items:
        found = _first_grad_tensor(o)
        if found:
            return found
    return []


class ForwardWatch:
    """A forward hook on the model that records its grad mode and train/eval state (Python state
    only, no sync) in ``carry.forward``; a training forward in eval() mode lands in
    ``carry.eval_backward`` only when a backward really goes through it (a hook on its output
    fires then, and never for validation forwards)."""

    def __init__(self, model: nn.Module, module: nn.Module, carry):
        self.carry = carry
        self._dropout_like = [(n, m) for n, m in module.named_modules() if isinstance(m, _DROPOUT_OR_NORM)]
        self.handle = model.register_forward_hook(self._on_forward)

    def _on_forward(self, module, args, output) -> None:
        grad_on = torch.is_grad_enabled()
        evals = tuple(n for n, m in self._dropout_like if not m.training)
        record = ForwardRecord(grad_on, torch.is_inference_mode_enabled(), module.training, evals)
        self.carry.forward = record
        if grad_on and (not module.training or evals):
            for t in _first_grad_tensor(output):
                t.register_hook(lambda g, record=record: setattr(self.carry, "eval_backward", record))

    def remove(self) -> None:
        self.handle.remove()
