"""``gradhealth report LOGDIR``: what gradhealth saw in a run, from its TensorBoard logs, read
with the streaming reader of :mod:`.tbread` (memory: the largest record plus the summary)."""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap

from gradhealth.publish.metrics import PREFIX
from gradhealth.base.naming import plural
from gradhealth.base.report import describe_groups, describe_names, group_by_module
from gradhealth.base.status import Status

from .tbread import NAMES, Run, events, read_run, safe, scan

__all__ = ["read_run", "summarize_run", "scan", "main", "Summary"]

STOPPED = f"{PREFIX}/stopped"  # the text of the error that stopped a run (the monitor writes it before raising)
_WINDOW = 16  # steps buffered before one is summarised (the events of a step arrive together)
_DETAIL = 300  # characters of a finding's text in the report (cut at a word)


# -------------------------------------------------------------------- the summary
_TOTAL = re.compile(rf"{PREFIX}/grad_norm(_preclip)?/total(_opt\d+)?$")
_NORM = re.compile(rf"{PREFIX}/grad_norm(_preclip)?/(.+)$")
_STATUS = re.compile(rf"{PREFIX}/status/(NO_GRAD|NOT_IN_OPTIMIZER|ZERO_GRAD)(_opt\d+)?$")
_WITH_GRAD = re.compile(rf"{PREFIX}/status/(OK|ZERO_GRAD|NON_FINITE_GRAD|NOT_IN_OPTIMIZER)(_opt\d+)?$")
_TOLERATED = re.compile(rf"{PREFIX}/tolerated(_opt\d+)?$")
_FINDING = re.compile(rf"{PREFIX}/findings/([A-Z_]+)$")
_UPDATE = re.compile(rf"{PREFIX}/update_norm/(.+)$")
_DEAD = re.compile(rf"{PREFIX}/experts/dead/(.+)$")
_TEXT_ITEM = re.compile(r"\*\*([A-Z_]+)\*\* \(([a-z]+), step (-?\d+)\): (.*?)(?=\n\n\*\*[A-Z_]+\*\* \(|\Z)", re.S)

FINDING_WORDS = [("UNEXPECTED_FROZEN", "parameters frozen against expect_frozen"),
                 ("UNEXPECTED_TRAINABLE", "parameters trainable against expect_frozen"),
                 ("NOT_UPDATED", "parameters not updated by the optimizer step"),
                 ("STALE_GRAD", "gradients added onto already-applied ones (missing zero_grad)"),
                 ("VANISHING_GRAD", "gradients that vanished"), ("EXPLODING_GRAD", "gradient spikes"),
                 ("EMPTY_VALID_SET", "empty valid sets"), ("GRAD_MODE", "grad-mode mistakes"),
                 ("FROZEN_BUT_CHANGED", "frozen parameters moved by the optimizer")]


