"""Reading gradhealth's TensorBoard logs back: ``read_run`` and ``gradhealth report LOGDIR``.

The reader is its own: it streams the TFRecord framing of each event file (a length, its CRC, the
record, the record's CRC) one record at a time, so memory stays at the largest record plus the
summary, whatever the size of the log. It opens only regular files (never a FIFO or a device:
opening one would block), checks every declared length against what the file holds before
reading it, keeps every record read before a bad one, and says per run what it skipped and why.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from gradhealth.metrics import PREFIX
from gradhealth.report import describe_groups, group_by_module
from gradhealth.status import Status

__all__ = ["read_run", "summarize_run", "scan", "main"]

EVENT_FILE = "events.out.tfevents"
_TRAINER = "train/"  # Hugging Face Trainer's reporters write every training key as train/<key>
STOPPED = f"{PREFIX}/stopped"  # the text of the error that stopped a run (the monitor writes it before raising)
_WINDOW = 16  # steps buffered before one is summarised (the events of a step arrive together)
_DETAIL = 300  # characters of a finding's text in the report (cut at a word)


# ----------------------------------------------------------------- finding the runs
@dataclass
class Run:
    """One run directory: its event files, and what was skipped there and why."""

    name: str
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    read: int = 0  # records read


def scan(path: str) -> tuple[dict[str, Run], list[str]]:
    """The runs under ``path`` (directories holding event files, symlinked ones followed once) and
    the problems met while listing: (runs by name, notes about what could not be looked at)."""
    runs: dict[str, Run] = {}
    notes: list[str] = []
    try:
        st = os.stat(path)
    except OSError as exc:
        raise FileNotFoundError(f"{path!r} does not exist or cannot be looked at ({exc.strerror or exc}); pass the "
                                "log directory given to the TensorBoard writer or logger") from None
    if not stat.S_ISDIR(st.st_mode):
        run = runs.setdefault(".", Run("."))
        _add_file(run, path, os.path.basename(path))
        return runs, notes
    seen: set[tuple[int, int]] = set()
    stack = [path]
    while stack:
        d = stack.pop()
        try:
            key = os.stat(d)
        except OSError as exc:
            notes.append(f"{_rel(d, path)}: cannot be looked at ({exc.strerror or type(exc).__name__})")
            continue
        if (key.st_dev, key.st_ino) in seen:
            continue  # a symlink loop, or a run linked twice
        seen.add((key.st_dev, key.st_ino))
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            notes.append(f"{_rel(d, path)}: cannot be listed ({exc.strerror or type(exc).__name__})")
            continue
        name = _rel(d, path)
        for e in entries:
            try:
                is_dir = e.is_dir(follow_symlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                stack.append(e.path)
                if e.name.startswith(EVENT_FILE):
                    runs.setdefault(name, Run(name)).skipped.append(f"{e.name}: a directory named like an event file")
            elif e.name.startswith(EVENT_FILE):
                _add_file(runs.setdefault(name, Run(name)), e.path, e.name)
            elif e.is_symlink() and not os.path.exists(e.path):
                try:  # a dangling link to a directory, or a symlink loop
                    os.stat(e.path)
                except OSError as exc:
                    notes.append(f"{_rel(e.path, path)}: cannot be looked at ({exc.strerror or type(exc).__name__})")
    return dict(sorted(runs.items())), notes


def _rel(p: str, root: str) -> str:
    r = os.path.relpath(p, root)
    return "." if r == os.curdir else r


def _add_file(run: Run, p: str, name: str) -> None:
    try:
        mode = os.stat(p).st_mode
    except OSError as exc:
        run.skipped.append(f"{name}: cannot be opened ({exc.strerror or type(exc).__name__})")
        return
    if stat.S_ISREG(mode):
        run.files.append(p)
    else:
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        run.skipped.append(f"{name}: {kind}, not read")


# ------------------------------------------------------------------- the records
def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def _masked_crc(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    c ^= 0xFFFFFFFF
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(p: str, skipped: list[str]) -> Iterator[bytes]:
    """The records of one event file, one at a time. Stops at the first bad one (a note in
    ``skipped`` says where and why); what came before it is kept."""
    name = os.path.basename(p)
    try:  # non-blocking: a FIFO swapped in after the scan must not hang the reader
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        skipped.append(f"{name}: cannot be opened ({exc.strerror or type(exc).__name__})")
        return
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        skipped.append(f"{name}: not a regular file, not read")
        return
    size, pos = st.st_size, 0
    with os.fdopen(fd, "rb", buffering=1 << 16) as f:
        while True:
            try:
                head = f.read(12)
            except OSError as exc:
                skipped.append(f"{name}: read error at byte {pos} ({exc.strerror or type(exc).__name__}); the rest is not read")
                return
            if not head:
                return
            if len(head) < 12:
                skipped.append(f"{name}: a partial record at byte {pos} (cut off, or still being written): not read")
                return
            (length,) = struct.unpack("<Q", head[:8])
            if _masked_crc(head[:8]) != struct.unpack("<I", head[8:])[0]:
                skipped.append(f"{name}: corrupt record header at byte {pos}; the rest of the file is not read")
                return
            if length > size - pos - 16:
                skipped.append(f"{name}: the record at byte {pos} claims {length} bytes, more than the "
                               f"{max(0, size - pos - 16)} left in the file; the rest is not read")
                return
            data = f.read(length)
            tail = f.read(4)
            if len(data) < length or len(tail) < 4:
                skipped.append(f"{name}: a partial record at byte {pos} (cut off, or still being written): not read")
                return
            yield data
            pos += 16 + length


def events(p: str, skipped: list[str], text: bool = True) -> Iterator[tuple[int, str, float, float, str | None]]:
    """(step, tag, value, wall_time, text) of every scalar (and text) in one event file."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event

    name = os.path.basename(p)
    for k, data in enumerate(records(p, skipped)):
        ev = Event()
        try:
            ev.ParseFromString(data)
        except DecodeError:
            skipped.append(f"{name}: record {k} is not an event (corrupt); the rest of the file is not read")
            return
        if not ev.HasField("summary"):
            continue
        for v in ev.summary.value:
            tag = v.tag[len(_TRAINER):] if v.tag.startswith(_TRAINER + PREFIX + "/") else v.tag
            which = v.WhichOneof("value")
            if which == "simple_value":
                yield ev.step, tag, float(v.simple_value), ev.wall_time, None
            elif which == "tensor":
                plugin = v.metadata.plugin_data.plugin_name
                t = v.tensor
                if plugin == "text" or tag.endswith("/text_summary"):
                    if text and t.string_val:
                        yield (ev.step, tag[: -len("/text_summary")] if tag.endswith("/text_summary") else tag,
                               math.nan, ev.wall_time, t.string_val[0].decode("utf-8", "replace"))
                elif plugin == "scalars" and (t.float_val or t.double_val):
                    yield ev.step, tag, float((t.float_val or t.double_val)[0]), ev.wall_time, None
                elif plugin == "scalars" and t.tensor_content and t.dtype in (1, 2):  # DT_FLOAT, DT_DOUBLE
                    fmt = "<f" if t.dtype == 1 else "<d"
                    yield ev.step, tag, struct.unpack(fmt, t.tensor_content[: struct.calcsize(fmt)])[0], ev.wall_time, None


