"""The micro-batches of the Trainer's current optimizer step, kept to replay the one that made a NaN.

A micro-batch is Trainer's ``compute_loss`` call when the callback watches it (the loss the step
backpropagated, however it is built: the model's ``outputs.loss``, TRL's loss from the logits, a custom
one), else the model's training forward (replayable when the model returns its loss). Each keeps
its inputs (references; a dict is copied shallowly, since ``compute_loss`` may pop from it), its
random state and the autocast it ran in; the replay runs them again one by one under the NaN tracer
(:func:`gradhealth.replay_nonfinite`) until one makes the NaN.
"""

from __future__ import annotations

import torch

from gradhealth.origin.replay import replay_nonfinite
from gradhealth.origin.snapshot import rng_state

__all__ = ["MicroBatches"]


def _loss_of(output) -> torch.Tensor | None:
    """The loss a model returned (``outputs.loss``; ModelOutput is a dict), or None."""
    return output.get("loss") if isinstance(output, dict) else None


class MicroBatches:
    def __init__(self, device: str = "cpu"):
        self.device = device  # autocast's device type
        self.window: list[list] = []  # [args, kwargs, rng, autocast dtype, has a loss, through compute_loss]
        self.replaying = False
        self.in_loss = 0  # inside compute_loss: its model forwards are not micro-batches of their own

    def _autocast(self):
        return torch.get_autocast_dtype(self.device) if torch.is_autocast_enabled(self.device) else None

    def forward(self, args, kwargs) -> None:
        """A training forward of the model (outside compute_loss); its loss, if any, is noted by :meth:`has_loss`."""
        if not self.in_loss:
            self.window.append([args, kwargs, rng_state(), self._autocast(), False, False])

    def has_loss(self) -> None:
        if self.window:
            self.window[-1][4] = True

    def enter_loss(self, model, inputs, args, kwargs, training: bool) -> None:
        self.in_loss += 1
        if training and self.in_loss == 1 and not self.replaying:
            kept = dict(inputs) if isinstance(inputs, dict) else inputs
            self.window.append([(model, kept, *args), kwargs, rng_state(), self._autocast(), True, True])

    def leave_loss(self) -> None:
        self.in_loss -= 1

    def replayable(self) -> bool:
        return bool(self.window) and all(w[4] for w in self.window)

    def replay(self, model, trainer, window: list, step: int):
        """The step's micro-batches once more under the tracer, each alone, until one makes the NaN."""
        device = self.device

        def runner(args, kwargs, dtype, through_loss):
            def run() -> None:
                with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                    loss = trainer.compute_loss(*args, **kwargs) if through_loss else _loss_of(model(*args, **kwargs))
                if loss is None or loss.dim() != 0:
                    raise RuntimeError("the model returned no loss (a custom compute_loss computes it outside the model)")
                loss.backward()
            return run

        self.replaying = True
        try:
            return replay_nonfinite(model, [runner(w[0], w[1], w[3], w[5] and trainer is not None) for w in window],
                                    rng=[w[2] for w in window], step=step)
        finally:
            self.replaying = False
