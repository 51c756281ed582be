"""Where the Hugging Face Trainer callback plugs into a ``Trainer``, which hands a callback no
reference to itself: its callback list and the Trainer (found as referrers, through the garbage
collector), the place of the callback before the ``report_to`` callbacks, the TensorBoard writer
Trainer's own callback opened, and the shared clip on Trainer's accelerator."""

from __future__ import annotations

import gc
from collections.abc import Callable

from transformers.trainer_callback import CallbackHandler

__all__ = ["callback_list", "trainer_of", "share_trainer_clip", "watch_backward", "move_before_reporters", "tensorboard_writer"]


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


def share_trainer_clip(callbacks: list | None, monitor) -> Callable[[], None] | None:
    """Trainer's ``max_grad_norm`` clip (``accelerator.clip_grad_norm_``) with the norms of the check
    made at the end of the step's last backward (:mod:`.accelerate`); returns the undo, or None."""
    accelerator = getattr(trainer_of(callbacks), "accelerator", None)
    if accelerator is None or not hasattr(accelerator, "clip_grad_norm_"):
        return None
    from .accelerate import share_clip

    return share_clip(accelerator, monitor)


def watch_backward(callbacks: list | None, on_loss: Callable) -> Callable[[], None] | None:
    """``on_loss(loss)`` with the loss Trainer backpropagates, whatever ``compute_loss`` made it from
    (``outputs.loss``, TRL's own loss from the logits, a custom one), before its backward runs:
    ``accelerator.backward`` is where every training step's loss goes. Returns the undo, or None."""
    accelerator = getattr(trainer_of(callbacks), "accelerator", None)
    original = getattr(accelerator, "backward", None)
    if original is None:
        return None

    def backward(loss, **kwargs):
        on_loss(loss)
        return original(loss, **kwargs)

    backward.__wrapped__ = original
    accelerator.backward = backward

    def undo() -> None:
        if accelerator.__dict__.get("backward") is backward:
            del accelerator.backward

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