class Summary:
    """What one run says, accumulated from its events in one pass, in memory bounded by the
    number of tags (a few numbers each), not by the number of steps."""

    def __init__(self, name: str):
        self.name = name
        self._steps: dict[int, dict[str, float]] = {}
        self.nonfinite: tuple[int, list[str]] | None = None  # (first step, modules) with untolerated NaN/inf
        self.first_nonfinite: tuple[int, list[str]] | None = None  # the same, tolerated or not (the step guard)
        self.states: dict[str, list] = {}  # state -> [first step, max count, checks]
        self.findings: dict[str, list] = {}  # kind -> [first 8 steps, count]
        self.texts: dict[str, tuple[int, str]] = {}  # kind -> (step, its first text)
        self.origins: list[tuple[int, str]] = []  # NONFINITE_ORIGIN texts, by step
        self.updates: dict[str, list] = {}  # module -> [measured, all zero]
        self.stopped: tuple[int, str] | None = None
        self.dead: dict[str, list[int]] = {}  # dead expert -> [first step, steps]
        self.modules: set[str] = set()  # every module (or parameter) a norm was logged for
        #: the norms are per parameter (the sink's granularity): as many norm tags at a step as
        #: parameters with a gradient (its status counts); None until a step shows both
        self.per_param: bool | None = None
        self.full = False  # csv, json: every text whole (the text view wraps instead)

    def add(self, step: int, tag: str, value: float, text: str | None) -> None:
        if text is not None:
            self._text(step, tag, text)
            return
        if not tag.startswith(PREFIX + "/"):
            return
        self._steps.setdefault(step, {})[tag] = value
        if len(self._steps) > _WINDOW:
            self._close(min(self._steps))

    def _text(self, step: int, tag: str, text: str) -> None:
        if tag == STOPPED:
            if self.stopped is None or step < self.stopped[0]:
                self.stopped = (step, text)
            return
        if tag != f"{PREFIX}/findings_text":
            return
        for kind, _level, at, message in _TEXT_ITEM.findall(text):
            message = message.strip()
            if kind == "NONFINITE_ORIGIN":
                # the most telling ones, a bounded few: one that names an operation's source line
                # (the next failing step, traced op by op) over one that names a module, over the
                # generic "made in the loss" said first
                self.origins.append((_telling(_level, message), int(at), message))
                self.origins = sorted(self.origins, key=lambda o: (-o[0], o[1]))[:8]
            elif kind not in self.texts or int(at) < self.texts[kind][0]:
                self.texts[kind] = (int(at), message)

    def _close(self, step: int) -> None:
        values = self._steps.pop(step)
        tolerated = {m.group(1) or "": v for t, v in values.items() if (m := _TOLERATED.match(t))}
        any_bad = [t for t, v in values.items() if _TOTAL.match(t) and not math.isfinite(v)]
        bad_total = [t for t in any_bad if tolerated.get(_TOTAL.match(t).group(2) or "", 0) == 0]
        if any_bad and (self.first_nonfinite is None or step < self.first_nonfinite[0]):
            where = sorted(m.group(2) for t, v in values.items()
                           if (m := _NORM.match(t)) and not _TOTAL.match(t) and not math.isfinite(v))
            self.first_nonfinite = (step, where)
        if bad_total and (self.nonfinite is None or step < self.nonfinite[0]):
            self.nonfinite = (step, self.first_nonfinite[1] if self.first_nonfinite[0] == step else sorted(
                m.group(2) for t, v in values.items() if (m := _NORM.match(t)) and not _TOTAL.match(t) and not math.isfinite(v)))
        named = {m.group(2) for t in values if (m := _NORM.match(t)) and not _TOTAL.match(t)}
        self.modules.update(named)
        with_grad = sum(v for t, v in values.items() if _WITH_GRAD.match(t))
        if named and with_grad:
            self.per_param = (self.per_param is not False) and len(named) == with_grad
        for t, v in values.items():
            if (m := _STATUS.match(t)) and v > 0:
                state = m.group(1)
                if state != "NOT_IN_OPTIMIZER" and v <= tolerated.get(m.group(2) or "", 0):
                    continue  # only what the policy counted as an error
                agg = self.states.setdefault(state, [step, 0.0, 0])
                agg[0], agg[1], agg[2] = min(agg[0], step), max(agg[1], v), agg[2] + 1
            elif (m := _FINDING.match(t)) and v > 0:
                agg = self.findings.setdefault(m.group(1), [[], 0])
                agg[0] = sorted(agg[0] + [step])[:8]
                agg[1] += 1
            elif (m := _DEAD.match(t)) and v > 0:
                agg = self.dead.setdefault(m.group(1), [step, 0])
                agg[0], agg[1] = min(agg[0], step), agg[1] + 1
            elif (m := _UPDATE.match(t)) and not t.endswith("/total"):
                agg = self.updates.setdefault(m.group(1), [0, True])
                agg[0] += 1
                agg[1] = agg[1] and v == 0

    def finish(self) -> None:
        while self._steps:
            self._close(min(self._steps))

    def items(self, verbose: bool = False, full: bool = False) -> list[dict]:
        """One dict per thing found: run, kind, step, detail (and names, the parameters or modules);
        ``full``: no detail cut (csv, json, --verbose)."""
        self.finish()
        clip = lambda text, n: " ".join(text.split())  # noqa: E731 (whole: the text view wraps, never cuts)
        out: list[dict] = []
        if self.stopped is not None:
            out.append(self._item("STOPPED", self.stopped[0], f"training stopped at step {self.stopped[0]}: "
                                  + clip(self.stopped[1].strip(), 2 * _DETAIL)))
        if self.nonfinite is not None:
            # dated by the first NaN/inf, also when the step guard tolerated it at first
            step, where = self.first_nonfinite if self.first_nonfinite[0] <= self.nonfinite[0] else self.nonfinite
            origin = next((m for _, s, m in self.origins if s >= step), "")
            origin = origin.split(". Usual repairs")[0]
            guarded = (f" (the step guard skipped that step; NaN/inf it no longer tolerated from step "
                       f"{self.nonfinite[0]})" if step < self.nonfinite[0] else "")
            detail = (f"first non-finite gradients at step {step} in "
                      f"{self._names_of(where, verbose, sorted(self.modules)) or 'the total norm'}{guarded}")
            out.append(self._item("NON_FINITE_GRAD", step, detail + (f"; origin: {clip(origin, _DETAIL)}" if origin else ""),
                                  where))
        for state in ("NO_GRAD", "NOT_IN_OPTIMIZER", "ZERO_GRAD"):
            if state in self.states:
                first, most, checks = self.states[state]
                names = self._names(state)
                count = plural(int(most), "parameter") if names is None else (
                    ", ".join(names[1]) if verbose and names[1] else names[0])
                out.append(self._item(state, first, f"{count} {state} from step {first} on "
                                                    f"({plural(checks, 'check')})", names[1] if names else []))
        for kind, what in FINDING_WORDS:
            if kind in self.findings:
                steps, count = self.findings[kind]
                shown = ", ".join(map(str, steps)) + (" ..." if count > len(steps) else "")
                detail = f"{what} at {plural(count, 'step')} ({shown})"
                if kind in self.texts:
                    detail += ": " + clip(self.texts[kind][1], _DETAIL)
                out.append(self._item(kind, steps[0], detail))
        if self.dead:
            dead = sorted(self.dead, key=lambda u: (self.dead[u][0], u))
            first = min(v[0] for v in self.dead.values())
            shown = dead if verbose or len(dead) <= 8 else dead[:8] + [f"and {len(dead) - 8} more"]
            detail = (f"{plural(len(dead), 'dead expert')} from step {first} on: " + ", ".join(
                f"{u} (step {self.dead[u][0]}, {plural(self.dead[u][1], 'check')})" if not u.startswith("and ") else u
                for u in shown))
            if "DEAD_EXPERT" in self.texts:
                detail += ": " + clip(self.texts["DEAD_EXPERT"][1].partition(": a dead expert")[2].strip(" ,."), _DETAIL)
            out.append(self._item("DEAD_EXPERT", first, detail, dead))
        never = sorted(m for m, (n, zero) in self.updates.items() if n >= 2 and zero)
        if never:
            out.append(self._item("NEVER_UPDATED", None, "never updated in any measured step: "
                                  + self._names_of(never, verbose, list(self.updates)), never))
        return out

    def _names_of(self, names: list[str], verbose: bool, universe: list[str]) -> str:
        """Names as the tags carry them, grouped: parameters (``0.* (2 params)``) or modules."""
        if self.per_param:
            return ", ".join(names) if verbose else describe_names({n: Status.OK for n in universe}, names)
        return _modules(names, verbose, universe)

    def _names(self, state: str) -> tuple[str, list[str]] | None:
        """(``head.* (2 params)``, every name) from the problem text the sink wrote, if any."""
        if state not in self.texts:
            return None
        described, _, listed = self.texts[state][1].partition(NAMES)
        listed = listed.partition("\n\n")[0]  # (then what the state means, in words)
        return described.strip(), [n.strip() for n in listed.split(",") if n.strip()]

    def _item(self, kind: str, step: int | None, detail: str, names: list[str] | None = None) -> dict:
        return {"run": self.name, "kind": kind, "step": step, "detail": detail, "names": list(names or [])}



