"""What a diagnostic re-run must leave as it found it: RNG streams, parameters, gradients, buffers."""

from __future__ import annotations

import random

import torch
from torch import nn

__all__ = ["rng_state", "set_rng_state", "ModuleState"]


def rng_state() -> dict:
    """torch (CPU and initialised CUDA), Python and NumPy random states."""
    state = {"torch": torch.random.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class ModuleState:
    """Copies of a module's parameters, gradients and buffers, put back by :meth:`restore`."""

    def __init__(self, module: nn.Module):
        self.params = list(module.parameters())
        self.data = [p.detach().clone() for p in self.params]
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def restore(self) -> None:
        with torch.no_grad():
            for p, d, g in zip(self.params, self.data, self.grads):
                p.copy_(d)
                p.grad = g
            for b, v in self.buffers:
                b.copy_(v)