def read_run(path, *, progress: bool = False, text: bool = False):
    """Every scalar in every event file under ``path``: a DataFrame (step, tag, value, wall_time,
    run). ``text=True`` adds the text events (a ``text`` column, value NaN). What was skipped and
    why is in ``frame.attrs["skipped"]`` (``{run: [notes]}``). Raises ``FileNotFoundError`` /
    ``ValueError`` with the path when nothing readable is there. Holds the whole run in memory:
    ``gradhealth report`` streams instead."""
    import pandas as pd

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"read_run: path must be a str or os.PathLike (a log directory or an event file); got "
                        f"{type(path).__name__}")
    path = os.fspath(path)
    runs, notes = scan(path)
    if not any(r.files for r in runs.values()):
        raise ValueError(f"read_run: no TensorBoard event files ({EVENT_FILE}.*) under {path!r} that can be read; was "
                         f"anything logged there?{_joined(notes + [s for r in runs.values() for s in r.skipped])}")
    rows = []
    for n, run in enumerate(runs.values(), 1):
        if progress:
            print(f"\rreading {n}/{len(runs)} runs: {_safe(run.name)}", end="", file=sys.stderr, flush=True)
        for p in run.files:
            rows.extend((s, t, v, w, run.name, x) for s, t, v, w, x in events(p, run.skipped, text))
    if progress:
        print(file=sys.stderr)
    frame = pd.DataFrame(rows, columns=["step", "tag", "value", "wall_time", "run", "text"])
    if not text:
        frame = frame.drop(columns="text")
    if frame.empty:
        raise ValueError(f"read_run: the event files under {path!r} hold no scalars (a run that logged nothing, or a "
                         f"corrupt file){_joined([s for r in runs.values() for s in r.skipped])}")
    frame = frame.sort_values(["run", "tag", "step"], kind="stable").reset_index(drop=True)
    frame.attrs["skipped"] = {r.name: list(r.skipped) for r in runs.values() if r.skipped}
    return frame