_SOURCE_LINE = re.compile(r"\.py:\d+")


def _telling(level: str, message: str) -> int:
    """How much an origin's text tells: 2 names a source line, 1 is an error-level verdict."""
    return 2 if _SOURCE_LINE.search(message) else int(level == "error")


def _modules(names: list[str], verbose: bool, universe: list[str] | None = None) -> str:
    """Module names grouped like the live warnings (``head.* (2 modules)``); every name with verbose."""
    if not names:
        return ""
    if verbose:
        return ", ".join(names)
    status = {n: Status.OK for n in (universe or names)}
    chosen = set(names)
    rows = group_by_module(status, lambda n, s: n in chosen)
    text = describe_groups(rows).replace(" params)", " modules)").replace(" param)", " module)")
    text = re.sub(r"\ball (\d+) parameters\b", r"all \1 modules", text).replace("the only parameter", "the only module")
    return text.replace("every parameter (", "every module (")


def summarize_run(frame) -> list[dict]:
    """What a person wants to know after a run, one dict per item found, from ``read_run(text=True)``."""
    out: list[dict] = []
    has_text = "text" in frame
    for run, df in frame.groupby("run", sort=True):
        s = Summary(run)
        df = df.sort_values("step", kind="stable")
        texts = df["text"] if has_text else [None] * len(df)
        for step, tag, value, text in zip(df["step"], df["tag"], df["value"], texts):
            s.add(int(step), tag, float(value), text if isinstance(text, str) else None)
        out.extend(s.items())
    return out


