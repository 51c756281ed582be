"""gradhealth: which parameters are really training, how large the gradients and updates are,
and where a NaN came from, after every backward pass.

    monitor = gh.GradHealth(model, optimizer)
    ...
    loss.backward()
    monitor.check()
"""

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING

# Each public name is imported at its first use (PEP 562), so that what needs none of them
# (``python -m gradhealth report LOGDIR`` reading a log) starts without importing torch: 2 s of CPU
# a command on the machine the suite runs on. Type checkers and the API pages read the imports below.
if TYPE_CHECKING:
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

_WHERE = {
    "brief": "brief", "classify": "classify", "EmptyValidSetError": "errors", "GradHealthError": "errors",
    "GradHealthInternalWarning": "errors", "GradHealthWarning": "errors", "GradModeError": "errors",
    "check_loss": "guards", "NormHistory": "history", "Finding": "findings", "FindingKind": "findings",
    "masked_mean": "masking", "safe_div": "masking", "safe_log": "masking", "safe_sqrt": "masking",
    "safe_where": "masking", "GradHealth": "monitor", "Options": "options", "replay_nonfinite": "replay",
    "Report": "report", "LoggingSink": "sinks", "Sink": "sinks", "Status": "status",
    "assert_trains": "testing", "NonFiniteTracer": "trace", "trace_nonfinite": "trace",
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # a submodule, as ``gh.monitor`` was before
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """``gh.brief`` and ``gh.classify`` stay the functions when something imports their modules
    (the import system binds a loaded submodule to its name in the package, as the eager imports
    then overwrote)."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _WHERE.get(name) == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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
