"""gradhealth: which parameters are really training, how large the gradients and updates are,
and where a NaN came from, after every backward pass.

    monitor = gh.GradHealth(model, optimizer)
    ...
    loss.backward()
    monitor.check()
"""

import importlib
import importlib.util
import pkgutil
from typing import TYPE_CHECKING

# Each public name is imported at its first use (PEP 562), so that what needs none of them
# (``python -m gradhealth report LOGDIR`` reading a log) starts without importing torch: 2 s of CPU
# a command on the machine the suite runs on. Type checkers and the API pages read the imports below.
if TYPE_CHECKING:
    from .publish.brief import brief
    from .judge.classify import classify
    from .base.errors import (
        EmptyValidSetError,
        GradHealthError,
        GradHealthInternalWarning,
        GradHealthWarning,
        GradModeError,
    )
    from .judge.guards import check_loss
    from .judge.history import NormHistory
    from .base.findings import Finding, FindingKind
    from .masking import masked_mean, safe_div, safe_log, safe_sqrt, safe_where
    from .monitor import GradHealth
    from .options import Options
    from .origin.replay import replay_nonfinite
    from .origin.snapshot import rng_state
    from .base.report import Report
    from .publish.sinks import LoggingSink, Sink
    from .base.status import Status
    from .testing import assert_trains
    from .origin.trace import NonFiniteTracer, trace_nonfinite

_WHERE = {
    "brief": "publish.brief", "classify": "judge.classify", "EmptyValidSetError": "base.errors", "GradHealthError": "base.errors",
    "GradHealthInternalWarning": "base.errors", "GradHealthWarning": "base.errors", "GradModeError": "base.errors",
    "check_loss": "judge.guards", "NormHistory": "judge.history", "Finding": "base.findings", "FindingKind": "base.findings",
    "masked_mean": "masking", "safe_div": "masking", "safe_log": "masking", "safe_sqrt": "masking",
    "safe_where": "masking", "GradHealth": "monitor", "Options": "options", "replay_nonfinite": "origin.replay", "rng_state": "origin.snapshot",
    "Report": "base.report", "LoggingSink": "publish.sinks", "Sink": "publish.sinks", "Status": "base.status",
    "assert_trains": "testing", "NonFiniteTracer": "origin.trace", "trace_nonfinite": "origin.trace",
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    elif name.isidentifier() and not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # a submodule: ``gh.monitor``, ``gh.judge``
    else:  # (a module of the flat layout before the stages: say where it is now)
        stages = [m.name for m in pkgutil.iter_modules(__path__) if m.ispkg] if name.isidentifier() and not name.startswith("__") else []
        moved = [f"{__name__}.{s}.{name}" for s in stages if importlib.util.find_spec(f"{__name__}.{s}.{name}")]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}"
                             + (f"; the module is {moved[0]} (gradhealth/ is grouped by the stages of a check)" if moved else ""))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    "rng_state",
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
