"""An engine that owns its gradient accumulation: where its window ends, read from the engine.

DeepSpeed's engine accumulates over ``gradient_accumulation_steps`` micro-batches of its config: the
user calls ``engine.backward(loss); engine.step()`` on every micro-batch and the engine decides the
boundary (its ``step()`` steps the optimizer only there). Between boundaries the gradients are
partial, and where they are depends on the stage (``.grad``, an unreduced bucket, this rank's
partition, an offloaded buffer); at the boundary they are the whole window's. A check between
boundaries is deferred, as inside DDP's ``no_sync()``: it returns None, counts no step, arms no
step and starts no NO_GRAD/ZERO_GRAD streak; the check at the boundary judges the window.

The rule, with no class name looked at: the wrapper that runs the user's module (``.module``) and
says whether a micro-batch is its accumulation boundary (``is_gradient_accumulation_boundary()``,
with its micro-batch count ``micro_steps``). Its answer is about the micro-batch that has not
stepped yet; a check may come after the step (Accelerate's ``backward`` runs ``engine.step()`` at
its boundaries), so the answer is read where it stays the last backward's: the engine's optimizer's
copy of it (DeepSpeed's ZeRO and bf16 optimizers keep one, set at each backward), else the
engine's, or after a step the engine's answer noted at that micro-batch's training forward. An engine whose caller owns
the boundary (``managed_gradient_accumulation()`` False) is never deferred: each check judges
what is there.
"""

from __future__ import annotations

import torch
from torch import nn

from .wrappers import chain, unwrap, wrapper_of

__all__ = ["Accumulation", "engine_of", "watch"]


def _is_engine(m) -> bool:
    return callable(getattr(m, "is_gradient_accumulation_boundary", None)) and isinstance(getattr(m, "micro_steps", None), int)


def engine_of(model: nn.Module):
    """The engine that accumulates for ``model``: one in its chain of wrappers, else one that refers
    to the module the user wrote (the recipe hands the monitor ``engine.module``). None without one."""
    for m in chain(model):
        if _is_engine(m):
            return m
    return wrapper_of(model, _is_engine)


class Accumulation:
    """Is the last backward between the engine's accumulation boundaries (:meth:`between`)?"""

    def __init__(self, engine, module: nn.Module):
        self.engine = engine
        self.seen: tuple[int, bool] | None = None  # (micro_steps, boundary) at the last training forward
        self._hook = module.register_forward_pre_hook(self._forward)

    def _forward(self, _module, _args) -> None:
        """A training forward: note its micro-batch and whether the engine calls it a boundary."""
        if not torch.is_grad_enabled():
            return
        e = self.engine
        try:
            self.seen = (e.micro_steps, bool(e.is_gradient_accumulation_boundary()))
        except Exception:  # (inside the user's forward: never break it)
            self.seen = None

    def between(self) -> bool:
        """The gradients are a window's part: the micro-batch of the last backward is not the engine's
        boundary. False whenever the engine cannot say."""
        e = self.engine
        try:
            managed = getattr(e, "managed_gradient_accumulation", None)
            if callable(managed) and not managed():
                return False
            mirror = getattr(getattr(e, "optimizer", None), "is_gradient_accumulation_boundary", None)
            if callable(mirror):  # (its optimizer's copy of the answer, set at each backward: still true after the step)
                return not mirror()
            seen = self.seen
            if seen is not None and seen[0] != e.micro_steps:  # its step already ran (a one-call step)
                return not seen[1]
            return not e.is_gradient_accumulation_boundary()
        except Exception:
            return False

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def watch(model: nn.Module) -> Accumulation | None:
    """The :class:`Accumulation` of ``model``'s engine when ``torch.distributed`` runs (an engine
    initialises it), else None."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:  # (looking never breaks the monitor's construction: without it, every check judges what is there)
        engine = engine_of(model)
        return Accumulation(engine, unwrap(model)) if engine is not None else None
    except Exception:
        return None
