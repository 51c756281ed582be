"""Lightning Fabric: ``share_clip(fabric, monitor)`` makes ``fabric.clip_gradients(..., max_norm=...)``
clip with the norms of the check just made, so the gradients are read once (:mod:`gradhealth.check.clip`).

A monitor needs nothing else from Fabric: give it what ``fabric.setup`` returned (or the model
before it) and the optimizer::

    model, optimizer = fabric.setup(model, optimizer)
    monitor = gh.GradHealth(model, optimizer)        # the names are your module's own
    share_clip(fabric, monitor)                      # optional: one read of the gradients for the clip

Fabric's DDP is found from the model, and a check inside (or just after) ``fabric.no_backward_sync``
is deferred to the synchronising backward (:mod:`gradhealth.ranks.ddp`).

What the user configured stays: the same call, ``max_norm``, ``norm_type`` and result (a grad
scaler's gradients are unscaled first, as Fabric does). A strategy with a clip of its own (FSDP's,
DeepSpeed's, XLA's: one that overrides ``Strategy.clip_gradients_norm``) keeps it; so does a call
with no check since the last clip.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["share_clip"]


def share_clip(fabric, monitor) -> Callable[[], None] | None:
    """Route Fabric's clip by norm through ``monitor.clip_grad_norm_``; returns the undo (None where
    the strategy clips its own way)."""
    from lightning.fabric.strategies import Strategy

    from gradhealth.check.clip import arm

    strategy = fabric.strategy
    if type(strategy).clip_gradients_norm is not Strategy.clip_gradients_norm:
        return None
    arm(monitor)
    precision = strategy.precision

    def clip_gradients_norm(module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        precision.unscale_gradients(optimizer)  # (Fabric's own order: a grad scaler's gradients unscaled first)
        return monitor.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite,
                                       parameters=list(precision.main_params(optimizer)), unscale=False)

    strategy.clip_gradients_norm = clip_gradients_norm

    def undo() -> None:
        if strategy.__dict__.get("clip_gradients_norm") is clip_gradients_norm:
            del strategy.clip_gradients_norm

    return undo
