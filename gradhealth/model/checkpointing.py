"""Activation checkpointing, as the NO_GRAD judge needs to know it: is the model set to checkpoint
reentrantly, and was a module seen running inside a reentrant ``torch.utils.checkpoint`` (the only
kind that cuts a segment whose inputs do not require grad)."""

from __future__ import annotations

import functools
import os
import sys

from torch import nn

from ..base.naming import ROOT, module_of

__all__ = ["uses_checkpointing", "reentrant_checkpointing", "checkpoint_cut"]

_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _in_reentrant_checkpoint() -> bool:
    """Is a reentrant ``torch.utils.checkpoint`` forward (which runs its function under no_grad)
    on the Python stack? Looked at only for a grad-disabled module inside a training model."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE) and frame.f_code.co_name == "forward":
            return True
        frame = frame.f_back
    return False


def uses_checkpointing(module: nn.Module) -> bool:
    """Does the model checkpoint its layers (Hugging Face's ``gradient_checkpointing`` flag, or
    torch's checkpoint wrappers)?"""
    return any(getattr(m, "gradient_checkpointing", False) is True or type(m).__name__ == "CheckpointWrapper"
               for m in module.modules())


def reentrant_checkpointing(module: nn.Module) -> bool:
    """Is the model set to checkpoint its layers *reentrantly*: a Hugging Face
    ``gradient_checkpointing`` flag whose checkpoint function says ``use_reentrant=True`` (or
    leaves torch's default), or a torch checkpoint wrapper with the reentrant implementation? Only
    that kind cuts a segment whose inputs do not require grad; ``use_reentrant=False`` cannot. A flag
    whose function cannot be read is not taken for reentrant: the forwards say it then
    (``carry.reentrant``, :class:`ForwardWatch`)."""
    for m in module.modules():
        impl = getattr(m, "checkpoint_impl", None)  # (torch's checkpoint_wrapper: REENTRANT / NO_REENTRANT)
        if impl is not None and getattr(impl, "name", None) == "REENTRANT":
            return True
        if getattr(m, "gradient_checkpointing", False) is True and _reentrant(getattr(m, "_gradient_checkpointing_func", None)):
            return True
    return False


def _reentrant(fn) -> bool:
    """Does this checkpoint function (``functools.partial(checkpoint, use_reentrant=...)``, as
    Hugging Face builds it) run reentrant checkpoints?"""
    keywords: dict = {}
    while isinstance(fn, functools.partial):
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    if "use_reentrant" in keywords:
        return bool(keywords["use_reentrant"])
    from torch.utils.checkpoint import checkpoint

    return fn is checkpoint  # (torch's default when it is not said: reentrant)


def checkpoint_cut(no_grad: list[str], watch, gaps: dict, model: nn.Module) -> tuple[list[str], bool]:
    """The NO_GRAD parameters a reentrant checkpoint may have cut, and whether the model is set to
    checkpoint reentrantly. Seen, not assumed: those whose module (or a module above it) ran with
    grad disabled inside a reentrant ``torch.utils.checkpoint`` during the forwards the watch
    probed; a module that ran outside one, or not at all, was not cut (a pooler the loss does not
    use, under any checkpointing). Only where the forwards were not looked at (a gap of one check,
    no watch) does the model's setting (:func:`reentrant_checkpointing`) stand in for them."""
    cut = watch.cut if watch is not None else ()
    unseen = set(no_grad) if watch is None else {n for n in no_grad if gaps.get(n, 1) <= 1}
    configured = bool(unseen) and reentrant_checkpointing(model)

    def inside(name: str) -> bool:
        mod = module_of(name)
        return any(not o or o == ROOT or mod == o or mod.startswith(o + ".") for o in cut)

    return [n for n in no_grad if (configured and n in unseen) or (cut and inside(n))], configured