# ---------------------------------------------------------------------- output
def _cell(value):
    """A CSV cell that no spreadsheet runs as a formula and no terminal as a command (control
    characters escaped)."""
    if isinstance(value, str):
        value = safe(value)
        if value[:1] in ("=", "+", "-", "@", "\t", "\r"):
            return "'" + value
    return value


def _summaries(runs: dict[str, Run], verbose: bool, progress: bool, full: bool = False) -> tuple[list[dict], dict[str, int]]:
    items: list[dict] = []
    found: dict[str, int] = {}
    for n, run in enumerate(runs.values(), 1):
        if progress:
            print(f"\rreading {n}/{len(runs)} runs: {safe(run.name)[:60]}", end="", file=sys.stderr, flush=True)
        s = Summary(run.name)
        for p in run.files:
            for step, tag, value, _, text in events(p, run.skipped):
                run.read += 1
                s.add(step, tag, value, text)
        mine = s.items(verbose, full) if run.read else []
        found[run.name] = len(mine)
        items.extend(mine)
    if progress:
        print(file=sys.stderr)
    return items, found


def main(argv: list[str] | None = None) -> int:
    """``gradhealth report LOGDIR [--format text|csv|json] [--verbose]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="gradhealth report", description="What gradhealth saw in a run, from its TensorBoard event files.")
    ap.add_argument("logdir")
    ap.add_argument("--format", choices=("text", "csv", "json"), default="text")
    ap.add_argument("--verbose", action="store_true", help="every parameter or module name, not grouped by module")
    args = ap.parse_args(argv)
    try:
        runs, notes = scan(args.logdir)
    except FileNotFoundError as exc:
        print(f"gradhealth report: {safe(exc)}", file=sys.stderr)
        return 2
    items, found = _summaries(runs, args.verbose, args.format == "text" and sys.stderr.isatty(), args.format != "text")
    readable = [r for r in runs.values() if r.read]
    unreadable = [r for r in runs.values() if not r.read]
    rows = list(items)
    for r in runs.values():
        rows += [{"run": r.name, "kind": "SKIPPED" if r.read else "UNREADABLE", "step": None, "detail": s, "names": []}
                 for s in r.skipped or ([] if r.read else ["no scalars in its event files"])]
    rows += [{"run": None, "kind": "UNREADABLE", "step": None, "detail": s, "names": []} for s in notes]
    if args.format == "json":
        print(json.dumps(rows, indent=2))
    elif args.format == "csv":
        import csv

        out = csv.DictWriter(sys.stdout, fieldnames=["run", "kind", "step", "detail", "names"])
        out.writeheader()
        for row in rows:
            out.writerow({k: _cell(" ".join(v) if isinstance(v, list) else v) for k, v in row.items()})
    else:
        print(f"gradhealth report: {plural(len(readable), 'run')} read under {safe(args.logdir)}")
        for r in readable:
            mine = [i for i in items if i["run"] == r.name]
            print(f"\n{safe(r.name)}: " + ("nothing to report" if not mine else plural(len(mine), "finding")))
            for i in mine:  # wrapped, never cut: a NaN origin keeps its file:line
                print(textwrap.fill(f"{i['kind']}: {safe(i['detail'])}", width=100, initial_indent="  ",
                                    subsequent_indent="      ", break_long_words=False, break_on_hyphens=False))
            for s in r.skipped:
                print(f"  (skipped {safe(s)})")
        if unreadable or notes:
            print(f"\nnot read ({plural(len(unreadable) + len(notes), 'place')}):")
            for r in unreadable:
                why = "; ".join(r.skipped) or "no scalars in its event files"
                print(f"  {safe(r.name)}: {safe(why)}")
            for s in notes:
                print(f"  {safe(s)}")
    if not readable:
        print(f"gradhealth report: nothing readable under {safe(args.logdir)}"
              + (": no TensorBoard event files (events.out.tfevents.*) there; was anything logged?" if not runs and not notes else ""),
              file=sys.stderr)
        return 2
    return 0