def _joined(notes: list[str]) -> str:
    return (" (" + "; ".join(_safe(n) for n in notes[:5]) + (" ..." if len(notes) > 5 else "") + ")") if notes else ""


# -------------------------------------------------------------------- the summary
_TOTAL = re.compile(rf"{PREFIX}/grad_norm(_preclip)?/total(_opt\d+)?$")
_NORM = re.compile(rf"{PREFIX}/grad_norm(_preclip)?/(.+)$")
_STATUS = re.compile(rf"{PREFIX}/status/(NO_GRAD|NOT_IN_OPTIMIZER|ZERO_GRAD)(_opt\d+)?$")
_TOLERATED = re.compile(rf"{PREFIX}/tolerated(_opt\d+)?$")
_FINDING = re.compile(rf"{PREFIX}/findings/([A-Z_]+)$")
_UPDATE = re.compile(rf"{PREFIX}/update_norm/(.+)$")
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
        self.states: dict[str, list] = {}  # state -> [first step, max count, checks]
        self.findings: dict[str, list] = {}  # kind -> [first 8 steps, count]
        self.texts: dict[str, tuple[int, str]] = {}  # kind -> (step, its first text)
        self.origins: list[tuple[int, str]] = []  # NONFINITE_ORIGIN texts, by step
        self.updates: dict[str, list] = {}  # module -> [measured, all zero]
        self.stopped: tuple[int, str] | None = None

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
                if len(self.origins) < 8:
                    self.origins.append((int(at), message))
            elif kind not in self.texts or int(at) < self.texts[kind][0]:
                self.texts[kind] = (int(at), message)

    def _close(self, step: int) -> None:
        values = self._steps.pop(step)
        tolerated = {m.group(1) or "": v for t, v in values.items() if (m := _TOLERATED.match(t))}
        bad_total = [t for t, v in values.items() if _TOTAL.match(t) and not math.isfinite(v)
                     and tolerated.get(_TOTAL.match(t).group(2) or "", 0) == 0]
        if bad_total and (self.nonfinite is None or step < self.nonfinite[0]):
            where = sorted(m.group(2) for t, v in values.items()
                           if (m := _NORM.match(t)) and not _TOTAL.match(t) and not math.isfinite(v))
            self.nonfinite = (step, where)
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
            elif (m := _UPDATE.match(t)) and not t.endswith("/total"):
                agg = self.updates.setdefault(m.group(1), [0, True])
                agg[0] += 1
                agg[1] = agg[1] and v == 0

    def finish(self) -> None:
        while self._steps:
            self._close(min(self._steps))

    def items(self, verbose: bool = False) -> list[dict]:
        """One dict per thing found: run, kind, step, detail (and names, the parameters or modules)."""
        self.finish()
        out: list[dict] = []
        if self.stopped is not None:
            out.append(self._item("STOPPED", self.stopped[0], f"training stopped at step {self.stopped[0]}: "
                                  + _clip(self.stopped[1].strip(), 2 * _DETAIL)))
        if self.nonfinite is not None:
            step, where = self.nonfinite
            origin = next((m for s, m in sorted(self.origins) if s >= step), "")
            origin = origin.split(". Usual repairs")[0]
            detail = f"first non-finite gradients at step {step} in {_modules(where, verbose) or 'the total norm'}"
            out.append(self._item("NON_FINITE_GRAD", step, detail + (f"; origin: {_clip(origin, _DETAIL)}" if origin else ""),
                                  where))
        for state in ("NO_GRAD", "NOT_IN_OPTIMIZER", "ZERO_GRAD"):
            if state in self.states:
                first, most, checks = self.states[state]
                names = self._names(state)
                count = f"{_plural(int(most), 'parameter')}" if names is None else names[0]
                out.append(self._item(state, first, f"{count} {state} from step {first} on "
                                                    f"({_plural(checks, 'check')})", names[1] if names else []))
        for kind, what in FINDING_WORDS:
            if kind in self.findings:
                steps, count = self.findings[kind]
                shown = ", ".join(map(str, steps)) + (" ..." if count > len(steps) else "")
                detail = f"{what} at {_plural(count, 'step')} ({shown})"
                if kind in self.texts:
                    detail += ": " + _clip(self.texts[kind][1], _DETAIL)
                out.append(self._item(kind, steps[0], detail))
        never = sorted(m for m, (n, zero) in self.updates.items() if n >= 2 and zero)
        if never:
            out.append(self._item("NEVER_UPDATED", None, "never updated in any measured step: "
                                  + _modules(never, verbose, universe=list(self.updates)), never))
        return out

    def _names(self, state: str) -> tuple[str, list[str]] | None:
        """(``head.* (2 params)``, the names) from the problem text the sink wrote, if any."""
        if state not in self.texts:
            return None
        text = self.texts[state][1]
        described = text.split(": ", 1)[0] if ": " in text else text
        return described, [n.strip() for n in described.split(",")]

    def _item(self, kind: str, step: int | None, detail: str, names: list[str] | None = None) -> dict:
        return {"run": self.name, "kind": kind, "step": step, "detail": detail, "names": list(names or [])}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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
    return text.replace("every parameter (", "every module (")


