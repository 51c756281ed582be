"""How every demo prints a scenario: a few short lines (what, where, what to do in that framework),
then a closing table scenario -> verdict. Lines stay within ``WIDTH`` columns."""

from __future__ import annotations

import os
import re
import textwrap

from gradhealth.publish.brief import brief
from gradhealth.base.naming import terminal_safe

__all__ = ["Capture", "WIDTH", "logs", "show", "table", "verdict"]

WIDTH = 100


class Capture:
    """A sink that keeps every report of a run (the demos read them after the run)."""

    def __init__(self):
        self.reports: list = []

    def write(self, report) -> None:
        self.reports.append(report)


def _wrap(text: str, indent: str = "    ", more: str = "      ") -> list[str]:
    return textwrap.wrap(terminal_safe(text), WIDTH, initial_indent=indent, subsequent_indent=more,
                         break_on_hyphens=False) or [indent]


def _stopped(error: str) -> list[str]:
    """A GradModeError's message in two short lines: what stopped the run, and what to look for."""
    parts = [p for p in error.split(": ") if p and not p.startswith("gradhealth")]
    what = parts[0] if parts else error
    cause = next((p for p in parts[1:] if p.startswith("the graph was cut") or p.startswith("the model")), None)
    look = next((p for p in parts[1:] if p.startswith("look for") or p.startswith("run ") or p.startswith("call ")), None)
    out = _wrap(f"GradModeError, the run stops at once: {what}" + (f" ({cause})" if cause else ""))
    if look:
        out += _wrap(f"do: {look.rstrip('.')}")
    return out


def verdict(reports: list, error: str | None) -> str:
    """The closing table's cell: the first problem's headline and step, or ``silent``."""
    if error:
        return "GradModeError at the first step"
    for r in reports:
        if not r.ok:
            return f"{r.headline()} (step {r.step})"
    return "silent"


def show(reports: list, error: str | None = None, framework: str = "plain", losses: list | None = None) -> None:
    """What gradhealth said in one scenario: each different problem once, at the step it began,
    in its short form (``gradhealth.brief``); the steps it stayed for in one line."""
    if error:
        print("\n".join(_stopped(error)))
        return
    seen: dict[str, list[int]] = {}
    shown: dict[str, list[str]] = {}
    for r in reports:
        if r.ok:
            continue
        lines = brief(r, framework)
        # the same problem at another step (weights poisoned by an earlier NaN step: a new story)
        key = re.sub(r"\bsteps? \d+", "step N", lines[0]) + ("|poisoned" if any("already NaN/inf" in x for x in lines) else "")
        seen.setdefault(key, []).append(r.step)
        if key not in shown or _precision(lines) > _precision(shown[key]):
            shown[key] = lines  # the first said, unless a later step names the origin more precisely
    if not seen:
        falls = f" (loss {losses[0]:.3g} -> {losses[-1]:.3g})" if losses and len(losses) > 1 and losses[-1] < losses[0] else ""
        print(f"    silent: every parameter trains{falls}")
        return
    for key, steps in seen.items():
        lines = shown[key]
        also = f" (and {_steps(steps[1:])})" if len(steps) > 1 else ""
        print("\n".join(_wrap(f"step {steps[0]}{also}: {lines[0]}")))
        for line in lines[1:]:
            print("\n".join(_wrap(line, "      ", "        ")))


def _precision(lines: list[str]) -> int:
    """2: an origin with its file and line, 1: an origin, 0: none."""
    origin = [x for x in lines if x.startswith("origin:")]
    return 0 if not origin else 2 if ".py:" in origin[0] else 1


def _steps(steps: list[int]) -> str:
    if len(steps) > 3 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


def table(rows: list[tuple[str, str]]) -> None:
    """scenario -> verdict, one line each."""
    width = max(len(name) for name, _ in rows)
    print("what gradhealth said, per scenario:")
    for name, said in rows:
        print("\n".join(_wrap(f"{name:<{width}}  {said}", "  ", " " * (width + 4))))


def logs(logdir: str, what: str) -> None:
    """The closing lines: where the logs are, and the two commands that read them."""
    print(f"\n{what} are in\n    {os.path.abspath(logdir)}\n"
          f"what gradhealth saw, per run:\n    gradhealth report {logdir}\n"
          f"the dashboards (the CUSTOM SCALARS and IMAGES tabs at http://localhost:6006):\n"
          f"    tensorboard --logdir {logdir}")
