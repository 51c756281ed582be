"""What a check found besides the parameter states: ``FindingKind`` and ``Finding``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FindingKind", "Finding", "LEVELS", "earned"]

#: a finding's level, from quiet to loud; only "error" makes ``report.ok`` False
LEVELS = ("info", "warning", "error")


class FindingKind(str, enum.Enum):
    """Every kind of finding (value == name, like [Status][gradhealth.Status])."""

    NOT_UPDATED = "NOT_UPDATED"
    FROZEN_BUT_CHANGED = "FROZEN_BUT_CHANGED"
    AMP_SKIPPED = "AMP_SKIPPED"
    STALE_GRAD = "STALE_GRAD"
    EXPLODING_GRAD = "EXPLODING_GRAD"
    VANISHING_GRAD = "VANISHING_GRAD"
    GRAD_MODE = "GRAD_MODE"
    EMPTY_VALID_SET = "EMPTY_VALID_SET"
    NON_FINITE_LOSS = "NON_FINITE_LOSS"
    NONFINITE_ORIGIN = "NONFINITE_ORIGIN"
    NONFINITE_RANK = "NONFINITE_RANK"
    PARTIALLY_USED = "PARTIALLY_USED"
    DESYNC = "DESYNC"
    UNEXPECTED_FROZEN = "UNEXPECTED_FROZEN"
    UNEXPECTED_TRAINABLE = "UNEXPECTED_TRAINABLE"
    TRANSIENT_GRAD = "TRANSIENT_GRAD"
    TARGET_COPY = "TARGET_COPY"
    FROZEN_NORM = "FROZEN_NORM"
    CHECKPOINT_NO_GRAD = "CHECKPOINT_NO_GRAD"
    POSTCLIP = "POSTCLIP"
    DEAD_EXPERT = "DEAD_EXPERT"
    GRAD_DISAGREE = "GRAD_DISAGREE"
    STEP_SKIPPED = "STEP_SKIPPED"
    OPTIMIZER_SKIPPED = "OPTIMIZER_SKIPPED"
    META_PARAM = "META_PARAM"
    DDP_NOT_SYNCED = "DDP_NOT_SYNCED"
    NONFINITE_COLLECTIVE = "NONFINITE_COLLECTIVE"
    NONFINITE_EXPERT = "NONFINITE_EXPERT"
    NOT_STEPPED = "NOT_STEPPED"
    GRAD_SYNC = "GRAD_SYNC"
    LOCKSTEP = "LOCKSTEP"
    FROZEN_PARTNER = "FROZEN_PARTNER"
    NOTHING_TO_LEARN = "NOTHING_TO_LEARN"
    GRAD_PILEUP = "GRAD_PILEUP"

    def __str__(self) -> str:
        return self.value


def earned(level: str, against: str) -> str:
    """The one rule every verdict passes (DESIGN, "What a verdict may rest on"): an error needs
    evidence from this run that training is harmed. A judge that saw the run contradict its
    finding's usual cause says what it saw (``against``: the clip contained the spike and the loss
    fell; nothing that ran reads ``training``; ...), and the finding is then at most a warning."""
    return "warning" if level == "error" and against else level


@dataclass(frozen=True)
class Finding:
    """A problem that is not a parameter state (a stale gradient, a grad-mode mistake, ...).

    ``level`` is "info", "warning" (expected now and then) or "error" (``report.ok`` is False).
    ``kind`` is a [FindingKind][gradhealth.FindingKind] (a str: ``finding.kind == "STALE_GRAD"`` holds).
    ``against``: what this run showed against the finding's usual cause; an error with it is said
    as a warning that names what was seen (`gradhealth.base.findings.earned`).

    Attributes:
        kind: the [FindingKind][gradhealth.FindingKind] (its entry in the field guide).
        message: what was seen and what to do, in the model's own parameter names.
        params: the parameters (or experts, modules) it is about.
        level: "info", "warning" or "error".
        step: the step it is about.
        data: numbers behind the message, by name (kind-specific).
    """

    kind: FindingKind
    message: str
    params: tuple[str, ...] = ()
    level: str = "error"
    step: int | None = None
    data: dict[str, Any] = field(default_factory=dict, compare=False)
    against: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FindingKind(self.kind))
        if self.level not in LEVELS:
            raise ValueError(f"Finding.level must be one of {', '.join(map(repr, LEVELS))}; got {self.level!r}")
        level = earned(self.level, self.against)
        if level != self.level:  # (said once, here: not an error, and why)
            object.__setattr__(self, "level", level)
            object.__setattr__(self, "message", f"{self.message}. Not taken as an error: {self.against}")

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"
