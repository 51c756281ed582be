"""gradhealth: which parameters are really training, how large the gradients and updates are,
and where a NaN came from, after every backward pass.

    monitor = gh.GradHealth(model, optimizer)
    ...
    loss.backward()
    monitor.check()
"""

from .brief import brief
from .classify import classify
from .errors import (
    EmptyValidSetError,
    GradHealthError,
    GradHealthInternalWarning,
    GradHealthWarning,
    GradModeError,
)
from .guards import check_loss
from .history import NormHistory
from .findings import Finding, FindingKind
from .masking import masked_mean, safe_div, safe_log, safe_sqrt, safe_where
from .monitor import GradHealth
from .options import Options
from .replay import replay_nonfinite
from .report import Report
from .sinks import LoggingSink, Sink
from .status import Status
from .testing import assert_trains
from .trace import NonFiniteTracer, trace_nonfinite

__version__ = "0.1.0"

__all__ = [
    "Status",
    "classify",
    "GradHealth",
    "Report",
    "Finding",
    "FindingKind",
    "Options",
    "replay_nonfinite",
    "brief",
    "Sink",
    "LoggingSink",
    "check_loss",
    "masked_mean",
    "safe_div",
    "safe_log",
    "safe_sqrt",
    "safe_where",
    "trace_nonfinite",
    "NonFiniteTracer",
    "assert_trains",
    "NormHistory",
    "GradModeError",
    "GradHealthError",
    "GradHealthWarning",
    "GradHealthInternalWarning",
    "EmptyValidSetError",
]
