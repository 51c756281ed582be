"""Where the Hugging Face Trainer callback plugs into a ``Trainer``, which hands a callback no
reference to itself: its callback list and the Trainer (found as referrers, through the garbage
collector), the place of the callback before the ``report_to`` callbacks, the TensorBoard writer
Trainer's own callback opened, and the shared clip on Trainer's accelerator."""

from __future__ import annotations

import gc
from collections.abc import Callable

from transformers.trainer_callback import CallbackHandler

from gradhealth.base.hooks import guarded

__all__ = ["callback_list", "trainer_of", "share_trainer_clip", "around", "move_before_reporters", "tensorboard_writer"]


def callback_list(callback) -> list | None:
    """Trainer's callback list: the list holding ``callback`` that a ``CallbackHandler`` holds."""
    for lst in gc.get_referrers(callback):
        if not isinstance(lst, list) or not any(x is callback for x in lst):
            continue
        if any(isinstance(h, CallbackHandler) and h.callbacks is lst for h in gc.get_referrers(lst)):
            return lst
    return None


def trainer_of(callbacks: list | None):
    """The Trainer whose handler holds ``callbacks`` (its ``callback_handler``), or None."""
    for handler in gc.get_referrers(callbacks) if callbacks is not None else ():
        if not isinstance(handler, CallbackHandler):
            continue
        for held in gc.get_referrers(handler):  # the Trainer's __dict__ (or the Trainer)
            if getattr(held, "callback_handler", None) is handler:
                return held
            if isinstance(held, dict) and held.get("callback_handler") is handler:
                owner = next((o for o in gc.get_referrers(held) if getattr(o, "__dict__", None) is held), None)
                if owner is not None:
                    return owner
    return None


def share_trainer_clip(trainer, monitor) -> Callable[[], None] | None:
    """Trainer's ``max_grad_norm`` clip (``accelerator.clip_grad_norm_``) with the norms of the check
    made at the end of the step's last backward (:mod:`.accelerate`); returns the undo, or None."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or not hasattr(accelerator, "clip_grad_norm_"):
        return None
    from .accelerate import share_clip

    return share_clip(accelerator, monitor)


def around(obj, name: str, before: Callable, after: Callable | None = None) -> Callable[[], None] | None:
    """For the run: ``obj.name(*args, **kwargs)`` calls ``before(*args, **kwargs)`` first (and
    ``after()`` when it returns or raises). Where the callback watches Trainer's own calls:
    ``accelerator.backward`` (the loss every training step backpropagates, whatever ``compute_loss``
    built it from) and ``compute_loss`` (a micro-batch's inputs, to replay it). Returns the undo, or
    None when ``obj`` has no such method."""
    original = getattr(obj, name, None) if obj is not None else None
    if not callable(original):
        return None
    said: set = set()  # (the callback's own failure is said once; a GradModeError said on purpose still raises)
    before = guarded(before, f"hook around {type(obj).__name__}.{name}", said)
    after = guarded(after, f"hook after {type(obj).__name__}.{name}", said) if after is not None else None

    def wrapped(*args, **kwargs):
        before(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            if after is not None:
                after()

    wrapped.__wrapped__ = original
    setattr(obj, name, wrapped)

    def undo() -> None:
        if obj.__dict__.get(name) is wrapped:
            delattr(obj, name)

    return undo


def move_before_reporters(callbacks: list | None, callback) -> None:
    """Put ``callback`` before the ``report_to`` callbacks, so the keys it merges into ``logs``
    reach them."""
    if callbacks is None:
        return
    reporters = [i for i, cb in enumerate(callbacks) if type(cb).__module__.startswith("transformers.integrations")]
    mine = next(i for i, cb in enumerate(callbacks) if cb is callback)
    if reporters and reporters[0] < mine:
        callbacks.pop(mine)
        callbacks.insert(reporters[0], callback)


def tensorboard_writer(callbacks: list | None):
    """The writer of Trainer's ``TensorBoardCallback`` (opened in its on_train_begin), or None."""
    tb = next((cb for cb in callbacks or () if type(cb).__name__ == "TensorBoardCallback"), None)
    return getattr(tb, "tb_writer", None)
