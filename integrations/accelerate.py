"""Accelerate: ``share_clip(accelerator, monitor)`` makes ``accelerator.clip_grad_norm_`` clip with the
norms of the check just made, so the gradients are read once (:mod:`gradhealth.check.clip`).

What the user configured stays: the same call, the same ``max_norm`` and the same result (Accelerate
unscales a grad scaler's gradients first, as before). Where Accelerate hands the clip to another
engine (DeepSpeed, XLA, FSDP1's ``model.clip_grad_norm_``) it keeps its own two passes; so does a
call with no check since the last clip.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["share_clip"]

#: Accelerate's distributed types whose clip is torch's, over the gradients gradhealth checked
_PLAIN = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU"}


def share_clip(accelerator, monitor) -> Callable[[], None]:
    """Route ``accelerator.clip_grad_norm_`` through ``monitor.clip_grad_norm_``; returns the undo."""
    from gradhealth.check.clip import arm

    original = accelerator.clip_grad_norm_
    arm(monitor)

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        kind = getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))
        if kind not in _PLAIN and not (kind == "FSDP" and getattr(accelerator, "is_fsdp2", False)):
            return original(parameters, max_norm, norm_type)
        accelerator.unscale_gradients()
        return monitor.clip_grad_norm_(max_norm, norm_type, parameters=list(parameters))

    clip_grad_norm_.__wrapped__ = original
    accelerator.clip_grad_norm_ = clip_grad_norm_

    def undo() -> None:
        if accelerator.__dict__.get("clip_grad_norm_") is clip_grad_norm_:
            del accelerator.clip_grad_norm_

    return undo
