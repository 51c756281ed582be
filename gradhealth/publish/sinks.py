"""Where reports go: a small protocol, and a sink for the standard ``logging`` module."""

from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from ..base.report import Report
from .once import Once

__all__ = ["Sink", "LoggingSink"]


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(report)``; ``flush()`` and ``close()`` are called when present."""

    def write(self, report: Report) -> None: ...


class LoggingSink:
    """Logs each report to a ``logging`` logger: one summary line, then each finding.

    Healthy reports are logged at ``level`` (INFO by default), reports with problems at WARNING,
    said once (`gradhealth.publish.once`: when a problem starts or changes, as a reminder at its
    10th, 100th, ... check in a row, and once at ``level`` when it is resolved); ``every_n`` keeps
    only every n-th healthy report.
    """

    def __init__(self, logger: logging.Logger | str = "gradhealth", level: int = logging.INFO, every_n: int = 1):
        if isinstance(every_n, bool) or not isinstance(every_n, int) or every_n < 1:
            raise ValueError(f"LoggingSink: every_n must be a positive int; got {every_n!r}")
        if not isinstance(logger, (str, logging.Logger, logging.LoggerAdapter)):
            raise TypeError(f"LoggingSink: logger must be a logging.Logger or a logger name; got {type(logger).__name__}")
        if isinstance(level, bool) or not isinstance(level, int):
            raise TypeError(f"LoggingSink: level must be a logging level int (e.g. logging.INFO); got {level!r}")
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.level = level
        self.every_n = every_n
        self._seen = 0
        self._once = Once()

    def write(self, report: Report) -> None:
        self._seen += 1
        said = self._once.update(report)
        if said.resolved:
            self.logger.log(self.level, "gradhealth step %d: resolved: %s", report.step, "; ".join(said.resolved))
        if said.new or said.reminder:
            self.logger.warning("%s", report if not said.reminder else
                                f"(still, {said.reminder} checks in a row since step {said.since}) {report}")
            return
        if not report.ok or any(f.level != "info" for f in report.findings):
            return  # said already
        if report.ok and not report.findings:
            if (self._seen - 1) % self.every_n == 0:
                self.logger.log(self.level, "gradhealth step %d: healthy; %s", report.step, report.summary_line())
            return
        self.logger.log(self.level, "%s", report)  # info-level findings only (transients, idioms)
