"""The one error base class and the warning hierarchy users can filter."""

from __future__ import annotations

__all__ = ["GradHealthError", "GradModeError", "EmptyValidSetError", "GradHealthWarning", "GradHealthInternalWarning"]


class GradHealthError(RuntimeError):
    """Base of everything gradhealth raises; raised itself when a check found a problem and the
    monitor was asked to raise (``on_problem="raise"``): ``.report`` is that check's report."""

    def __init__(self, message: str = "", report=None):
        super().__init__(message)
        self.report = report


class GradModeError(GradHealthError):
    """The loss cannot produce gradients; the message names the cause and the fix."""


class EmptyValidSetError(GradHealthError, ValueError):
    """A masked reduction selected nothing and the caller asked for ``empty="raise"``."""


class GradHealthWarning(UserWarning):
    """A check found a problem (``on_problem="warn"``)."""


class GradHealthInternalWarning(GradHealthWarning):
    """gradhealth itself failed (a sink, an internal check); training goes on."""