def _clip(text: str, n: int) -> str:
    """``text`` cut at a word boundary to at most ``n`` characters, with an ellipsis."""
    text = " ".join(text.split())
    if len(text) <= n:
        return text
    cut = text[:n].rsplit(" ", 1)[0].rstrip(",;:")
    return cut + " …"


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
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _safe(text) -> str:
    """Control characters escaped (ESC, BEL, CR, newlines...): names and texts from event files
    reach the terminal as visible escapes, never as terminal commands."""
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), str(text))


def _cell(value):
    """A CSV cell that no spreadsheet runs as a formula."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def _summaries(runs: dict[str, Run], verbose: bool, progress: bool) -> tuple[list[dict], dict[str, int]]:
    items: list[dict] = []
    found: dict[str, int] = {}
    for n, run in enumerate(runs.values(), 1):
        if progress:
            print(f"\rreading {n}/{len(runs)} runs: {_safe(run.name)[:60]}", end="", file=sys.stderr, flush=True)
        s = Summary(run.name)
        for p in run.files:
            for step, tag, value, _, text in events(p, run.skipped):
                run.read += 1
                s.add(step, tag, value, text)
        mine = s.items(verbose) if run.read else []
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
        print(f"gradhealth report: {_safe(exc)}", file=sys.stderr)
        return 2
    items, found = _summaries(runs, args.verbose, args.format == "text" and sys.stderr.isatty())
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
        print(f"gradhealth report: {_plural(len(readable), 'run')} read under {_safe(args.logdir)}")
        for r in readable:
            mine = [i for i in items if i["run"] == r.name]
            print(f"\n{_safe(r.name)}: " + ("nothing to report" if not mine else _plural(len(mine), "finding")))
            for i in mine:
                print(f"  {i['kind']}: {_safe(i['detail'])}")
            for s in r.skipped:
                print(f"  (skipped {_safe(s)})")
        if unreadable or notes:
            print(f"\nnot read ({_plural(len(unreadable) + len(notes), 'place')}):")
            for r in unreadable:
                why = "; ".join(r.skipped) or "no scalars in its event files"
                print(f"  {_safe(r.name)}: {_safe(why)}")
            for s in notes:
                print(f"  {_safe(s)}")
    if not readable:
        print(f"gradhealth report: nothing readable under {_safe(args.logdir)}"
              + (": no TensorBoard event files (events.out.tfevents.*) there; was anything logged?" if not runs and not notes else ""),
              file=sys.stderr)
        return 2
    return 0
