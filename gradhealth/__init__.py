"""gradhealth: which parameters are really training, how large the gradients and updates are,
and where a NaN came from, after every backward pass.

    monitor = gh.GradHealth(model, optimizer)
    ...
    loss.backward()
    monitor.check()
"""

from .classify import classify
from .errors import (
    EmptyValidSetError,
    GradHealthError,
    GradHealthInternalWarning,
    GradHealthWarning,
    GradModeError,
)
from .guards import check_loss
from .monitor import GradHealth
from .report import Finding, Report
from .sinks import LoggingSink, Sink
from .status import Status

__version__ = "0.1.0"

__all__ = [
    "Status",
    "classify",
    "GradHealth",
    "Report",
    "Finding",
    "Sink",
    "LoggingSink",
    "check_loss",
    "GradModeError",
    "GradHealthError",
    "GradHealthWarning",
    "GradHealthInternalWarning",
    "EmptyValidSetError",
]
